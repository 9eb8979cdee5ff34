"""``rollpacker-benchmark --compare speculative``: baseline / tail batching / tail batching +
speculative decoding + rollout history, on the same seeds and prompts.

``--runs`` passes over ``--seeds`` seeds; in each (pass, seed) the three columns run back to back,
in the order ABC on one and CBA on the next, so that a drift of this noisy machine's speed hits
every column alike. Each run covers ``--periods`` tail-batching periods of a prompt set sized so
that the runs see it more than once (``--epochs``; history needs a second epoch to matter).
Columns:

* ``baseline``: veRL-style scheduler (P0 x R0, wait for all);
* ``tail``: RollPacker tail batching;
* ``tail+spec+hist``: tail batching with ``rollout.speculative.method=suffix`` (drafts in long
  rounds, from the prompt's earlier responses and its running siblings) and
  ``tail_batching.history_routing=true``.

Prints every run's figures and, per column, the median [range] over all runs: training-loop time,
its split (rollout in short and long rounds, reward tail, scoring, training, weight sync, the
rest), long-round rollout time, acceptance, decode steps, wasted and aborted tokens, train reward,
pass@1, and speedup vs baseline; then the same runs priced in the GPU regime with each column's
packing-limit fraction (``rollpacker-price-benchmark``: how close its rollout comes to keeping
every decode slot busy with trained tokens). Then lines a script can read: ``tail batching speedup (baseline / tail): median X (range A-B)``, ``long-round rollout
speedup (speculation): X (range A-B)`` (tail / tail+spec+hist long-round rollout time) and, last,
``speedup: X`` (baseline / tail+spec+hist loop time; medians over runs, each ratio taken within
its own (pass, seed)). Writes <out>/speculative.json and <out>/curves.png (train reward and
validation pass@1 of the three columns, one line per run).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from rollpacker.benchmarks import price_benchmark
from rollpacker.benchmarks.common import (
    REPO,
    add_run_options,
    check_run_options,
    column_run_config,
    interleaved_order,
    plot_curves,
    ratio_line,
    run_columns,
    run_shape,
    spread,
)

COLUMNS = [
    ("baseline", "baseline", []),
    ("tail", "tail_batching", []),
    ("tail+spec+hist", "tail_batching", ["rollout.speculative.method=suffix", "tail_batching.history_routing=true"]),
]
COLORS = {"baseline": "tab:gray", "tail": "tab:blue", "tail+spec+hist": "tab:red"}


def column_figures(rows: list[dict]) -> dict:
    """One run's figures from its metrics.jsonl rows."""
    def total(key, sel=rows):
        return sum(float(r.get(key, 0.0)) for r in sel)

    long_rows = [r for r in rows if r["round_type"] == "long"]
    short_rows = [r for r in rows if r["round_type"] != "long"]
    loop = total("time/step")
    split = {"rollout_short": total("time/rollout", short_rows), "rollout_long": total("time/rollout", long_rows),
             "reward_tail": total("time/reward"), "scoring": total("time/logprob"), "train": total("time/train"),
             "weight_sync": total("time/weight_sync")}
    split["other"] = loop - sum(split.values())
    drafted, accepted = total("rollout/spec/draft_tokens"), total("rollout/spec/accepted_tokens")
    vals = [r["val/pass@1"] for r in rows if isinstance(r.get("val/pass@1"), (int, float))]
    hist = {k: total(f"rollout/history/{k}") for k in ("true_long", "false_long", "false_short", "routed")}
    return {
        "steps": len(rows), "loop_time": loop, "split": split,
        "long_rollout_time": split["rollout_long"] if long_rows else None,
        "long_rounds": len(long_rows),
        "acceptance": accepted / drafted if drafted else None,
        "draft_tokens": drafted, "accepted_tokens": accepted,
        "decode_steps": total("rollout/spec/decode_steps"),
        "long_decode_steps": total("rollout/spec/decode_steps", long_rows),
        "wasted_tokens": total("rollout/wasted_tokens"), "aborted_tokens": total("rollout/aborted_tokens"),
        "train_reward": statistics.mean(r["reward/mean"] for r in rows),
        "pass@1": vals[-1] if vals else None, "pass@1_initial": vals[0] if vals else None,
        "history": {**hist,
                    "precision": hist["true_long"] / (hist["true_long"] + hist["false_long"])
                    if hist["true_long"] + hist["false_long"] else None,
                    "recall": hist["true_long"] / (hist["true_long"] + hist["false_short"])
                    if hist["true_long"] + hist["false_short"] else None},
        "curves": {"step": [r["step"] for r in rows], "reward": [r["reward/mean"] for r in rows],
                   "val_step": [r["step"] for r in rows if "val/pass@1" in r], "val": vals},
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value, fmt="{:.2f}"):
    return "-" if value is None else fmt.format(value)


