"""Benchmark: the CPU time of an engine's and a trainer rank's first imports, with CPython's cyclic
collector paused (``megatron_rl.import_cost``, what the run does) and not, side by side in one run.

    python -m rollpacker.benchmarks.benchmark_imports [--repeats 5] [--json FILE]

Each measurement is a fresh interpreter (the project's Python), so nothing is imported yet, as in
a new Ray actor; the two settings alternate, so both see the same page cache and the same load
on the host. A child measures its own CPU time (user + system, ``resource.getrusage``) around:

* engine: ``import torch``, then ``megatron_rl.rollout.vllm_engine.VLLM_MODULES`` (what an engine's
  process imports before it starts vLLM's AsyncLLM);
* rank: ``megatron_rl.training.policy_group.import_rank_modules("cpu")`` (torch, the CPU shim,
  Megatron-Core's model, optimizer and DDP, the worker).

Prints, per kind, the median and range of each setting and the ratio of the medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import resource, sys
kind, pause = sys.argv[1], sys.argv[2] == "paused"
before = resource.getrusage(resource.RUSAGE_SELF)
if kind == "engine":
    from megatron_rl.import_cost import preimport
    from megatron_rl.rollout.vllm_engine import VLLM_MODULES
    preimport("torch", *VLLM_MODULES, pause=pause)
else:
    from megatron_rl.training.policy_group import import_rank_modules
    import_rank_modules("cpu", pause=pause)
after = resource.getrusage(resource.RUSAGE_SELF)
print(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
"""

KINDS = ("engine", "rank")
SETTINGS = ("collector on", "paused")


def measure(kind: str, setting: str) -> float:
    """CPU seconds of one fresh interpreter's imports of ``kind`` under ``setting``."""
    out = subprocess.run([sys.executable, "-c", CHILD, kind, "paused" if setting == "paused" else "on"],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def run(repeats: int) -> dict[str, dict[str, list[float]]]:
    """``{kind: {setting: [cpu s per repeat]}}``, the settings alternating within each repeat."""
    figures: dict[str, dict[str, list[float]]] = {k: {s: [] for s in SETTINGS} for k in KINDS}
    for i in range(repeats):
        for kind in KINDS:
            order = SETTINGS if i % 2 == 0 else tuple(reversed(SETTINGS))
            for setting in order:
                figures[kind][setting].append(measure(kind, setting))
        print(f"repeat {i + 1}/{repeats} done", file=sys.stderr, flush=True)
    return figures


def table(figures: dict[str, dict[str, list[float]]]) -> str:
    lines = ["| imports | collector on: CPU s median (range) | paused: CPU s median (range) | paused / on |",
             "|---|---:|---:|---:|"]
    for kind, by_setting in figures.items():
        cells = []
        for setting in SETTINGS:
            xs = by_setting[setting]
            cells.append(f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
        ratio = statistics.median(by_setting["paused"]) / statistics.median(by_setting["collector on"])
        lines.append(f"| {kind} | {cells[0]} | {cells[1]} | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="measurements per kind and setting")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    figures = run(args.repeats)
    print(table(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
