"""Execute a :class:`~megatron_rl.resharding.plan.ReshardPlan` on this process.

Every process of the group calls :func:`execute_plan` with the source shards it hosts and the
destination tensors it owns (allocate them with :func:`allocate_destinations`, or pass the
engine's own parameters). Local transfers are plain copies; the rest travels bucket by bucket,
round by round, through two reusable flat buffers of at most ``plan.bucket_numel`` elements,
so no process ever holds more than its own shards plus two buckets.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch

from megatron_rl.resharding.plan import Bucket, ReshardPlan, Transfer

Shards = Mapping[int, Mapping[str, torch.Tensor]]


class Transport(Protocol):
    """Moves one round's buffers (see ``transport.TorchDistributedTransport``)."""

    rank: int

    def exchange(self, send: tuple[int, torch.Tensor] | None, recv: tuple[int, torch.Tensor] | None) -> None: ...

    def device(self) -> torch.device: ...


@dataclass
class ReshardStats:
    """What one process did in one resharding."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    rounds: int = 0
    seconds: float = 0.0


def allocate_destinations(
    plan: ReshardPlan, proc: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> dict[int, dict[str, torch.Tensor]]:
    """Zero-filled destination tensors of every destination shard hosted by process ``proc``
    (zero is what vocabulary padding rows must hold)."""
    return {
        shard: {spec.name: torch.zeros(spec.shape, dtype=dtype, device=device) for spec in specs}
        for shard, specs in plan.dst_specs.items() if plan.dst_procs[shard] == proc
    }


def _tensor(shards: Shards, shard: int, name: str, what: str) -> torch.Tensor:
    try:
        return shards[shard][name]
    except KeyError:
        raise KeyError(f"resharding: this process has no {what} tensor {name!r} of shard {shard} "
                       f"(shards given: {sorted(shards)})") from None


def _src_slice(sources: Shards, t: Transfer) -> torch.Tensor:
    return _tensor(sources, t.src_shard, t.src_tensor, "source").narrow(t.dim, t.src_start, t.length)


def _dst_slice(destinations: Shards, t: Transfer) -> torch.Tensor:
    return _tensor(destinations, t.dst_shard, t.dst_tensor, "destination").narrow(t.dim, t.dst_start, t.length)


def _pack(bucket: Bucket, sources: Shards, buffer: torch.Tensor) -> torch.Tensor:
    at = 0
    for t in bucket.transfers:
        piece = _src_slice(sources, t)
        buffer[at:at + t.numel].view(piece.shape).copy_(piece)
        at += t.numel
    return buffer[:at]


def _unpack(bucket: Bucket, destinations: Shards, buffer: torch.Tensor) -> None:
    at = 0
    for t in bucket.transfers:
        target = _dst_slice(destinations, t)
        target.copy_(buffer[at:at + t.numel].view(target.shape))
        at += t.numel


def _dtype_of(sources: Shards, destinations: Shards) -> torch.dtype:
    dtypes = {t.dtype for shard in (*sources.values(), *destinations.values()) for t in shard.values()}
    if len(dtypes) > 1:
        raise TypeError(f"resharding: source/destination tensors mix dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop() if dtypes else torch.float32


def execute_plan(
    plan: ReshardPlan,
    sources: Shards,
    destinations: Shards,
    transport: Transport | None,
    proc: int | None = None,
    dtype: torch.dtype | None = None,
) -> ReshardStats:
    """Run this process's part of ``plan``. Collective over the transport's group.

    Args:
        plan: the same plan on every process.
        sources: source shard -> {local name: tensor}, for the source shards this process hosts.
        destinations: destination shard -> {name: tensor}, written in place (padding untouched).
        transport: moves buckets between processes; may be None when the plan has no rounds.
        proc: this process's rank in the plan (default: ``transport.rank``).
        dtype: buffer dtype; every process must use the same one (default: the tensors' dtype).
            Required on a process that hosts no tensors at all.
    """
    start = time.perf_counter()
    if proc is None:
        if transport is None:
            raise ValueError("execute_plan: pass proc when there is no transport")
        proc = transport.rank
    if plan.rounds and transport is None:
        raise ValueError("execute_plan: this plan moves data between processes; a transport is needed")
    stats = ReshardStats()
    for t in plan.local:
        if plan.dst_procs[t.dst_shard] == proc:
            _dst_slice(destinations, t).copy_(_src_slice(sources, t))
            stats.bytes_local += t.numel
    dtype = dtype or _dtype_of(sources, destinations)
    itemsize = torch.empty((), dtype=dtype).element_size()
    stats.bytes_local *= itemsize
    mine = [r for r in plan.rounds if any(proc in (b.src_proc, b.dst_proc) for b in r)]
    if mine:
        largest = max(b.numel for r in mine for b in r if proc in (b.src_proc, b.dst_proc))
        device = transport.device()
        send_buf = torch.empty(largest, dtype=dtype, device=device)
        recv_buf = torch.empty(largest, dtype=dtype, device=device)
    for round_ in mine:
        out = next((b for b in round_ if b.src_proc == proc), None)
        inc = next((b for b in round_ if b.dst_proc == proc), None)
        send = (out.dst_proc, _pack(out, sources, send_buf)) if out else None
        recv = (inc.src_proc, recv_buf[:inc.numel]) if inc else None
        transport.exchange(send, recv)
        if inc:
            _unpack(inc, destinations, recv_buf)
            stats.bytes_received += inc.numel * itemsize
        if out:
            stats.bytes_sent += out.numel * itemsize
        stats.rounds += 1
    stats.seconds = time.perf_counter() - start
    return stats
