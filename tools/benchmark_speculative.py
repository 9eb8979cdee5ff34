"""``tools/benchmark.py --compare speculative``: baseline / tail batching / tail batching +
speculative decoding + rollout history, on the same seeds and prompts (issue #15).

Per seed the three columns run back to back (this box is shared and noisy: neighbouring runs see
the same load), each over ``--periods`` tail-batching periods of a prompt set sized so that the
runs see it more than once (``--epochs``; history needs a second epoch to matter). Columns:

* ``baseline``: veRL-style scheduler (P0 x R0, wait for all);
* ``tail``: RollPacker tail batching;
* ``tail+spec+hist``: tail batching with ``rollout.speculative.method=suffix`` (drafts in long
  rounds, from the prompt's earlier responses and its running siblings) and
  ``scheduler.history_routing=true``.

Prints every seed's figures and the median over seeds per column: training-loop time, its split
(rollout in short and long rounds, reward tail, scoring, training, weight sync, the rest), long-
round rollout time, acceptance, decode steps, wasted tokens, aborted tokens, train reward and
pass@1, the history's prediction precision/recall (from the tail column, where the prediction is
scored but not acted on); then ``tail batching speedup: median X (range A-B)``,
``long-round rollout speedup (speculation): X.XX`` (tail / tail+spec+hist long-round rollout
time, median over seeds) and, last, ``speedup: X.XX`` (baseline / tail+spec+hist training-loop
time, median over seeds). Writes <out>/speculative.json and <out>/curves.png (train reward and
validation pass@1 of the three columns overlaid, one line per seed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.benchmark import REPO, benchmark_config, period_steps  # noqa: E402

COLUMNS = [
    ("baseline", "baseline", []),
    ("tail", "tail_batching", []),
    ("tail+spec+hist", "tail_batching", ["rollout.speculative.method=suffix", "scheduler.history_routing=true"]),
]


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


def print_columns(per_seed: dict[int, dict[str, dict]]) -> dict[str, dict]:
    """Every seed's figures, then the medians; returns the medians per column."""
    names = [c[0] for c in COLUMNS]
    rows = [("training-loop time (s)", "loop_time", "{:.1f}"), ("long-round rollout time (s)", "long_rollout_time", "{:.1f}"),
            ("acceptance (accepted/drafted)", "acceptance", "{:.3f}"), ("decode steps, long rounds", "long_decode_steps", "{:.0f}"),
            ("wasted tokens", "wasted_tokens", "{:.0f}"), ("aborted tokens", "aborted_tokens", "{:.0f}"),
            ("train reward (mean)", "train_reward", "{:.3f}"), ("val pass@1 (end)", "pass@1", "{:.3f}")]
    split_keys = ["rollout_short", "rollout_long", "reward_tail", "scoring", "train", "weight_sync", "other"]
    medians: dict[str, dict] = {}
    for name in names:
        runs = [per_seed[s][name] for s in per_seed]
        medians[name] = {key: _median([r[key] for r in runs]) for _, key, _ in rows}
        medians[name]["split"] = {k: _median([r["split"][k] for r in runs]) for k in split_keys}
    for label, data in [*[(f"seed {s}", per_seed[s]) for s in per_seed], ("median over seeds", medians)]:
        print(f"\n{label}")
        print(f"| {'metric':<32} | " + " | ".join(f"{n:>15}" for n in names) + " |")
        print("| " + "-" * 32 + " | " + " | ".join("-" * 14 + ":" for _ in names) + " |")
        for title, key, fmt in rows:
            print(f"| {title:<32} | " + " | ".join(f"{_fmt(data[n][key], fmt):>15}" for n in names) + " |")
        for k in split_keys:
            print(f"| {'  time: ' + k + ' (s)':<32} | " + " | ".join(f"{_fmt(data[n]['split'][k], '{:.1f}'):>15}"
                                                                  for n in names) + " |")
    return medians


