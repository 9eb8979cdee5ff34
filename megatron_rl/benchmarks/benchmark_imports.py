"""Benchmark: the CPU time of a process's start-up imports, before and after a change, side by side
in one run: an engine's and a trainer rank's with CPython's cyclic collector on and paused
(``megatron_rl.runtime.import_cost``, what the run does); a reward worker's with transformers' AutoTokenizer
and with the tokenizers library (``megatron_rl.reward.pool.response_decoder``, what the run does);
a driver's and an actor's project modules from sources only and with the project compiled
(``tools/setup_env.sh`` compiles it: an editable install does not, and under
``PYTHONDONTWRITEBYTECODE=1`` no process writes bytecode).

    python -m megatron_rl.benchmarks.benchmark_imports [--repeats 5] [--kinds engine,rank,reward,bytecode] [--json FILE]

Each measurement is a fresh interpreter (the project's Python), so nothing is imported yet, as in
a new Ray actor; the two settings alternate, so both see the same page cache and the same load
on the host. A child measures its own CPU time (user + system, ``resource.getrusage``) around:

* engine: ``import torch``, then ``megatron_rl.rollout.actor.vllm_engine.VLLM_MODULES`` (what an engine's
  process imports before it starts vLLM's AsyncLLM);
* rank: ``megatron_rl.training.policy_group.import_rank_modules("cpu")`` (torch, the CPU shim,
  Megatron-Core's model, optimizer and DDP, the worker);
* bytecode: the project modules a driver and its actors import (:data:`PROJECT_MODULES`, with
  what they import), the project's ``__pycache__`` removed before each "sources" measurement
  and compiled (``compileall``, not measured) before each "compiled" one; the children write no
  bytecode, and the project is compiled again at the end;
* reward: a ``RewardWorker`` built (``eager_start=False``) on the tiny model's tokenizer, written
  to a temporary directory first, with its decoder loaded either way.

Prints, per kind, the median and range of each setting and the ratio of the medians.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_rl.benchmarks.report import emit

CHILD = """
import resource, sys
kind, after_change = sys.argv[1], sys.argv[2] == "after"
before = resource.getrusage(resource.RUSAGE_SELF)
if kind == "engine":
    from megatron_rl.runtime.import_cost import preimport
    from megatron_rl.rollout.actor.vllm_engine import VLLM_MODULES
    preimport("torch", *VLLM_MODULES, pause=after_change)
elif kind == "rank":
    from megatron_rl.training.policy_group import import_rank_modules
    import_rank_modules("cpu", pause=after_change)
elif kind == "bytecode":
    import importlib
    for name in sys.argv[4].split(","):
        importlib.import_module(name)
else:
    from megatron_rl.config.schema import RewardConfig
    from megatron_rl.reward.pool import response_decoder, worker
    if not after_change:
        worker.load_response_decoder = response_decoder.TransformersDecoder
    worker.RewardWorker(RewardConfig(), sys.argv[3], 64, eager_start=False)
after = resource.getrusage(resource.RUSAGE_SELF)
print(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
"""

SETTINGS = {"engine": ("collector on", "paused"), "rank": ("collector on", "paused"),
            "reward": ("transformers", "tokenizers"), "bytecode": ("sources", "compiled")}
"""Per kind: the setting before the change, then after it (what the run does)."""


PROJECT_MODULES = ("megatron_rl.train", "megatron_rl.training.policy_group", "megatron_rl.rollout.driver.ray_engine",
                   "megatron_rl.rollout.actor.engine_actor", "megatron_rl.rollout.actor.vllm_engine")
"""What the bytecode kind imports: a driver's entry module and what its rank and engine actors load."""
PROJECT_DIRS = tuple(Path(__file__).resolve().parents[2] / d for d in ("megatron_rl", "rollpacker"))


def compile_project(compiled: bool) -> None:
    """The project's bytecode present (compileall) or absent (every __pycache__ removed)."""
    if compiled:
        subprocess.run([sys.executable, "-m", "compileall", "-q", *map(str, PROJECT_DIRS)], check=True,
                       capture_output=True)
        return
    for root in PROJECT_DIRS:
        for cache in root.rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)


def measure(kind: str, after_change: bool, tokenizer_dir: str) -> float:
    """CPU seconds of one fresh interpreter's start of ``kind``, before or after the change."""
    if kind == "bytecode":
        compile_project(after_change)
    out = subprocess.run([sys.executable, "-c", CHILD, kind, "after" if after_change else "before", tokenizer_dir,
                          ",".join(PROJECT_MODULES)], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    return float(out.stdout.strip().splitlines()[-1])


def run(repeats: int, kinds: tuple[str, ...] = tuple(SETTINGS)) -> dict[str, dict[str, list[float]]]:
    """``{kind: {setting: [cpu s per repeat]}}``, the settings alternating within each repeat."""
    from megatron_rl.model.tiny import build_tokenizer

    figures: dict[str, dict[str, list[float]]] = {k: {s: [] for s in SETTINGS[k]} for k in kinds}
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        build_tokenizer().save_pretrained(tokenizer_dir)
        for i in range(repeats):
            for kind in kinds:
                for after_change in ((False, True) if i % 2 == 0 else (True, False)):
                    figures[kind][SETTINGS[kind][after_change]].append(measure(kind, after_change, tokenizer_dir))
            print(f"repeat {i + 1}/{repeats} done", file=sys.stderr, flush=True)
    if "bytecode" in kinds:
        compile_project(True)
    return figures


def table(figures: dict[str, dict[str, list[float]]]) -> str:
    lines = ["| start | before | CPU s median (range) | after | CPU s median (range) | after / before |",
             "|---|---|---:|---|---:|---:|"]
    for kind, by_setting in figures.items():
        cells = []
        for setting in SETTINGS[kind]:
            xs = by_setting[setting]
            cells.append(f"{setting} | {statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
        before, after = (statistics.median(by_setting[s]) for s in SETTINGS[kind])
        lines.append(f"| {kind} | {cells[0]} | {cells[1]} | {after / before:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="measurements per kind and setting")
    parser.add_argument("--kinds", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in kinds if k not in SETTINGS]
    if unknown or not kinds:
        parser.error(f"--kinds: unknown {unknown or 'none given'}; choose from {', '.join(SETTINGS)}")
    figures = run(args.repeats, kinds)
    return emit(table(figures), figures, args.json)


if __name__ == "__main__":
    sys.exit(main())