SPLIT_KEYS = ["rollout_short", "rollout_long", "reward_tail", "scoring", "train", "weight_sync", "other"]


def add_speedups(runs: dict[str, dict[str, dict]]) -> None:
    """Per run and column: ``speedup`` (baseline / column loop time, same run)."""
    for cols in runs.values():
        base = cols["baseline"]["loop_time"]
        for fig in cols.values():
            fig["speedup"] = base / fig["loop_time"]


ROWS = [("training-loop time (s)", "loop_time", "{:.1f}"), ("speedup vs baseline", "speedup", "{:.2f}"),
        ("long-round rollout time (s)", "long_rollout_time", "{:.1f}"),
        ("acceptance (accepted/drafted)", "acceptance", "{:.3f}"), ("decode steps, long rounds", "long_decode_steps", "{:.0f}"),
        ("wasted tokens", "wasted_tokens", "{:.0f}"), ("aborted tokens", "aborted_tokens", "{:.0f}"),
        ("train reward (mean)", "train_reward", "{:.3f}"), ("val pass@1 (end)", "pass@1", "{:.3f}")]


def _table(title: str, names: list[str], cell) -> None:
    print(f"\n{title}")
    print(f"| {'metric':<32} | " + " | ".join(f"{n:>20}" for n in names) + " |")
    print("| " + "-" * 32 + " | " + " | ".join("-" * 19 + ":" for _ in names) + " |")
    for row_title, key, fmt in ROWS:
        print(f"| {row_title:<32} | " + " | ".join(f"{cell(n, key, fmt):>20}" for n in names) + " |")
    for k in SPLIT_KEYS:
        print(f"| {'  time: ' + k + ' (s)':<32} | " + " | ".join(f"{cell(n, ('split', k), '{:.1f}'):>20}"
                                                              for n in names) + " |")


def _get(fig: dict, key):
    return fig["split"][key[1]] if isinstance(key, tuple) else fig[key]


