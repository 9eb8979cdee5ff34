"""Point-to-point transport for resharding buckets over torch.distributed (gloo or NCCL).

One call moves one round: every process posts its (at most one) send and (at most one)
receive, then waits for both. Posting both before waiting is what keeps a round deadlock-free
whatever the pairing. With NCCL the operations are issued through ``batch_isend_irecv`` so they
are grouped into one NCCL call (separately issued NCCL p2p calls between different pairs can
deadlock); gloo gets plain ``isend``/``irecv``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class TorchDistributedTransport:
    """Moves flat buffers between ranks of ``group`` (default: the world)."""

    def __init__(self, group: Any = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("resharding transport: torch.distributed is not initialised")
        self.group = group
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def exchange(self, send: tuple[int, torch.Tensor] | None, recv: tuple[int, torch.Tensor] | None) -> None:
        """Send ``send = (peer, buffer)`` and receive into ``recv = (peer, buffer)``; blocks
        until both are done. Peers are ranks in ``group``; either side may be None."""
        if self.backend == "nccl":
            ops = []
            if send is not None:
                ops.append(dist.P2POp(dist.isend, send[1], self._global(send[0]), self.group))
            if recv is not None:
                ops.append(dist.P2POp(dist.irecv, recv[1], self._global(recv[0]), self.group))
            works = dist.batch_isend_irecv(ops) if ops else []
        else:
            works = []
            if send is not None:
                works.append(dist.isend(send[1], self._global(send[0]), group=self.group))
            if recv is not None:
                works.append(dist.irecv(recv[1], self._global(recv[0]), group=self.group))
        for work in works:
            work.wait()

    def barrier(self) -> None:
        """All ranks of the group reach this point."""
        dist.barrier(group=self.group)

    def device(self) -> torch.device:
        """Where message buffers must live for this backend (NCCL: the current GPU)."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