def plot(per_seed: dict[int, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"baseline": "tab:gray", "tail": "tab:blue", "tail+spec+hist": "tab:red"}
    for seed, cols in per_seed.items():
        for name, fig_data in cols.items():
            c = fig_data["curves"]
            label = name if seed == min(per_seed) else None
            ax_r.plot(c["step"], c["reward"], color=colors[name], alpha=0.8, label=label)
            if c["val"]:
                ax_v.plot(c["val_step"], c["val"], "o-", color=colors[name], alpha=0.8, label=label)
    ax_r.set(title="train reward (mean per step)", xlabel="step")
    ax_v.set(title="validation pass@1", xlabel="step")
    for ax in (ax_r, ax_v):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "artifacts/tiny-qwen2.5-rechecks"))
    parser.add_argument("--out", default=str(REPO / "runs/benchmark_speculative"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--periods", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=2.0, help="passes over the prompt set in the run")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234, help="first seed; seeds are seed, seed+1, ...")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides for every run")
    args = parser.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        print(f"no model at {args.model}: build it with python tools/make_tiny_model.py --out {args.model} "
              "--recheck-rate 0.08", file=sys.stderr)
        return 2
    if args.epochs <= 1:
        print("--epochs must be > 1: rollout history needs an earlier epoch", file=sys.stderr)
        return 2

    from megatron_rl.metrics import read_metrics
    from megatron_rl.train import build_and_run

    probe = benchmark_config(args, "tail_batching", 1, Path(args.out))
    steps = args.periods * period_steps(probe.scheduler.eta_prompts, args.prompts_per_step)
    num_prompts = max(args.prompts_per_step, round(steps * args.prompts_per_step / args.epochs))
    out = Path(args.out)
    per_seed: dict[int, dict[str, dict]] = {}
    first_seed = args.seed
    for seed in range(first_seed, first_seed + args.seeds):
        per_seed[seed] = {}
        for name, scheduler, extra in COLUMNS:
            run_dir = out / f"seed{seed}" / name.replace("+", "_")
            args.seed = seed
            cfg = benchmark_config(args, scheduler, steps, run_dir, [
                f"data.builtin_num_prompts={num_prompts}", f"data.eval_every={max(1, steps // 2)}", *extra])
            print(f"[benchmark] seed {seed} {name}: {steps} steps x {args.prompts_per_step} prompts x "
                  f"{args.responses} responses over {num_prompts} prompts -> {run_dir}", flush=True)
            start = time.monotonic()
            build_and_run(cfg)
            per_seed[seed][name] = column_figures(read_metrics(run_dir))
            per_seed[seed][name]["wall_time_with_startup"] = time.monotonic() - start
    print(f"\nmodel {args.model}; {args.seeds} seed(s) from {first_seed}; {steps} steps per run; "
          f"P0={args.prompts_per_step}, R0={args.responses}, {num_prompts} prompts "
          f"(~{steps * args.prompts_per_step / num_prompts:.1f} epochs), max_new_tokens={args.max_new_tokens}")
    medians = print_columns(per_seed)
    tail_hist = [per_seed[s]["tail"]["history"] for s in per_seed]
    print("\nhistory prediction (tail column: scored, not acted on): precision "
          + ", ".join(_fmt(h["precision"], "{:.2f}") for h in tail_hist) + "; recall "
          + ", ".join(_fmt(h["recall"], "{:.2f}") for h in tail_hist) + " (per seed)")
    tb = [per_seed[s]["baseline"]["loop_time"] / per_seed[s]["tail"]["loop_time"] for s in per_seed]
    print(f"tail batching speedup (baseline / tail): median {statistics.median(tb):.2f} "
          f"(range {min(tb):.2f}-{max(tb):.2f}, per seed " + ", ".join(f"{x:.2f}" for x in tb) + ")")
    long = [per_seed[s]["tail"]["long_rollout_time"] / per_seed[s]["tail+spec+hist"]["long_rollout_time"]
            for s in per_seed if per_seed[s]["tail"]["long_rollout_time"] and per_seed[s]["tail+spec+hist"]["long_rollout_time"]]
    total = [per_seed[s]["baseline"]["loop_time"] / per_seed[s]["tail+spec+hist"]["loop_time"] for s in per_seed]
    result = {"per_seed": per_seed, "medians": medians, "tail_batching_speedups": tb,
              "long_round_speedups": long, "speedups": total, "steps": steps, "num_prompts": num_prompts}
    (out / "speculative.json").write_text(json.dumps(result, indent=2))
    try:
        plot(per_seed, out / "curves.png")
        print(f"curves: {out / 'curves.png'}")
    except Exception as exc:  # the numbers stand without the picture
        print(f"curve plot failed: {exc}", file=sys.stderr)
    print("long-round rollout speedup (speculation): "
          + (f"{statistics.median(long):.2f} (per seed " + ", ".join(f"{x:.2f}" for x in long) + ")" if long else "n/a"))
    print(f"speedup: {statistics.median(total):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
