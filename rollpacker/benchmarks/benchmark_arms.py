"""Arms that differ only in a few config keys, run interleaved (A B A B ...) on the same model,
prompts and seeds: the A/B test for one setting on a noisy machine.

    rollpacker-benchmark --compare arms --arm "mp:rollout.cpu_executor=mp" \\
        --arm "inproc:rollout.cpu_executor=inproc" [--scheduler tail_batching] [--runs 3] [options of
        --compare speculative] [overrides for every arm]

Each arm is ``name:key=value[,key=value...]``. Per pass, every arm runs once (the order reversed
on every other pass, so a drift of the machine's speed hits all arms alike); ``--runs`` passes.
Prints per arm the median [range] over runs of training-loop time, rollout time (short / long
rounds), engine ms per decode step in each round type, scoring, train and weight-sync time, and a
last line ``speedup (<first arm> / <last arm>): X`` (loop time, medians).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rollpacker.benchmarks.common import REPO, add_run_options, benchmark_config, check_run_options, run_shape


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, sep, assignments = text.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected name:key=value[,key=value...]")
    pairs = [a for a in assignments.split(",") if a]
    bad = [a for a in pairs if "=" not in a]
    if bad:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: {bad} are not key=value")
    return name, pairs


def run_figures(rows: list[dict]) -> dict[str, float]:
    """One run's figures from its metrics rows."""
    out = {"loop_time": sum(r["time/step"] for r in rows)}
    for key in ("rollout", "logprob", "train", "weight_sync", "reward"):
        out[key] = sum(r.get(f"time/{key}", 0.0) for r in rows)
    for rt in ("baseline", "short", "long"):
        sel = [r for r in rows if r["round_type"] == rt]
        steps = sum(r.get("rollout/spec/decode_steps", 0.0) for r in sel)
        if sel:
            out[f"rollout_{rt}"] = sum(r["time/rollout"] for r in sel)
        if steps:
            out[f"ms_per_step_{rt}"] = 1e3 * out[f"rollout_{rt}"] / steps
            tokens = sum(r.get("rollout/spec/tokens_per_step", 0.0) * r.get("rollout/spec/decode_steps", 0.0) for r in sel)
            if tokens:
                out[f"ms_per_token_{rt}"] = 1e3 * out[f"rollout_{rt}"] / tokens
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "runs/benchmark_arms"))
    parser.add_argument("--arm", action="append", type=parse_arm, required=True, help="name:key=value[,key=value]")
    parser.add_argument("--scheduler", default="tail_batching", help="scheduler.name of every arm")
    parser.add_argument("--runs", type=int, default=3, help="passes over the arms")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if len(args.arm) < 2:
        parser.error("give at least two --arm")
    if error := check_run_options(args):
        print(error, file=sys.stderr)
        return 2

    from megatron_rl.runtime.metrics_logger import read_metrics
    from megatron_rl.train import build_and_run

    steps, num_prompts = run_shape(args)
    out = Path(args.out)
    results: dict[str, list[dict]] = {name: [] for name, _ in args.arm}
    for run in range(args.runs):
        for name, pairs in (args.arm if run % 2 == 0 else args.arm[::-1]):
            run_dir = out / f"run{run}" / name
            cfg = benchmark_config(args, args.scheduler, steps, run_dir, [
                f"data.builtin_num_prompts={num_prompts}", f"data.eval_every={steps}", *pairs])
            print(f"[arms] pass {run} {name}: {' '.join(pairs)} -> {run_dir}", flush=True)
            build_and_run(cfg)
            results[name].append(run_figures(read_metrics(run_dir)))
    keys = sorted({k for runs in results.values() for r in runs for k in r})
    print(f"\n{args.runs} passes x {len(args.arm)} arms, {steps} steps each, scheduler {args.scheduler}, seed {args.seed}")
    print("| figure | " + " | ".join(results) + " |\n| --- |" + " ---: |" * len(results))
    for key in keys:
        cells = []
        for runs in results.values():
            vals = [r[key] for r in runs if key in r]
            cells.append(f"{statistics.median(vals):.2f} [{min(vals):.2f}-{max(vals):.2f}]" if vals else "-")
        print(f"| {key} | " + " | ".join(cells) + " |")
    (out / "arms.json").write_text(json.dumps(results, indent=2))
    first, last = list(results)[0], list(results)[-1]
    ratio = statistics.median(r["loop_time"] for r in results[first]) / statistics.median(
        r["loop_time"] for r in results[last])
    print(f"speedup ({first} / {last}): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