def print_columns(runs: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Every run's figures, then median [range] over runs; returns the medians per column."""
    names = [c[0] for c in COLUMNS]
    for label, cols in runs.items():
        _table(label, names, lambda n, key, fmt, cols=cols: _fmt(_get(cols[n], key), fmt))
    _table(f"median [range] over {len(runs)} runs", names,
           lambda n, key, fmt: spread([_get(cols[n], key) for cols in runs.values()], fmt))
    medians: dict[str, dict] = {}
    for n in names:
        medians[n] = {key: _median([cols[n][key] for cols in runs.values()]) for _, key, _ in ROWS}
        medians[n]["split"] = {k: _median([cols[n]["split"][k] for cols in runs.values()]) for k in SPLIT_KEYS}
    return medians


def column_config(args, column: str, seed: int, run_dir: Path):
    """The run config of one column at one seed (same prompts and seeds in every column)."""
    return column_run_config(args, COLUMNS, column, seed, run_dir, evaluations=2)


def record(path: str, argv: list[str] | None, runs: dict[str, dict[str, dict]], model: str, extra: dict) -> None:
    """The docs' results file: provenance and every run's figures (the curves left out)."""
    from megatron_rl.tools.results_record import rows_spec, write_record

    args = list(sys.argv[1:] if argv is None else argv)
    raw = {label: {name: {k: v for k, v in fig.items() if k != "curves"} for name, fig in cols.items()}
           for label, cols in runs.items()}
    rows = ROWS + [(f"time: {k} (s, whole run)", ("split", k), "{:.1f}") for k in SPLIT_KEYS]
    write_record(path, name=Path(path).stem, command=shlex.join(["rollpacker-benchmark", "--compare", "speculative", *args]),
                 columns=[c[0] for c in COLUMNS], rows=rows_spec(rows), runs=raw, model_dir=model, extra=extra)
    print(f"results file: {path} (python -m megatron_rl.tools.results_tables puts it in the docs)")


def run_order(passes: int, seeds: list[int]) -> list[tuple[int, int, list[str]]]:
    """(pass, seed, columns in run order): as listed, then reversed, alternating."""
    return interleaved_order(passes, seeds, [c[0] for c in COLUMNS])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "runs/benchmark_speculative"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=2, help="passes over the seeds (each column runs seeds x runs times)")
    parser.add_argument("--record", metavar="PATH", help="also write the results file the docs' table is generated from "
                        "(docs/results/speculative.json; python -m megatron_rl.tools.results_tables renders it)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if error := check_run_options(args):
        print(error, file=sys.stderr)
        return 2
    if args.seeds < 1 or args.runs < 1:
        print("--seeds and --runs must be >= 1", file=sys.stderr)
        return 2

    steps, num_prompts = run_shape(args)
    first_seed = args.seed
    runs = run_columns(args, [c[0] for c in COLUMNS], column_config, column_figures)
    args.seed = first_seed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    add_speedups(runs)
    print(f"\nmodel {args.model}; {args.seeds} seed(s) from {first_seed} x {args.runs} pass(es); {steps} steps per run; "
          f"P0={args.prompts_per_step}, R0={args.responses}, {num_prompts} prompts "
          f"(~{steps * args.prompts_per_step / num_prompts:.1f} epochs), max_new_tokens={args.max_new_tokens}")
    medians = print_columns(runs)
    tail_hist = [cols["tail"]["history"] for cols in runs.values()]
    print("\nhistory prediction (tail column: scored, not acted on): precision "
          + ", ".join(_fmt(h["precision"], "{:.2f}") for h in tail_hist) + "; recall "
          + ", ".join(_fmt(h["recall"], "{:.2f}") for h in tail_hist) + " (per run)")
    tb = [cols["tail"]["speedup"] for cols in runs.values()]
    long = [cols["tail"]["long_rollout_time"] / cols["tail+spec+hist"]["long_rollout_time"] for cols in runs.values()
            if cols["tail"]["long_rollout_time"] and cols["tail+spec+hist"]["long_rollout_time"]]
    total = [cols["tail+spec+hist"]["speedup"] for cols in runs.values()]
    result = {"runs": runs, "medians": medians, "tail_batching_speedups": tb, "long_round_speedups": long,
              "speedups": total, "steps": steps, "num_prompts": num_prompts, "args": vars(args),
              "command": shlex.join(["rollpacker-benchmark", "--compare", "speculative",
                                     *(sys.argv[1:] if argv is None else argv)])}
    (out / "speculative.json").write_text(json.dumps(result, indent=2))
    if args.record:
        record(args.record, argv, runs, args.model, {"long_round_speedups": long})
    price_benchmark.report(out)  # the same runs priced in the GPU regime (their engine traces)
    try:
        plot_curves(runs, out / "curves.png", COLORS, width=11)
        print(f"curves: {out / 'curves.png'}")
    except Exception as exc:  # the numbers stand without the picture
        print(f"curve plot failed: {exc}", file=sys.stderr)
    print(ratio_line("tail batching speedup (baseline / tail)", tb))
    print(ratio_line("long-round rollout speedup (speculation)", long))
    print(f"speedup: {statistics.median(total):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
