"""Run a benchmark's SPMD body on ``world`` spawned processes (one torch.distributed rank each)
and return what rank 0 puts on the queue: the shared launcher of the tools that time gloo code.

``target(rank, args, port, queue)`` runs in each process; the processes are joined and killed
if they outlive ``timeout_s`` after rank 0's answer (a hung collective must not hang the tool).
"""
from __future__ import annotations

from typing import Any, Callable

import torch.multiprocessing as mp

from megatron_rl.distributed.ports import free_port


def run_ranks(target: Callable[..., None], world: int, args: Any, timeout_s: float = 1800.0,
              join_s: float = 120.0) -> Any:
    """Start ``world`` spawned processes running ``target(rank, args, port, queue)``; return the
    first item put on the queue (rank 0's result), waiting at most ``timeout_s``."""
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, args, port, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(join_s)
            if p.is_alive():
                p.kill()
