"""Baseline vs RollPacker tail batching, side by side, on the real stack (CPU here).

    rollpacker-benchmark [--periods 2] [--prompts-per-step 16] [--responses 4] [key=value ...]
    rollpacker-benchmark --compare stream ...   # tail batching without vs with the stream trainer

Both runs use the same tiny model, task, seeds, engine, reward and training code and the same
number of prompts: a whole number of tail-batching periods (with eta_P = 1.25, four short rounds
then one long round = five steps, which consume exactly the prompts of five baseline steps).
The long tail comes from the model's own response lengths; nothing is slowed down artificially.

``--seeds N --runs R`` repeats the pair over N seeds and R passes, A B on one (pass, seed) and
B A on the next, so a drift of this noisy machine's speed hits both runs alike. Prints each run's
loop times and ratio, then per-round-type and overall step time, rollout time, engine occupancy,
wasted tokens and validation reward as median [range] over the runs, and a last line
``speedup: X.XX`` = the median over runs of baseline training-loop time / RollPacker
training-loop time (every step: rollout, reward, logprobs, train, weight sync; start-up of
Ray/engines/trainer is excluded because it is identical for both). Results go to
<out>/benchmark.json and, with rollpacker-plot-timeline, to <out>/timeline.png (first run).

The comparisons with a module and options of their own (:data:`OWN_COMPARISONS`) get the rest of
the command line (``--compare NAME`` taken out); ``python -m rollpacker.benchmarks.<module> --help``
lists their options:

``--compare weight_sync`` (``benchmark_weight_sync``) times the weight sync alone, three formats
in one run (hf files, sharded files, tensor push; ``--repeats`` pushes each) against an in-memory
copy of the same bytes, with each push split into transport and the engine's own load; its
default model is the 70M random one of docs/weight_sync.md, large enough for the sync to move bytes worth
measuring. Its last two lines are ``weight-sync speedup (tensor vs sharded):`` and ``tensor
bandwidth fraction of memcpy:``.

``--compare speculative`` (``benchmark_speculative``) runs baseline / tail batching / tail
batching + speculative decoding + rollout history over ``--seeds`` seeds, on the re-checking
model by default; its last lines are ``long-round rollout speedup (speculation):`` and
``speedup:``.

``--compare arms`` (``benchmark_arms``): arms that differ in a few config keys, interleaved.

``--compare peers`` (``benchmark_peers``): baseline / partial rollout / one-step-off async / tail
batching / tail batching + speculation + history over ``--seeds`` seeds (3 by default), 30 steps
on the re-checking model: speed, staleness and learning of the peers users would pick instead of
tail batching; its last line is ``speedup (tail batching vs best peer):`` (docs/peers.md).

``--compare cumulative`` (``benchmark_cumulative``): tail batching alone, + planner, + stream
trainer, + speculation and history (each column the one before plus one mechanism) over 3 seeds x 2
passes on the re-checking model, beside the simulator's cumulative figures for the 7B/14B/32B
recipes; writes the raw figures with their provenance (docs/results/cumulative.md).

``--compare old_logprobs`` runs the baseline scheduler twice, ``algorithm.recompute_old_logprobs``
true vs false (the separate scoring forward vs the training forward's own logprobs).

``--compare quantization`` (``benchmark_quantization``): full-precision vs int8 rollout: engine
throughput on larger random models and training curves on the tiny model.

``--compare stream`` runs tail batching twice, stream trainer off and on (``stream.enabled``),
and adds the long-round step time of each, their ratio (``long-round speedup:``) and the stream
metrics (start point, fraction trained before the rollout ended, training hidden under rollout).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from megatron_rl.benchmarks import benchmark_quantization, benchmark_weight_sync
from rollpacker.benchmarks import (
    benchmark_arms,
    benchmark_cumulative,
    benchmark_peers,
    benchmark_speculative,
    price_benchmark,
)
from rollpacker.benchmarks.common import REPO, benchmark_config, period_steps, spread
from rollpacker.benchmarks.plot_timeline import plot_timeline
from rollpacker.config import TailBatchingConfig

# (run name, scheduler, extra overrides, column label) of each two-run comparison this module runs.
COMPARISONS = {
    "schedulers": [("baseline", "baseline", [], "baseline"), ("tail_batching", "tail_batching", [], "RollPacker")],
    "stream": [("tail_batching", "tail_batching", ["stream.enabled=false"], "no stream"),
               ("stream", "tail_batching", ["stream.enabled=true"], "stream")],
    "old_logprobs": [("recompute", "baseline", ["algorithm.recompute_old_logprobs=true"], "recompute"),
                     ("fused", "baseline", ["algorithm.recompute_old_logprobs=false"], "train fwd")],
}

OWN_COMPARISONS: dict[str, Callable[[list[str]], int]] = {
    "weight_sync": benchmark_weight_sync.main,
    "speculative": benchmark_speculative.main,
    "quantization": benchmark_quantization.main,
    "arms": benchmark_arms.main,
    "peers": benchmark_peers.main,
    "cumulative": benchmark_cumulative.main,
}
"""Comparisons with a module and options of their own: ``--compare NAME`` calls ``main(rest)``
with the command line less ``--compare NAME``."""


def split_compare(argv: list[str]) -> tuple[str, list[str]]:
    """(the ``--compare`` name, default 'schedulers'; the other arguments, in order)."""
    name, rest, i = "schedulers", [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--compare="):
            name = arg.split("=", 1)[1]
        elif arg == "--compare" and i + 1 < len(argv):
            name = argv[i + 1]
            i += 1
        else:
            rest.append(arg)
        i += 1
    return name, rest


def summarize(rows: list[dict]) -> dict:
    """Per-round-type and overall figures of one run's metrics.jsonl rows."""
    out: dict = {"steps": len(rows), "loop_time": sum(r["time/step"] for r in rows),
                 "rollout_time": sum(r["time/rollout"] for r in rows)}
    for rt in sorted({r["round_type"] for r in rows}):
        sel = [r for r in rows if r["round_type"] == rt]
        out[rt] = {
            "steps": len(sel),
            "step_time_mean": statistics.mean(r["time/step"] for r in sel),
            "rollout_time_mean": statistics.mean(r["time/rollout"] for r in sel),
            "occupancy_mean": statistics.mean(r["rollout/engine_occupancy"] for r in sel),
            "response_length_mean": statistics.mean(r["response_length/mean"] for r in sel),
            "response_length_max": max(r["response_length/max"] for r in sel),
        }
    out["occupancy_mean"] = statistics.mean(r["rollout/engine_occupancy"] for r in rows)
    out["weight_sync_time_mean"] = statistics.mean(r["time/weight_sync"] for r in rows)
    out["logprob_time_mean"] = statistics.mean(r.get("time/logprob", 0.0) for r in rows)
    out["train_time_mean"] = statistics.mean(r.get("time/train", 0.0) for r in rows)
    out["wasted_tokens"] = sum(r.get("rollout/wasted_tokens", 0.0) for r in rows)
    out["generated_tokens"] = sum(r["response_length/mean"] * r["batch/samples_trained"] for r in rows)
    out["train_reward_mean"] = statistics.mean(r["reward/mean"] for r in rows)
    last = rows[-1]
    out["final_val_pass@1"] = last.get("val/pass@1")
    streamed = [r for r in rows if r.get("stream/started")]
    if streamed:
        out["stream"] = {key: statistics.mean(r[f"stream/{key}"] for r in streamed)
                         for key in ("start_fraction", "trained_fraction_before_rollout_end", "hidden_train_s",
                                     "exposed_train_s")}
        out["stream"]["rounds"] = len(streamed)
    out["initial_val_pass@1"] = rows[0].get("val/pass@1")
    return out


