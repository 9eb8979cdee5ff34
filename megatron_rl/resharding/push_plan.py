"""The plan of a tensor weight push: which slice of which trainer shard goes, in which bucket, to
which engine TP rank, and where in which Hugging Face tensor the engine puts it.

It is the resharding plan (:func:`megatron_rl.resharding.plan.build_plan`) with the engine ranks
as processes of their own: Megatron's (TP_t, PP_t, DP) shards on trainer ranks ``0..T-1``, one
replica of vLLM's TP_r layout on "processes" ``T..T+TP_r-1``. So every transfer crosses from a
trainer rank to an engine rank, is packed by the one trainer rank that holds it (no trainer-to-
trainer traffic), and each destination byte is sent once per engine replica. Buckets are at most
``bucket_bytes`` and come in the plan's deadlock-free round order; every party (trainer ranks
packing, engine ranks unpacking) walks its own buckets in that one global order, which is what
lets bounded send buffers never deadlock (see ``rollout.weight_sync.push.channels``).

The engine side gets each piece in HF terms (:class:`Piece`: HF tensor, split dim, first row,
rows), because vLLM's weight loaders take HF-named full tensors and cut the rank's rows out
themselves (``rollout.worker.push_receiver``). Pure and deterministic: trainer ranks and vLLM workers
build the same plan from the same arguments; :attr:`PushPlan.fingerprint` checks that they did.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

import torch

from megatron_rl.model.qwen2 import Qwen2Arch
from megatron_rl.resharding.layouts import MegatronLayout, TensorSpec, VLLMLayout
from megatron_rl.resharding.plan import build_plan


@dataclass(frozen=True)
class Piece:
    """``length`` slices along ``dim``: trainer tensor rows ``[src_start, ...)`` -> HF tensor
    ``logical`` rows ``[logical_start, ...)``, at element ``offset`` of the bucket."""

    logical: str
    """HF tensor name."""
    dim: int
    """Split dimension (0 rows, 1 RowParallel columns)."""
    logical_start: int
    """First row (along ``dim``) in the HF tensor."""
    length: int
    """Rows."""
    src_tensor: str
    """Trainer-side tensor (Megatron local-spec name)."""
    src_start: int
    """First row in the trainer tensor."""
    offset: int
    """First element of the piece in the bucket."""
    numel: int
    """Elements (rows x elements per row)."""


@dataclass(frozen=True)
class PushBucket:
    """One message: pieces from one trainer rank to one engine TP rank (of every replica)."""

    index: int
    """Position in the plan's global order."""
    src_rank: int
    """Trainer rank that packs it."""
    dst_rank: int
    """Engine TP rank that loads it (in every engine replica)."""
    numel: int
    """Elements (the pieces laid end to end)."""
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class PushPlan:
    """Every bucket of one push (see the module docstring)."""

    arch: Qwen2Arch
    trainer: tuple[int, int, int]
    """Trainer (TP, PP, DP); trainer rank = Megatron global rank."""
    rollout_tp: int
    """Engine TP size (every replica the same)."""
    bucket_numel: int
    """Size bound of a bucket, in elements."""
    buckets: tuple[PushBucket, ...]
    """All buckets, in the global order."""
    needed: Mapping[int, Mapping[str, int]]
    """Engine TP rank -> HF tensor -> rows (along its split dim) that rank receives."""

    @property
    def num_trainer_ranks(self) -> int:
        tp, pp, dp = self.trainer
        return tp * pp * dp

    def for_trainer(self, rank: int) -> list[PushBucket]:
        """The buckets trainer rank ``rank`` packs, in order."""
        return [b for b in self.buckets if b.src_rank == rank]

    def for_engine(self, rank: int) -> list[PushBucket]:
        """The buckets engine TP rank ``rank`` (of each replica) receives, in order."""
        return [b for b in self.buckets if b.dst_rank == rank]

    @property
    def max_bucket_numel(self) -> int:
        return max((b.numel for b in self.buckets), default=0)

    @property
    def total_numel(self) -> int:
        """Elements sent to one engine replica (its TP ranks together)."""
        return sum(b.numel for b in self.buckets)

    @property
    def fingerprint(self) -> str:
        """A digest of the bucket layout: equal on two processes iff they built the same plan."""
        digest = hashlib.sha256()
        for b in self.buckets:
            digest.update(f"{b.index},{b.src_rank},{b.dst_rank},{b.numel};".encode())
            for p in b.pieces:
                digest.update(f"{p.logical},{p.dim},{p.logical_start},{p.length},{p.src_tensor},{p.src_start},"
                              f"{p.offset}|".encode())
        return digest.hexdigest()[:16]


