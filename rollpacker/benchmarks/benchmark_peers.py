"""``rollpacker-benchmark --compare peers``: tail batching against what users would pick instead,
on the same code, workload, prompts and seeds.

Columns (``scheduler.name`` and overrides):

* ``baseline``: veRL-style synchronous rollout (P0 x R0, wait for all): the reference;
* ``partial_rollout``: slime's APRIL (``rollpacker.peers.partial_rollout``): over-provision, abort
  at P0 complete groups, continue the rest next step under newer weights (off-policy tokens);
* ``one_step_off``: veRL's one-step-off async (``rollpacker.peers.one_step_off``): step t+1's
  rollout overlaps step t's training (every batch one version old);
* ``tail``: RollPacker's tail batching (strictly on-policy);
* ``tail+spec+hist``: tail batching with suffix speculative decoding and history routing.

Defaults: the heavy-tail model ``artifacts/tiny-qwen2.5-rechecks``, 6 tail-batching periods (30
steps at P0 = 4), a prompt set seen twice (``--epochs 2``), pass@1 on 128 held-out prompts at the
start, every third of the run and the end, 3 seeds (``--seeds``) x 1 pass (``--runs``); within a
(pass, seed) the five columns run back to back, in the order above on one and reversed on the
next, so a drift of the machine's speed hits every column alike.

Per run and as median [range] over runs: training-loop time and speedup vs baseline, its split
(the rollout the step waited for, reward tail, scoring, training, weight sync, the rest), the
generation time (for one-step-off mostly hidden under training), wasted tokens, the off-policy token fraction and staleness (mean
over trained tokens and max), the stale tokens' mean TIS weight, train reward and pass@1. Then
the lines a script reads: ``speedup vs baseline <column>: X (range A-B, ...)``, ``peer wins
<peer>: ...`` (the figures where a peer beats tail batching), ``best peer: NAME`` (by median
speedup) and, last, ``speedup (tail batching vs best peer): X`` = the median over runs of the
best peer's loop time / tail batching's, each ratio within its own (pass, seed). Writes
<out>/peers.json and <out>/curves.png (train reward and pass@1 of the five columns, per run).
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
    ("partial_rollout", "partial_rollout", []),
    ("one_step_off", "one_step_off", []),
    ("tail", "tail_batching", []),
    ("tail+spec+hist", "tail_batching", ["rollout.speculative.method=suffix", "tail_batching.history_routing=true"]),
]
PEERS = ("partial_rollout", "one_step_off")
TAIL = "tail"
COLORS = {"baseline": "tab:gray", "partial_rollout": "tab:orange", "one_step_off": "tab:green", "tail": "tab:blue",
          "tail+spec+hist": "tab:red"}
SPLIT_KEYS = ("rollout", "reward_tail", "scoring", "train", "weight_sync", "other")


def run_figures(rows: list[dict]) -> dict:
    """One run's figures from its metrics.jsonl rows."""
    def total(key: str) -> float:
        return sum(float(r.get(key, 0.0)) for r in rows)

    loop = total("time/step")
    split = {"rollout": total("time/rollout") + total("time/rollout_wait"), "reward_tail": total("time/reward"),
             "scoring": total("time/logprob"), "train": total("time/train"), "weight_sync": total("time/weight_sync")}
    split["other"] = loop - sum(split.values())
    tokens = [float(r.get("batch/response_tokens_trained", 0.0)) for r in rows]

    def token_mean(key: str) -> float | None:
        """Weighted by each step's trained tokens; a step without the key trained none stale."""
        weight = sum(tokens)
        return sum(float(r.get(key, 0.0)) * n for r, n in zip(rows, tokens)) / weight if weight else None

    tis = [float(r["off_policy/tis_weight_mean"]) for r in rows if "off_policy/tis_weight_mean" in r]
    vals = [r["val/pass@1"] for r in rows if isinstance(r.get("val/pass@1"), (int, float))]
    generation = sum(float(r.get("rollout/generation_s", r.get("time/rollout", 0.0))) for r in rows)
    return {
        "steps": len(rows), "loop_time": loop, "split": split, "generation_time": generation,
        "wasted_tokens": total("rollout/wasted_tokens"), "aborted_tokens": total("rollout/aborted_tokens"),
        "off_policy_fraction": token_mean("off_policy/token_fraction"),
        "staleness_mean": token_mean("off_policy/staleness_mean"),
        "staleness_max": max((float(r.get("off_policy/staleness_max", 0.0)) for r in rows), default=0.0),
        "tis_weight_mean": statistics.mean(tis) if tis else None,
        "train_reward": statistics.mean(r["reward/mean"] for r in rows),
        "pass@1": vals[-1] if vals else None, "pass@1_initial": vals[0] if vals else None,
        "curves": {"step": [r["step"] for r in rows], "reward": [r["reward/mean"] for r in rows],
                   "val_step": [r["step"] for r in rows if "val/pass@1" in r], "val": vals},
    }