def response_length_tail(run_dir: Path) -> tuple[float, float]:
    """(median, max) length of every finished response of the baseline run (all run to the end)."""
    lengths = []
    for line in (run_dir / "rollout_timeline.jsonl").read_text().splitlines():
        rec = json.loads(line)
        lengths += [n for n in rec.get("response_lengths", [])]
    return (statistics.median(lengths), max(lengths)) if lengths else (0.0, 0.0)


def table_rows(run: dict) -> list[tuple[str, float | None, str]]:
    """(metric, value, format) of one run's summary, in table order."""
    rows = [("training-loop time (s)", run["loop_time"], "{:.1f}"), ("rollout time (s)", run["rollout_time"], "{:.1f}"),
            ("step time, all rounds (s)", run["loop_time"] / run["steps"], "{:.2f}")]
    for rt in ("short", "long"):
        part = run.get(rt, {})
        rows += [(f"step time, {rt} rounds (s)", part.get("step_time_mean"), "{:.2f}"),
                 (f"rollout time, {rt} rounds (s)", part.get("rollout_time_mean"), "{:.2f}"),
                 (f"occupancy, {rt} rounds", part.get("occupancy_mean"), "{:.2f}")]
    st = run.get("stream", {})
    rows += [("stream: start (fraction complete)", st.get("start_fraction"), "{:.2f}"),
             ("stream: trained before rollout end", st.get("trained_fraction_before_rollout_end"), "{:.2f}"),
             ("stream: train time hidden (s/round)", st.get("hidden_train_s"), "{:.2f}"),
             ("stream: train time exposed (s/round)", st.get("exposed_train_s"), "{:.2f}"),
             ("scoring (logprob) time (s/step)", run["logprob_time_mean"], "{:.3f}"),
             ("train time (s/step)", run["train_time_mean"], "{:.3f}"),
             ("weight sync time (s/step)", run["weight_sync_time_mean"], "{:.3f}"),
             ("engine occupancy (mean)", run["occupancy_mean"], "{:.2f}"),
             ("wasted tokens (aborted+discarded)", run["wasted_tokens"], "{:.0f}"),
             ("train reward (mean over run)", run["train_reward_mean"], "{:.3f}"),
             ("val pass@1 before training", run["initial_val_pass@1"], "{:.3f}"),
             ("val pass@1 after training", run["final_val_pass@1"], "{:.3f}")]
    return rows


