"""Spawned torch.distributed rank processes kept for a whole pytest process, shared by the SPMD
tests (``tests.helpers.megatron_cases.run_spmd``).

A spawned rank spends ~7 CPU s importing torch and megatron-core before it runs anything, and
the SPMD modules start ~50 ranks in a suite run. The pool starts :data:`POOL_SIZE` ranks once
per pytest process (each xdist worker has its own) and runs one scenario at a time on its first
``world`` ranks: ``fn(rank, world, port, *args)`` in each, its result pickled to
``out_dir/rank<r>.pkl`` as a fresh spawn writes it. After every scenario each rank tears down
what a scenario sets up in a process (Megatron's parallel state, the torch.distributed world),
so the next one starts from an uninitialised process as it would in a fresh spawn.

A scenario that fails or hangs may leave the other ranks inside a collective: the pool is then
killed and the next scenario starts a new one. Ranks exit when the pytest process that owns them
is gone (they poll their parent), so a killed test worker leaves none behind.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from pathlib import Path
from typing import Any, Callable

POOL_SIZE = 4
"""Ranks in the pool: the largest world the SPMD tests use."""
_POLL_S = 2.0


def _teardown_distributed() -> None:
    """Leave the process as a fresh spawn is: no Megatron parallel state, no process group."""
    from megatron_rl.distributed.process_groups import destroy_process_groups

    destroy_process_groups(destroy_world=True)


def single_threaded() -> None:
    """What every SPMD rank runs with: one torch thread (the ranks share two cores)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def run_scenario(fn: Callable, rank: int, world: int, port: int, args: tuple) -> tuple[str, Any]:
    """``("ok", fn(rank, world, port, *args))``, or ``("error", traceback)`` for any failure, so the
    parent gets a report instead of waiting on a rank that died."""
    try:
        return "ok", fn(rank, world, port, *args)
    except BaseException:
        return "error", traceback.format_exc()


def write_result(out_dir: str | Path, rank: int, result: tuple[str, Any]) -> None:
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as handle:
        pickle.dump(result, handle)


def _rank_loop(rank: int, jobs: Any, done: Any, parent: int) -> None:
    import gc

    single_threaded()
    while True:
        try:
            job = jobs.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the pytest process died: nobody will send more
                return
            continue
        if job is None:
            return
        fn, world, port, args, out_dir = job
        result = run_scenario(fn, rank, world, port, args)
        try:
            _teardown_distributed()
        except BaseException:
            if result[0] == "ok":
                result = ("error", "tearing down after the scenario failed:\n" + traceback.format_exc())
        gc.collect()
        write_result(out_dir, rank, result)
        done.put((rank, result[0]))


class RankPool:
    """:data:`POOL_SIZE` spawned ranks waiting for scenarios (see the module docstring)."""

    def __init__(self, size: int = POOL_SIZE) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self._jobs = [ctx.Queue() for _ in range(size)]
        self._done = ctx.Queue()
        # Not daemonic: a rank's checkpoint save forks writer processes, which daemons may not have.
        # close() (at exit, or after a failure) and the ranks' parent check end them instead.
        self._procs = [ctx.Process(target=_rank_loop, args=(r, self._jobs[r], self._done, os.getpid()),
                                   name=f"spmd-rank-{r}") for r in range(size)]
        for proc in self._procs:
            proc.start()

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self._procs)

    def run(self, fn: Callable, world: int, port: int, args: tuple, out_dir: Path, timeout_s: float) -> list[int]:
        """Run ``fn`` on ranks ``0..world-1``; return the ranks that reported, in the order they did.
        Stops waiting at the first rank that failed (its peers may be stuck in a collective);
        raises TimeoutError after ``timeout_s`` and RuntimeError when a rank process died."""
        for rank in range(world):
            self._jobs[rank].put((fn, world, port, args, str(out_dir)))
        deadline = time.monotonic() + timeout_s
        reported: list[int] = []
        while len(reported) < world:
            try:
                rank, status = self._done.get(timeout=1.0)
            except queue.Empty:
                dead = {r: self._procs[r].exitcode for r in range(world) if not self._procs[r].is_alive()}
                if dead:
                    raise RuntimeError(f"pooled ranks exited without a result: exit codes {dead}") from None
                if time.monotonic() > deadline:
                    hung = sorted(set(range(world)) - set(reported))
                    raise TimeoutError(f"ranks {hung} still running after {timeout_s}s; "
                                       f"{len(reported)}/{world} finished") from None
                continue
            reported.append(rank)
            if status == "error":
                break
        return reported

    def close(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)


_pool: RankPool | None = None


def shared_pool() -> RankPool:
    """This pytest process's pool, started (again) when there is none or a rank of it died."""
    global _pool
    if _pool is None or not _pool.alive():
        close_shared_pool()
        _pool = RankPool()
    return _pool


def close_shared_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


atexit.register(close_shared_pool)