def add_ratios(runs: dict[str, dict[str, dict]]) -> None:
    """Per run and column: ``speedup`` (baseline / column loop time, same run). How close a column
    comes to the physical limit is the packing-limit fraction of its priced rows
    (``rollpacker-price-benchmark``, printed at the end of the run)."""
    for cols in runs.values():
        base = cols["baseline"]["loop_time"]
        for fig in cols.values():
            fig["speedup"] = base / fig["loop_time"]


ROWS = [("training-loop time (s)", "loop_time", "{:.1f}"), ("speedup vs baseline", "speedup", "{:.2f}"),
        ("rollout time waited for (s)", ("split", "rollout"), "{:.1f}"),
        ("generation time (s)", "generation_time", "{:.1f}"), ("wasted tokens", "wasted_tokens", "{:.0f}"),
        ("off-policy token fraction", "off_policy_fraction", "{:.3f}"), ("staleness, mean", "staleness_mean", "{:.3f}"),
        ("staleness, max", "staleness_max", "{:.0f}"), ("TIS weight, stale tokens", "tis_weight_mean", "{:.3f}"),
        ("train reward (mean)", "train_reward", "{:.3f}"), ("val pass@1 (start)", "pass@1_initial", "{:.3f}"),
        ("val pass@1 (end)", "pass@1", "{:.3f}")]
"""(title, figure key, format) of each table row; a tuple key reads ``fig[a][b]``."""


def figure(fig: dict, key):
    return fig[key[0]][key[1]] if isinstance(key, tuple) else fig[key]


def _cell(values: list, fmt: str) -> str:
    return spread([v for v in values if v is not None], fmt)


def print_table(title: str, runs: list[dict[str, dict]]) -> None:
    """One row per figure, one column per arm: median [range] over ``runs``."""
    names = [c[0] for c in COLUMNS]
    print(f"\n{title}")
    print(f"| {'metric':<30} | " + " | ".join(f"{n:>20}" for n in names) + " |")
    print("| " + "-" * 30 + " | " + " | ".join("-" * 19 + ":" for _ in names) + " |")
    for row_title, key, fmt in ROWS + [(f"  time: {k} (s)", ("split", k), "{:.1f}") for k in SPLIT_KEYS[1:]]:
        cells = [_cell([figure(cols[n], key) for cols in runs], fmt) for n in names]
        print(f"| {row_title:<30} | " + " | ".join(f"{c:>20}" for c in cells) + " |")


def median_of(runs: list[dict[str, dict]], name: str, key) -> float | None:
    values = [figure(cols[name], key) for cols in runs if figure(cols[name], key) is not None]
    return statistics.median(values) if values else None


def peer_wins(runs: list[dict[str, dict]], peer: str) -> list[str]:
    """The figures where ``peer``'s median beats tail batching's (plainly stated in the report)."""
    better = {"loop_time": -1, "wasted_tokens": -1, "train_reward": 1, "pass@1": 1}
    wins = []
    for key, sign in better.items():
        a, b = median_of(runs, peer, key), median_of(runs, TAIL, key)
        if a is not None and b is not None and sign * (a - b) > 0:
            wins.append(f"{key} {a:.3f} vs {b:.3f}")
    return wins


def record(path: str, argv: list[str] | None, runs: dict[str, dict[str, dict]], best: str, model: str) -> None:
    """The docs' results file: provenance and every run's figures (the curves left out)."""
    from megatron_rl.tools.results_record import rows_spec, write_record

    args = list(sys.argv[1:] if argv is None else argv)
    raw = {label: {name: {k: v for k, v in fig.items() if k != "curves"} for name, fig in cols.items()}
           for label, cols in runs.items()}
    rows = ROWS[:2] + [("speedup vs the best peer", "speedup_vs_best_peer", "{:.2f}")] + ROWS[2:]
    rows += [(f"time: {k} (s)", ("split", k), "{:.1f}") for k in SPLIT_KEYS[1:]]
    write_record(path, name=Path(path).stem, command=shlex.join(["rollpacker-benchmark", "--compare", "peers", *args]),
                 columns=[c[0] for c in COLUMNS], rows=rows_spec(rows), runs=raw,
                 model_dir=model, extra={"best_peer": best})
    print(f"results file: {path} (python -m megatron_rl.tools.results_tables puts it in the docs)")