def print_table(base_runs: list[dict], tb_runs: list[dict], labels: tuple[str, str] = ("baseline", "RollPacker")) -> None:
    """Median [range] over runs of every figure, both columns; ratio = median of per-run ratios."""
    print(f"| {'metric':<36} | {labels[0]:>20} | {labels[1]:>20} | {'ratio':>18} |")
    print("| " + "-" * 36 + " | " + "-" * 19 + ": | " + "-" * 19 + ": | " + "-" * 17 + ": |")
    for i, (name, _, fmt) in enumerate(table_rows(base_runs[0])):
        a = [table_rows(r)[i][1] for r in base_runs]
        b = [table_rows(r)[i][1] for r in tb_runs]
        if all(v is None for v in a + b):
            continue
        ratios = [x / y for x, y in zip(a, b) if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y]
        print(f"| {name:<36} | {spread(a, fmt):>20} | {spread(b, fmt):>20} | {spread(ratios, '{:.2f}x'):>18} |")


def record_pairs(path: str, command: list[str], base: list[dict], tb: list[dict], lengths: list[tuple[float, float]],
                 model: str) -> None:
    """The docs' results file of a two-run comparison: every run's table figures, by row title."""
    import shlex

    from megatron_rl.tools.results_record import write_record

    runs = {}
    for a, b, (median, longest) in zip(base, tb, lengths):
        figures_a = {title: value for title, value, _ in table_rows(a)}
        figures_a.update({"baseline response length, median (tokens)": median, "baseline response length, max (tokens)": longest})
        runs[f"seed {a['seed']}, pass {a['run']}"] = {"baseline": figures_a,
                                                    "RollPacker": {title: value for title, value, _ in table_rows(b)}}
    rows = [{"title": title, "key": title, "format": fmt} for title, _, fmt in table_rows(base[0])
            + [("baseline response length, median (tokens)", None, "{:.0f}"), ("baseline response length, max (tokens)", None, "{:.0f}")]
            if any(cols[side].get(title) is not None for cols in runs.values() for side in cols)]
    write_record(path, name=Path(path).stem, command=shlex.join(command), model_dir=model, runs=runs, rows=rows,
                 columns=["baseline", "RollPacker", {"name": "ratio", "ratio": ["baseline", "RollPacker"], "format": "{:.2f}x"}])
    print(f"results file: {path} (python -m megatron_rl.tools.results_tables puts it in the docs)")