def _logical_of(spec: TensorSpec, dst_start: int, length: int) -> tuple[str, int]:
    """The HF tensor and first row of local rows ``[dst_start, +length)`` of ``spec`` (the plan
    never lets a transfer straddle two segments: it follows segment boundaries)."""
    for seg in spec.segments:
        if seg.local_start <= dst_start and dst_start + length <= seg.local_start + seg.length:
            return seg.logical, seg.logical_start + dst_start - seg.local_start
    raise ValueError(f"push plan: rows [{dst_start}, {dst_start + length}) of {spec.name!r} are not inside one segment")


def build_push_plan(arch: Qwen2Arch, trainer_tp: int, trainer_pp: int, trainer_dp: int, rollout_tp: int,
                    bucket_bytes: int, itemsize: int) -> PushPlan:
    """The plan of pushing a Megatron (TP, PP, DP) trainer's weights into vLLM engines of TP
    ``rollout_tp``, in buckets of at most ``bucket_bytes`` of ``itemsize``-byte elements."""
    src = MegatronLayout(arch, trainer_tp, trainer_pp, trainer_dp)
    dst = VLLMLayout(arch, rollout_tp)
    trainers = src.num_shards
    plan = build_plan(src, dst, list(range(trainers)), [trainers + r for r in range(rollout_tp)],
                      bucket_bytes, itemsize)
    if plan.local:
        raise AssertionError("push plan: a trainer rank and an engine rank share a process")  # by construction
    specs = {shard: {s.name: s for s in dst.tensors(shard)} for shard in range(rollout_tp)}
    buckets: list[PushBucket] = []
    for round_ in plan.rounds:
        for bucket in sorted(round_, key=lambda b: (b.src_proc, b.dst_proc)):
            pieces, at = [], 0
            for t in bucket.transfers:
                logical, start = _logical_of(specs[t.dst_shard][t.dst_tensor], t.dst_start, t.length)
                pieces.append(Piece(logical, t.dim, start, t.length, t.src_tensor, t.src_start, at, t.numel))
                at += t.numel
            buckets.append(PushBucket(len(buckets), bucket.src_proc, bucket.dst_proc - trainers, at, tuple(pieces)))
    needed: dict[int, dict[str, int]] = {}
    for rank in range(rollout_tp):
        rows: dict[str, int] = defaultdict(int)
        for spec in dst.tensors(rank):
            for seg in spec.segments:
                rows[seg.logical] += seg.length
        needed[rank] = dict(rows)
    return PushPlan(arch, (trainer_tp, trainer_pp, trainer_dp), rollout_tp, plan.bucket_numel, tuple(buckets), needed)


def piece_shape(piece: Piece, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of a piece: its HF tensor's shape with ``length`` along the split dim."""
    shape = list(shapes[piece.logical])
    shape[piece.dim] = piece.length
    return tuple(shape)


def pack_bucket(bucket: PushBucket, sources: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Trainer side: copy the bucket's pieces from this rank's tensors (Megatron local names)
    into the flat ``out`` (at least ``bucket.numel`` elements, the wire dtype; values are cast)."""
    for p in bucket.pieces:
        try:
            src = sources[p.src_tensor]
        except KeyError:
            raise KeyError(f"weight push: bucket {bucket.index} needs {p.src_tensor!r}, which trainer rank "
                           f"{bucket.src_rank} does not hold") from None
        piece = src.narrow(p.dim, p.src_start, p.length)
        out[p.offset:p.offset + p.numel].view(piece.shape).copy_(piece)


