"""Import large package graphs with CPython's cyclic garbage collector paused.

Importing vLLM's engine (~8 CPU s) or Megatron-Core's model, optimizer and DDP (~4 CPU s) creates
hundreds of thousands of container objects (modules, classes, functions, dicts), and CPython
3.11 runs full collections over the growing heap again and again while they arrive, although
none of it is garbage. Every engine actor and trainer rank pays that at start-up, on GPUs as on
CPU. :func:`preimport` imports such modules first thing in those processes with the collector
paused, then restores it; the cycles created meanwhile are collected by the next collection as
usual. Measured side by side (``python -m megatron_rl.benchmarks.benchmark_imports``, which
alternates fresh interpreters with and without the pause) in docs/tests.md.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
from typing import Iterator


@contextlib.contextmanager
def collector_paused(pause: bool = True) -> Iterator[None]:
    """No automatic cyclic collection inside the block; the collector's state is restored after it
    (a collector that was disabled before stays disabled). ``pause=False`` leaves it alone (the
    benchmark's baseline)."""
    was_enabled = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def preimport(*modules: str, pause: bool = True) -> None:
    """Import ``modules`` (dotted names, in order) with the collector paused; a module already
    imported costs nothing."""
    with collector_paused(pause):
        for name in modules:
            importlib.import_module(name)
