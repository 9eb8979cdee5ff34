"""Baseline vs RollPacker tail batching, side by side, on the real stack (CPU here).

    python tools/benchmark.py [--periods 2] [--prompts-per-step 16] [--responses 4] [key=value ...]
    python tools/benchmark.py --compare stream ...   # tail batching without vs with the stream trainer

Both runs use the same tiny model, task, seeds, engine, reward and training code and the same
number of prompts: a whole number of tail-batching periods (with eta_P = 1.25, four short rounds
then one long round = five steps, which consume exactly the prompts of five baseline steps).
The long tail comes from the model's own response lengths; nothing is slowed down artificially.

Prints per-round-type and overall step time, rollout time, engine occupancy, wasted tokens,
final validation reward of each, and a last line ``speedup: X.XX`` = baseline training-loop time
/ RollPacker training-loop time (every step: rollout, reward, logprobs, train, weight sync;
start-up of Ray/engines/trainer is excluded because it is identical for both). Results go to
<out>/benchmark.json and, with tools/plot_timeline.py, to <out>/timeline.png.

``--compare weight_sync`` times the weight sync alone, three formats in one run (hf files,
sharded files, tensor push; ``--repeats`` pushes each) against an in-memory copy of the same
bytes, with each push split into transport and the engine's own load (``tools/benchmark_weight_sync.py``,
which it runs); give it a larger model (e.g. the 70M random one of the README) so the sync moves
enough bytes to measure. Its last two lines are ``weight-sync speedup (tensor vs sharded):`` and
``tensor bandwidth fraction of memcpy:``.

``--compare speculative`` runs baseline / tail batching / tail batching + speculative decoding +
rollout history over ``--seeds`` seeds (``tools/benchmark_speculative.py``, which it runs, on the
re-checking model by default); its last lines are ``long-round rollout speedup (speculation):``
and ``speedup:``.

``--compare old_logprobs`` runs the baseline scheduler twice, ``algorithm.recompute_old_logprobs``
true vs false (the separate scoring forward vs the training forward's own logprobs).

``--compare quantization`` (tools/benchmark_quantization.py, its own options): full-precision vs
int8 rollout: engine throughput on larger random models and training curves on the tiny model.

``--compare stream`` runs tail batching twice, stream trainer off and on (``stream.enabled``),
and adds the long-round step time of each, their ratio (``long-round speedup:``) and the stream
metrics (start point, fraction trained before the rollout ended, training hidden under rollout).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollpacker.plugins  # noqa: E402,F401  (RollPacker's config sections, as megatron_rl.train registers them)
from megatron_rl.config import RunConfig  # noqa: E402
from megatron_rl.config_io import apply_override, load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def period_steps(eta_prompts: float, prompts_per_step: int) -> int:
    """Steps of one tail-batching period: short rounds until the queue holds P0, then a long one."""
    queued_per_short = math.ceil(eta_prompts * prompts_per_step) - prompts_per_step
    if queued_per_short <= 0:
        return 1  # eta_P = 1: no queue, every round is short
    return math.ceil(prompts_per_step / queued_per_short) + 1


# (run name, scheduler, extra overrides, column label) of each comparison's two runs.
COMPARISONS = {
    "schedulers": [("baseline", "baseline", [], "baseline"), ("tail_batching", "tail_batching", [], "RollPacker")],
    "stream": [("tail_batching", "tail_batching", ["stream.enabled=false"], "no stream"),
               ("stream", "tail_batching", ["stream.enabled=true"], "stream")],
    "weight_sync": [],  # its own benchmark: tools/benchmark_weight_sync.py
    "speculative": [],  # three columns over seeds: tools/benchmark_speculative.py
    "old_logprobs": [("recompute", "baseline", ["algorithm.recompute_old_logprobs=true"], "recompute"),
                     ("fused", "baseline", ["algorithm.recompute_old_logprobs=false"], "train fwd")],
}


# Comparisons with a module (and options) of their own: --compare NAME runs MODULE.main(argv).
OWN_MODULES = {"quantization": "tools.benchmark_quantization"}


def _own_module(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[1] if arg.startswith("--compare=") else (
            argv[i + 1] if arg == "--compare" and i + 1 < len(argv) else None)
        if name in OWN_MODULES:
            return OWN_MODULES[name]
    return None


def benchmark_config(args, scheduler: str, steps: int, run_dir: Path, extra: list[str] = ()) -> RunConfig:
    cfg = load_config(REPO / "examples/qwen2.5/tiny_cpu.yaml")
    for assignment in [
        f"model.hf_path={args.model}", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
        f"scheduler.name={scheduler}", f"data.prompts_per_step={args.prompts_per_step}",
        f"data.responses_per_prompt={args.responses}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"data.eval_every={steps}", f"data.eval_num_prompts={args.eval_prompts}",
        "trainer.save_every=0", "trainer.tensorboard=false", f"trainer.seed={args.seed}",
        f"rollout.max_num_seqs={args.max_num_seqs}", *extra, *args.overrides,
    ]:
        apply_override(cfg, assignment)
    return cfg


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


def print_table(base: dict, tb: dict, labels: tuple[str, str] = ("baseline", "RollPacker")) -> None:
    def row(name, a, b, fmt="{:.2f}"):
        fa = fmt.format(a) if a is not None else "-"
        fb = fmt.format(b) if b is not None else "-"
        ratio = f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else ""
        print(f"| {name:<34} | {fa:>12} | {fb:>12} | {ratio:>7} |")

    print(f"| {'metric':<34} | {labels[0]:>12} | {labels[1]:>12} |   ratio |")
    print("| ---------------------------------- | -----------: | -----------: | ------: |")
    row("training-loop time (s)", base["loop_time"], tb["loop_time"])
    row("rollout time (s)", base["rollout_time"], tb["rollout_time"])
    row("step time, all rounds (s)", base["loop_time"] / base["steps"], tb["loop_time"] / tb["steps"])
    for rt in ("short", "long"):
        if rt in tb:
            a = base.get(rt, {})
            row(f"step time, {rt} rounds (s)", a.get("step_time_mean"), tb[rt]["step_time_mean"])
            row(f"rollout time, {rt} rounds (s)", a.get("rollout_time_mean"), tb[rt]["rollout_time_mean"])
            row(f"occupancy, {rt} rounds", a.get("occupancy_mean"), tb[rt]["occupancy_mean"])
    if "stream" in tb:
        st = tb["stream"]
        row("stream: start (fraction complete)", None, st["start_fraction"])
        row("stream: trained before rollout end", None, st["trained_fraction_before_rollout_end"])
        row("stream: train time hidden (s/round)", None, st["hidden_train_s"])
        row("stream: train time exposed (s/round)", None, st["exposed_train_s"])
    row("scoring (logprob) time (s/step)", base["logprob_time_mean"], tb["logprob_time_mean"], "{:.3f}")
    row("train time (s/step)", base["train_time_mean"], tb["train_time_mean"], "{:.3f}")
    row("weight sync time (s/step)", base["weight_sync_time_mean"], tb["weight_sync_time_mean"], "{:.3f}")
    row("engine occupancy (mean)", base["occupancy_mean"], tb["occupancy_mean"])
    row("wasted tokens (aborted+discarded)", base["wasted_tokens"], tb["wasted_tokens"], "{:.0f}")
    row("train reward (mean over run)", base["train_reward_mean"], tb["train_reward_mean"], "{:.3f}")
    row("val pass@1 before training", base["initial_val_pass@1"], tb["initial_val_pass@1"], "{:.3f}")
    row("val pass@1 after training", base["final_val_pass@1"], tb["final_val_pass@1"], "{:.3f}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if own := _own_module(argv):
        import importlib

        return importlib.import_module(own).main(argv)
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
    parser.add_argument("--compare", choices=sorted([*COMPARISONS, *OWN_MODULES]), default="schedulers",
                        help="baseline vs tail batching; tail batching without vs with the stream trainer; "
                             "the HF vs the sharded weight sync, or recomputed vs training-forward old "
                             "logprobs (baseline scheduler)")
    parser.add_argument("--repeats", type=int, default=3, help="--compare weight_sync: timed pushes per format")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides for both runs")
    parser.add_argument("--seeds", type=int, default=3, help="--compare speculative: seeds (three columns each)")
    args, rest = parser.parse_known_args(argv)
    if args.compare == "speculative":
        from tools.benchmark_speculative import main as speculative_main

        given = list(argv if argv is not None else sys.argv[1:])
        forwarded = [a for a in given if not a.startswith("--compare") and a != "speculative"]
        return speculative_main(forwarded)
    args = parser.parse_args(argv)
    if args.compare == "weight_sync":
        from tools.benchmark_weight_sync import main as weight_sync_main

        return weight_sync_main(["--model", args.model, "--out", str(Path(args.out) / "weight_sync"),
                                 "--repeats", str(args.repeats), *args.overrides])
    if not (Path(args.model) / "config.json").is_file():
        print(f"no model at {args.model}: build it with python tools/make_tiny_model.py --out {args.model}",
              file=sys.stderr)
        return 2

    from megatron_rl.metrics import read_metrics
    from megatron_rl.train import build_and_run

    probe = benchmark_config(args, "tail_batching", 1, Path(args.out))
    steps = args.periods * period_steps(probe.scheduler.eta_prompts, args.prompts_per_step)
    out = Path(args.out)
    results = {}
    runs = COMPARISONS[args.compare]
    for name, scheduler, extra, _ in runs:
        run_dir = out / name
        cfg = benchmark_config(args, scheduler, steps, run_dir, extra)
        print(f"[benchmark] {name}: {steps} steps x {args.prompts_per_step} prompts x "
              f"{args.responses} responses -> {run_dir}", flush=True)
        start = time.monotonic()
        build_and_run(cfg)
        results[name] = summarize(read_metrics(run_dir))
        results[name]["wall_time_with_startup"] = time.monotonic() - start

    (first, *_), (second, *_) = runs
    median, longest = response_length_tail(out / first)
    base, tb = results[first], results[second]
    print()
    print(f"model {args.model}; {steps} steps each; P0={args.prompts_per_step}, R0={args.responses}, "
          f"max_new_tokens={args.max_new_tokens}, eta_P=eta_R={probe.scheduler.eta_prompts}/"
          f"{probe.scheduler.eta_responses}")
    print(f"{first} response lengths: median {median:.0f}, max {longest:.0f} tokens "
          f"(max/median = {longest / max(median, 1):.1f})")
    print_table(base, tb, (runs[0][3], runs[1][3]))
    speedup = base["loop_time"] / tb["loop_time"]
    if args.compare == "stream" and "long" in base and "long" in tb:
        long_speedup = base["long"]["step_time_mean"] / tb["long"]["step_time_mean"]
        results["long_round_speedup"] = long_speedup
        print(f"long-round speedup: {long_speedup:.2f}")
    results.update({"steps": steps, "speedup": speedup, "length_median": median, "length_max": longest})
    (out / "benchmark.json").write_text(json.dumps(results, indent=2))
    try:
        from tools.plot_timeline import plot_timeline

        plot_timeline(out / first, out / second, out / "timeline.png",
                      titles=None if args.compare == "schedulers" else tuple(
                          f"{scheduler.replace('_', ' ')}, {label}" for _, scheduler, _, label in runs))
        print(f"timeline: {out / 'timeline.png'}")
    except Exception as exc:  # the numbers above stand without the picture
        print(f"timeline plot failed: {exc}", file=sys.stderr)
    print(f"speedup: {speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