def run_order(passes: int, seeds: list[int]) -> list[tuple[int, int, list[str]]]:
    """(pass, seed, columns in run order): as listed, then reversed, alternating."""
    return interleaved_order(passes, seeds, [c[0] for c in COLUMNS])


def column_config(args, column: str, seed: int, run_dir: Path):
    """The run config of one column at one seed (the same prompts, seeds and evaluation in every column)."""
    return column_run_config(args, COLUMNS, column, seed, run_dir, evaluations=3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "runs/benchmark_peers"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=1, help="passes over the seeds (each column runs seeds x runs times)")
    parser.add_argument("--record", metavar="PATH", help="also write the results file the docs' table is generated from "
                        "(docs/results/peers.json; python -m megatron_rl.tools.results_tables renders it)")
    add_run_options(parser)
    parser.set_defaults(periods=6, eval_prompts=128)
    args = parser.parse_args(argv)
    if error := check_run_options(args):
        print(error, file=sys.stderr)
        return 2
    if args.seeds < 1 or args.runs < 1:
        print("--seeds and --runs must be >= 1", file=sys.stderr)
        return 2

    steps, num_prompts = run_shape(args)
    first_seed = args.seed
    runs = run_columns(args, [c[0] for c in COLUMNS], column_config, run_figures)
    args.seed = first_seed
    out = Path(args.out)
    add_ratios(runs)
    every = list(runs.values())
    print(f"\nmodel {args.model}; {args.seeds} seed(s) from {first_seed} x {args.runs} pass(es); {steps} steps per run; "
          f"P0={args.prompts_per_step}, R0={args.responses}, {num_prompts} prompts "
          f"(~{steps * args.prompts_per_step / num_prompts:.1f} epochs), max_new_tokens={args.max_new_tokens}, "
          f"pass@1 on {args.eval_prompts} prompts")
    for label, cols in runs.items():
        print_table(label, [cols])
    print_table(f"median [range] over {len(every)} runs", every)
    print()
    for name in (c[0] for c in COLUMNS):
        print(ratio_line(f"speedup vs baseline {name}", [cols[name]["speedup"] for cols in every]))
    for peer in PEERS:
        print(f"staleness {peer}: off-policy token fraction {_cell([c[peer]['off_policy_fraction'] for c in every], '{:.3f}')}"
              f", mean {_cell([c[peer]['staleness_mean'] for c in every], '{:.3f}')}"
              f", max {_cell([c[peer]['staleness_max'] for c in every], '{:.0f}')}")
        wins = peer_wins(every, peer)
        print(f"peer wins {peer}: " + ("; ".join(wins) if wins else "none (tail batching is ahead on loop time, "
                                       "wasted tokens, train reward and pass@1)"))
    best = max(PEERS, key=lambda p: median_of(every, p, "speedup") or 0.0)
    for cols in every:  # a figure of every column, so the recorded table can show it per run
        for fig in cols.values():
            fig["speedup_vs_best_peer"] = cols[best]["loop_time"] / fig["loop_time"] if fig is not cols[best] else None
    vs_best = [cols[best]["loop_time"] / cols[TAIL]["loop_time"] for cols in every]
    spec_vs_best = [cols[best]["loop_time"] / cols["tail+spec+hist"]["loop_time"] for cols in every]
    result = {"runs": runs, "steps": steps, "num_prompts": num_prompts, "best_peer": best,
              "tail_vs_best_peer": vs_best, "tail_spec_hist_vs_best_peer": spec_vs_best, "args": vars(args),
              "command": shlex.join(["rollpacker-benchmark", "--compare", "peers", *(sys.argv[1:] if argv is None else argv)])}
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(result, indent=2))
    if args.record:
        record(args.record, argv, runs, best, args.model)
    price_benchmark.report(out)  # the same runs priced in the GPU regime (their engine traces)
    try:
        plot_curves(runs, out / "curves.png", COLORS)
        print(f"curves: {out / 'curves.png'}")
    except Exception as exc:  # the numbers stand without the picture
        print(f"curve plot failed: {exc}", file=sys.stderr)
    print(f"best peer: {best}")
    print(ratio_line("speedup (tail+spec+hist vs best peer)", spec_vs_best))
    print(f"speedup (tail batching vs best peer): {statistics.median(vs_best):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
