"""``megatron-rl-benchmark NAME [options]``: runs one of the core's benchmarks with the rest of the
command line (``megatron-rl-benchmark NAME --help`` lists its options).

A benchmark's module is imported only when it is run, so the light ones stay light.
"""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "weight_sync": "megatron_rl.benchmarks.benchmark_weight_sync",
    "quantization": "megatron_rl.benchmarks.benchmark_quantization",
    "training": "megatron_rl.benchmarks.benchmark_training",
    "resharding": "megatron_rl.benchmarks.benchmark_resharding",
    "reward": "megatron_rl.benchmarks.benchmark_reward",
    "checkpoint": "megatron_rl.benchmarks.benchmark_checkpoint",
    "engine_start": "megatron_rl.benchmarks.benchmark_engine_start",
    "imports": "megatron_rl.benchmarks.benchmark_imports",
    "speculative_engine_check": "megatron_rl.benchmarks.speculative_engine_check",
}
"""Benchmark name -> its module, whose ``main(argv)`` runs it."""


def usage() -> str:
    return "usage: megatron-rl-benchmark NAME [options]   (NAME --help for its options)\nNAME: " + ", ".join(BENCHMARKS)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"megatron-rl-benchmark: unknown benchmark {name!r}\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"megatron-rl-benchmark {name}", *rest]  # so the benchmark's --help names the command
    return importlib.import_module(BENCHMARKS[name]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