def main(argv: list[str] | None = None) -> int:
    compare, rest = split_compare(list(sys.argv[1:] if argv is None else argv))
    if compare in OWN_COMPARISONS:
        return OWN_COMPARISONS[compare](rest)
    if compare not in COMPARISONS:
        print(f"--compare {compare!r}: choose from {', '.join(sorted([*COMPARISONS, *OWN_COMPARISONS]))}",
              file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "artifacts/tiny-qwen2.5"))
    parser.add_argument("--out", default=str(REPO / "runs/benchmark"))
    parser.add_argument("--periods", type=int, default=2, help="tail-batching periods (short rounds + long round)")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--compare", choices=sorted([*COMPARISONS, *OWN_COMPARISONS]), default="schedulers",
                        help="baseline vs tail batching (schedulers); tail batching without vs with the stream "
                             "trainer (stream); recomputed vs training-forward old logprobs (old_logprobs); "
                             f"{', '.join(sorted(OWN_COMPARISONS))}: the module's own options (see above)")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides for both runs")
    parser.add_argument("--seeds", type=int, default=1,
                        help="seeds from --seed (two-run comparisons; --compare speculative defaults to 3)")
    parser.add_argument("--runs", type=int, default=1, help="passes over the seeds, the two runs interleaved A B / B A")
    parser.add_argument("--record", metavar="PATH", help="also write the results file the docs' table is generated from "
                        "(e.g. docs/results/tail_batching_heavy.json; python -m megatron_rl.tools.results_tables)")
    args = parser.parse_args(rest)
    if not (Path(args.model) / "config.json").is_file():
        print(f"no model at {args.model}: build it with megatron-rl-make-tiny-model --out {args.model}",
              file=sys.stderr)
        return 2

    from megatron_rl.runtime.metrics_logger import read_metrics
    from megatron_rl.train import build_and_run

    probe = benchmark_config(args, "tail_batching", 1, Path(args.out))
    tbc = probe.section(TailBatchingConfig)
    steps = args.periods * period_steps(tbc.eta_prompts, args.prompts_per_step)
    out = Path(args.out)
    runs = COMPARISONS[compare]
    results: dict[str, list[dict]] = {name: [] for name, *_ in runs}
    first_seed, flip = args.seed, False
    for rep in range(args.runs):
        for seed in range(first_seed, first_seed + args.seeds):
            # A B on one (pass, seed), B A on the next: drift of the machine hits both alike.
            for name, scheduler, extra, _ in (runs[::-1] if flip else runs):
                run_dir = out / f"pass{rep}" / f"seed{seed}" / name
                args.seed = seed
                cfg = benchmark_config(args, scheduler, steps, run_dir, extra)
                print(f"[benchmark] pass {rep} seed {seed} {name}: {steps} steps x {args.prompts_per_step} prompts x "
                      f"{args.responses} responses -> {run_dir}", flush=True)
                start = time.monotonic()
                build_and_run(cfg)
                summary = summarize(read_metrics(run_dir))
                summary.update(wall_time_with_startup=time.monotonic() - start, seed=seed, run=rep,
                               run_dir=str(run_dir))
                results[name].append(summary)
            flip = not flip

    (first, *_), (second, *_) = runs
    base, tb = results[first], results[second]
    lengths = [response_length_tail(Path(r["run_dir"])) for r in base]
    median, longest = statistics.median(m for m, _ in lengths), max(x for _, x in lengths)
    print()
    print(f"model {args.model}; {steps} steps each; {args.seeds} seed(s) from {first_seed} x {args.runs} pass(es); "
          f"P0={args.prompts_per_step}, R0={args.responses}, max_new_tokens={args.max_new_tokens}, "
          f"eta_P/eta_R={tbc.eta_prompts}/{tbc.eta_responses}")
    print(f"{first} response lengths: median {median:.0f}, max {longest:.0f} tokens "
          f"(max/median = {longest / max(median, 1):.1f})")
    for a, b in zip(base, tb):
        print(f"  seed {a['seed']} pass {a['run']}: {a['loop_time']:.1f} s / {b['loop_time']:.1f} s = "
              f"{a['loop_time'] / b['loop_time']:.2f}x")
    print_table(base, tb, (runs[0][3], runs[1][3]))
    speedups = [a["loop_time"] / b["loop_time"] for a, b in zip(base, tb)]
    speedup = statistics.median(speedups)
    import shlex

    summary_out = {"steps": steps, "speedup": speedup, "speedups": speedups, "length_median": median,
                   "length_max": longest, "runs": results, "args": vars(args),
                   "labels": {name: label for name, _, _, label in runs},
                   "command": shlex.join(["rollpacker-benchmark", *(["--compare", compare] if compare != "schedulers" else []),
                                          *rest])}
    if compare == "stream":
        long_ratios = [a["long"]["step_time_mean"] / b["long"]["step_time_mean"] for a, b in zip(base, tb)
                       if "long" in a and "long" in b]
        if long_ratios:
            summary_out["long_round_speedups"] = long_ratios
            print(f"long-round speedup: {statistics.median(long_ratios):.2f} "
                  f"(range {min(long_ratios):.2f}-{max(long_ratios):.2f})")
    (out / "benchmark.json").write_text(json.dumps(summary_out, indent=2))
    if args.record:
        record_pairs(args.record, ["rollpacker-benchmark", *(["--compare", compare] if compare != "schedulers" else []), *rest],
                     base, tb, lengths, args.model)
    price_benchmark.report(out)  # the same runs priced in the GPU regime (their engine traces)
    try:
        plot_timeline(Path(base[0]["run_dir"]), Path(tb[0]["run_dir"]), out / "timeline.png",
                      titles=None if compare == "schedulers" else tuple(
                          f"{scheduler.replace('_', ' ')}, {label}" for _, scheduler, _, label in runs))
        print(f"timeline (first seed, first pass): {out / 'timeline.png'}")
    except Exception as exc:  # the numbers stand without the picture
        print(f"timeline plot failed: {exc}", file=sys.stderr)
    print(f"speedup (median of {len(speedups)} runs, range {min(speedups):.2f}-{max(speedups):.2f})")
    print(f"speedup: {speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
