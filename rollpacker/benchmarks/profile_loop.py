"""Where the loop's time goes: one profiled run per benchmark column, every process sampled.

    rollpacker-profile-loop [--columns baseline,tail,tail+spec+hist] [--seed 1234] [--out runs/profile]
                                 [--rate 25] [--native] [benchmark options as in --compare speculative]

Each column runs exactly as ``rollpacker-benchmark --compare speculative`` runs it (same model,
prompts, seeds and settings), with two samplers outside the loop's processes:

* the kernel's CPU accounting of every process the run starts (driver, each trainer rank, the
  engine's front-end actor, vLLM's engine-core process and its worker when there is one, reward
  workers and their isolated children, Ray's daemons, and this tool's own py-spy), every 0.1 s,
  and of every thread once a second (thread counts, threads that did the work);
* ``py-spy record --idle`` attached to each loop process as it appears (Chrome-trace format, its
  timestamps aligned with the loop's ``phases.jsonl``): what each main thread was doing when.

Writes to ``<out>``: ``profile.md`` (per column: CPU seconds per process and loop phase with the
cores busy in each phase; threads per process and the thread settings each started with; what
each process's main thread did per phase; and, per decode step of each round type, the engine's
wall and CPU milliseconds by activity: scheduling, input preparation, model forward, sampling,
drafting, verification, hand-offs), ``profile.png`` (cores in use per process over time, phases
shaded; the engine's per-step breakdown), ``flame_<column>_<round>.svg`` (the engine's main
thread during rollouts of that round type) and ``profile.json``.

The profile costs CPU itself (py-spy's own processes are listed in the tables), so time the loop
with ``rollpacker-benchmark``, not with this tool; read this one for where the time goes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from rollpacker.benchmarks.benchmark_speculative import COLUMNS, column_config
from rollpacker.benchmarks.common import REPO, add_run_options, check_run_options


def profile_column(args, column: str, out: Path) -> tuple[dict, dict]:
    """Run one column under the samplers; returns its profile and the engine's flame stacks."""
    from megatron_rl.benchmarks.profiling.report import build_profile
    from megatron_rl.benchmarks.profiling.sampling import ProcessSampler, SpyRecorders
    from megatron_rl.runtime.metrics_logger import read_metrics
    from megatron_rl.train import build_and_run

    col_dir = out / column.replace("+", "_")
    run_dir = col_dir / "run"
    cfg = column_config(args, column, args.seed, run_dir)
    spy = SpyRecorders(col_dir / "pyspy", rate=args.rate, native=args.native)
    sampler = ProcessSampler(os.getpid(), on_new=spy.attach)
    print(f"[profile] {column}: {cfg.trainer.steps} steps -> {run_dir}", flush=True)
    sampler.start()
    try:
        build_and_run(cfg)
    finally:
        sampler.stop()
        traces = spy.stop()
    records = [dataclasses.asdict(r) for r in sampler.records.values()]
    (col_dir / "samples.json").write_text(json.dumps({"records": records, "traces": {
        str(pid): [start, str(path)] for pid, (start, path) in traces.items()}}))
    return build_profile(column, run_dir, records, {pid: (s, str(p)) for pid, (s, p) in traces.items()},
                         read_metrics(run_dir))


def write_report(profiles: list[dict], flames: dict[str, dict], out: Path) -> str:
    from megatron_rl.benchmarks.profiling.flamegraph import flame_svg
    from megatron_rl.benchmarks.profiling.report import category_table, engine_table, plot, process_table, thread_table

    parts = ["# Loop profile", "", engine_table(profiles), ""]
    for prof in profiles:
        parts += [process_table(prof), "", thread_table(prof), ""]
        for label in sorted(prof["processes"]):
            table = category_table(prof, label)
            if table:
                parts += [table, ""]
    for column, per_round in flames.items():
        for rt, stacks in per_round.items():
            if stacks:
                name = f"flame_{column.replace('+', '_')}_{rt}.svg"
                (out / name).write_text(flame_svg(stacks, f"engine main thread, {column}, {rt} rounds"))
                parts.append(f"flame graph: {name}")
    text = "\n".join(parts) + "\n"
    (out / "profile.md").write_text(text)
    try:
        plot(profiles, out / "profile.png")
    except Exception as exc:  # the tables stand without the picture
        print(f"profile plot failed: {exc}", file=sys.stderr)
    (out / "profile.json").write_text(json.dumps(profiles, indent=1))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "runs/profile"))
    parser.add_argument("--columns", default=",".join(c[0] for c in COLUMNS),
                        help="comma-separated columns of --compare speculative to profile")
    parser.add_argument("--rate", type=int, default=25, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames; pauses the targets)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    columns = [c for c in args.columns.split(",") if c]
    unknown = [c for c in columns if c not in {name for name, _, _ in COLUMNS}]
    if unknown:
        parser.error(f"--columns: unknown column(s) {unknown}; choose from {[c[0] for c in COLUMNS]}")
    if error := check_run_options(args):
        print(error, file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles, flames = [], {}
    for column in columns:
        profile, flame = profile_column(args, column, out)
        profiles.append(profile)
        flames[column] = flame
    print(write_report(profiles, flames, out))
    print(f"profile: {out / 'profile.md'}, {out / 'profile.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
