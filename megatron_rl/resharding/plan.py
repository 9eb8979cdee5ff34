"""Resharding plan: which slice of which source shard goes to which destination shard, grouped
into size-bounded buckets and scheduled in rounds.

The plan is pure, deterministic metadata computed identically on every process (no
communication): each process then executes only its own part (``execute.py``).

How it is built:

1. Both layouts describe their tensors as segments of the HF tensors (``layouts.py``).
2. For every destination segment, the source pieces covering it are found. A range held by
   several sources (DP replicas, TP-replicated norms, the tied embedding copy on the last PP
   stage) is read from exactly one of them: a source in the same process if there is one
   (a local copy, no network), otherwise the least-loaded holder so far (spreads sending work
   over DP replicas). So every destination byte is sent exactly once.
3. Transfers between two different processes are packed, in order, into buckets of at most
   ``bucket_bytes`` (a transfer larger than that is split along its split dim).
4. Buckets are scheduled in rounds in which every process sends at most one bucket and
   receives at most one: peak extra memory per process is two buckets, whatever the model size.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from megatron_rl.resharding.layouts import TensorSpec


class Layout(Protocol):
    """What the planner needs from a layout (see ``layouts.py``)."""

    num_shards: int

    def tensors(self, shard: int) -> list[TensorSpec]: ...


@dataclass(frozen=True)
class Transfer:
    """Copy ``length`` slices along ``dim`` from a source tensor to a destination tensor."""

    src_shard: int
    src_tensor: str
    src_start: int
    dst_shard: int
    dst_tensor: str
    dst_start: int
    dim: int
    length: int
    numel: int
    """Elements moved (length x elements per slice)."""


@dataclass
class Bucket:
    """Transfers from one process to another, sent as one flat message."""

    src_proc: int
    dst_proc: int
    transfers: list[Transfer] = field(default_factory=list)
    numel: int = 0


@dataclass
class ReshardPlan:
    """Everything a process needs to take part in one resharding."""

    src_procs: list[int]
    """Process (group) rank hosting each source shard."""
    dst_procs: list[int]
    """Process (group) rank hosting each destination shard."""
    dst_specs: dict[int, list[TensorSpec]]
    """Destination shard -> its tensors (to allocate them)."""
    local: list[Transfer]
    """Transfers whose source and destination live in the same process (plain copies)."""
    rounds: list[list[Bucket]]
    """Network buckets; within a round each process sends <= 1 and receives <= 1 bucket."""
    bucket_numel: int
    """Size bound of a bucket, in elements."""

    @property
    def sent_numel(self) -> int:
        """Elements crossing process boundaries."""
        return sum(b.numel for r in self.rounds for b in r)

    @property
    def local_numel(self) -> int:
        """Elements copied inside a process."""
        return sum(t.numel for t in self.local)

    @property
    def dst_numel(self) -> int:
        """Elements of all destination segments (padding excluded): must equal sent + local."""
        return sum(s.length * spec.row_numel for specs in self.dst_specs.values() for spec in specs
                   for s in spec.segments)


@dataclass
class _Holder:
    shard: int
    tensor: str
    local_start: int
    row_numel: int


def _source_index(layout: Layout) -> tuple[dict[str, dict[tuple[int, int], list[_Holder]]], dict[str, int]]:
    """logical name -> (logical_start, length) -> every source tensor holding exactly that range;
    and logical name -> the dim it is split along in the source layout."""
    index: dict[str, dict[tuple[int, int], list[_Holder]]] = defaultdict(lambda: defaultdict(list))
    dim_of: dict[str, int] = {}
    for shard in range(layout.num_shards):
        for spec in layout.tensors(shard):
            for seg in spec.segments:
                dim_of[seg.logical] = spec.dim
                index[seg.logical][(seg.logical_start, seg.length)].append(
                    _Holder(shard, spec.name, seg.local_start, spec.row_numel))
    return index, dim_of


def _pieces(index: dict[tuple[int, int], list[_Holder]], start: int, end: int, name: str):
    """Yield (lo, hi, holder_range_start, holders) covering logical rows [start, end) exactly."""
    at = start
    ranges = sorted(index)
    for (r_start, r_len), holders in ((k, index[k]) for k in ranges):
        r_end = r_start + r_len
        if r_end <= at or r_start >= end:
            continue
        if r_start > at:
            break
        yield at, min(end, r_end), r_start, holders
        at = min(end, r_end)
        if at >= end:
            return
    if at < end:
        raise ValueError(f"resharding: rows [{at}, {end}) of {name!r} are held by no source shard")


def build_plan(
    src: Layout,
    dst: Layout,
    src_procs: Sequence[int],
    dst_procs: Sequence[int],
    bucket_bytes: int = 256 << 20,
    itemsize: int = 4,
) -> ReshardPlan:
    """Plan moving a model from layout ``src`` to layout ``dst``.

    Args:
        src, dst: layouts (``MegatronLayout``, ``VLLMLayout``) of the same architecture.
        src_procs: process rank (in the group used for execution) of each source shard.
        dst_procs: process rank of each destination shard. A process may host both
            (colocated trainer and engine): its transfers become local copies.
        bucket_bytes: upper bound of one message (and of each of the two in-flight buffers).
        itemsize: bytes per element of the weights (4 for fp32, 2 for bf16).
    """
    if len(src_procs) != src.num_shards or len(dst_procs) != dst.num_shards:
        raise ValueError(f"resharding: {len(src_procs)} source / {len(dst_procs)} destination processes "
                         f"for {src.num_shards} / {dst.num_shards} shards of {src} -> {dst}")
    bucket_numel = bucket_bytes // itemsize
    index, dim_of = _source_index(src)
    sent_by: dict[int, int] = defaultdict(int)  # source shard -> elements assigned so far
    local: list[Transfer] = []
    by_pair: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    dst_specs: dict[int, list[TensorSpec]] = {}
    for shard in range(dst.num_shards):
        specs = dst.tensors(shard)
        dst_specs[shard] = specs
        for spec in specs:
            for seg in spec.segments:
                if seg.logical not in index:
                    raise ValueError(f"resharding: {spec.name!r} of {dst} shard {shard} needs {seg.logical!r}, "
                                     f"which {src} does not hold")
                if dim_of[seg.logical] != spec.dim:
                    raise ValueError(f"resharding: {seg.logical!r} is split along different dims")
                end = seg.logical_start + seg.length
                for lo, hi, r_start, holders in _pieces(index[seg.logical], seg.logical_start, end, seg.logical):
                    here = [h for h in holders if src_procs[h.shard] == dst_procs[shard]]
                    pick = here[0] if here else min(holders, key=lambda h: (sent_by[h.shard], h.shard))
                    transfer = Transfer(
                        src_shard=pick.shard, src_tensor=pick.tensor, src_start=pick.local_start + lo - r_start,
                        dst_shard=shard, dst_tensor=spec.name, dst_start=seg.local_start + lo - seg.logical_start,
                        dim=spec.dim, length=hi - lo, numel=(hi - lo) * spec.row_numel,
                    )
                    if here:
                        local.append(transfer)
                    else:
                        sent_by[pick.shard] += transfer.numel
                        by_pair[(src_procs[pick.shard], dst_procs[shard])].append(transfer)
    buckets = []
    for (s_proc, d_proc), transfers in sorted(by_pair.items()):
        buckets += _pack(s_proc, d_proc, transfers, bucket_numel)
    return ReshardPlan(list(src_procs), list(dst_procs), dst_specs, local, _schedule(buckets), bucket_numel)


def _pack(src_proc: int, dst_proc: int, transfers: list[Transfer], bucket_numel: int) -> list[Bucket]:
    """Fill buckets in order, splitting transfers that do not fit along their split dim."""
    out = [Bucket(src_proc, dst_proc)]
    for t in transfers:
        row = t.numel // t.length
        if row > bucket_numel:
            raise ValueError(f"resharding: bucket of {bucket_numel} elements is smaller than one slice "
                             f"({row} elements) of {t.src_tensor!r}; raise bucket_bytes")
        done = 0
        while done < t.length:
            room = (bucket_numel - out[-1].numel) // row
            if room == 0:
                out.append(Bucket(src_proc, dst_proc))
                continue
            n = min(room, t.length - done)
            piece = Transfer(t.src_shard, t.src_tensor, t.src_start + done, t.dst_shard, t.dst_tensor,
                             t.dst_start + done, t.dim, n, n * row)
            out[-1].transfers.append(piece)
            out[-1].numel += piece.numel
            done += n
    return [b for b in out if b.transfers]


def _schedule(buckets: list[Bucket]) -> list[list[Bucket]]:
    """Greedy rounds: each process sends at most one and receives at most one bucket per round.

    Buckets are queued per (sender, receiver) pair and pairs are visited in a rotating order,
    so a process drains its queues to different receivers in parallel (like a shift schedule).
    """
    queues: dict[tuple[int, int], list[Bucket]] = defaultdict(list)
    for b in buckets:
        queues[(b.src_proc, b.dst_proc)].append(b)
    for q in queues.values():
        q.reverse()  # pop() from the end keeps the original order
    rounds: list[list[Bucket]] = []
    turn = 0
    while queues:
        busy_send: set[int] = set()
        busy_recv: set[int] = set()
        this_round = []
        pairs = sorted(queues)
        # Rotate the starting pair so no pair waits forever behind others.
        for s, d in pairs[turn % len(pairs):] + pairs[: turn % len(pairs)]:
            if s in busy_send or d in busy_recv:
                continue
            this_round.append(queues[(s, d)].pop())
            busy_send.add(s)
            busy_recv.add(d)
            if not queues[(s, d)]:
                del queues[(s, d)]
        rounds.append(this_round)
        turn += 1
    return rounds
