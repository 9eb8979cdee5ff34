"""What the driver, the trainer ranks and the vLLM workers agree on for a tensor weight push.

The driver (``push.transport``) decides a :class:`PushSpec`: the engines' TP, the wire
dtype, bucket size and count, the timeout, the device kind, and the *wiring* (``push.topology``
decides it from where every process runs): for every trainer rank and engine worker whether the
worker maps that rank's ring ("local": shared memory on one node on CPU, CUDA IPC on one GPU) or
gets its buckets through a push group ("net": gloo on CPU, NCCL on GPU). Trainer ranks open their
side from the spec (``training.weight_push``), and each engine replica gets
:func:`engine_init_info` through vLLM's ``init_weight_transfer_engine`` (``rollout.worker.push_receiver``).

Push groups list their members by *process id*: trainer rank ``t`` is ``t``, TP rank ``r`` of
replica ``e`` is ``T + e * rollout_tp + r`` (:func:`worker_id`); a member's group rank is its
position in the list, and the first member (always a trainer rank) hosts the group's store. With
no explicit groups (CPU) there is one: trainer ranks ``0..T-1``, then the TP ranks of every
replica with at least one "net" pair, replica by replica (:func:`push_groups`).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_rl.distributed.local_state import run_dir_name
from megatron_rl.rollout.weight_sync.push.topology import LOCAL, NET


@dataclass
class PushSpec:
    """One push set-up (the same on every trainer rank); see the module docstring."""

    key: str
    """Names this set-up (a new one per engine generation)."""
    trainer: tuple[int, int, int]
    """Trainer (TP, PP, DP)."""
    rollout_tp: int
    """TP of the engines."""
    dtype: str
    """Wire and engine dtype ('float32', 'bfloat16', ...)."""
    bucket_bytes: int
    """Upper bound of one bucket."""
    num_slots: int
    """Buckets in flight per trainer rank (ring slots)."""
    timeout_s: float
    """Longest wait for the other side before the push fails."""
    device: str
    """'cpu' (shared memory + gloo) or 'cuda' (CUDA IPC + NCCL)."""
    wiring: list[list[str | list[str]]]
    """``wiring[t][e]``: LOCAL or NET for trainer rank t and every TP rank of engine replica e,
    or a list of them, one per TP rank (on GPU, where a replica's workers sit on several GPUs)."""
    host: str = ""
    """Address of trainer rank 0 (hosts the one push group's store), when any pair is NET."""
    port: int = 0
    """Port of that store (trainer rank 0 picks it when it opens)."""
    groups: list[list[int]] = field(default_factory=list)
    """Push groups, each a list of process ids (module docstring); empty: the one group."""
    group_hosts: list[str] = field(default_factory=list)
    """Address of each group's first member (``groups[g][0]``, a trainer rank)."""
    group_ports: list[int] = field(default_factory=list)
    """Port of each group's store (its first member picks it when it opens; 0 until then)."""
    replica_names: list[str] = field(default_factory=list)
    """For error messages: a name per engine replica."""

    @property
    def num_trainer_ranks(self) -> int:
        tp, pp, dp = self.trainer
        return tp * pp * dp

    @property
    def num_replicas(self) -> int:
        return len(self.wiring[0]) if self.wiring else 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PushSpec":
        d = dict(d)
        d["trainer"] = tuple(d["trainer"])
        return cls(**d)


def wiring(trainer_nodes: list[str], replica_nodes: list[str], network_only: bool = False) -> list[list[str]]:
    """LOCAL where a trainer rank and an engine replica share a node (unless ``network_only``):
    the CPU wiring (``push.topology.pair`` decides the GPU one)."""
    return [[LOCAL if not network_only and t == e else NET for e in replica_nodes] for t in trainer_nodes]


def kind(spec: PushSpec, trainer_rank: int, replica: int, tp_rank: int) -> str:
    """LOCAL or NET: how TP rank ``tp_rank`` of ``replica`` gets ``trainer_rank``'s buckets."""
    k = spec.wiring[trainer_rank][replica]
    return k if isinstance(k, str) else k[tp_rank]


def worker_id(spec: PushSpec, replica: int, tp_rank: int) -> int:
    """Process id of an engine worker in :attr:`PushSpec.groups`."""
    return spec.num_trainer_ranks + replica * spec.rollout_tp + tp_rank


def local_replicas(spec: PushSpec, trainer_rank: int) -> list[int]:
    """Replicas with a worker that maps ``trainer_rank``'s ring; the position in this list is
    the replica's consumer slot in that ring."""
    return [e for e in range(spec.num_replicas)
            if any(kind(spec, trainer_rank, e, r) == LOCAL for r in range(spec.rollout_tp))]


def net_replicas(spec: PushSpec) -> list[int]:
    """Replicas with at least one NET pair, in order."""
    return [e for e in range(spec.num_replicas)
            if any(kind(spec, t, e, r) == NET for t in range(spec.num_trainer_ranks) for r in range(spec.rollout_tp))]


def push_groups(spec: PushSpec) -> list[list[int]]:
    """The push groups (module docstring): the spec's, else the one group (none without a NET pair)."""
    if spec.groups:
        return [list(g) for g in spec.groups]
    net = net_replicas(spec)
    if not net:
        return []
    return [list(range(spec.num_trainer_ranks)) + [worker_id(spec, e, r) for e in net for r in range(spec.rollout_tp)]]


def group_address(spec: PushSpec, group: int) -> tuple[str, int]:
    """(host, port) of a group's store (port 0 until its first member opened)."""
    if spec.groups:
        if len(spec.group_hosts) != len(spec.groups):
            raise ValueError(f"weight push {spec.key}: {len(spec.group_hosts)} group_hosts for {len(spec.groups)} groups")
        return spec.group_hosts[group], (spec.group_ports[group] if spec.group_ports else 0)
    return spec.host, spec.port


def group_size(spec: PushSpec) -> int:
    """Members of all push groups together (0: no group needed)."""
    return sum(len(g) for g in push_groups(spec))


def net_targets(spec: PushSpec, trainer_rank: int) -> dict[int, list[tuple[int, int]]]:
    """Engine TP rank -> (group, group rank) of every worker of that rank that gets
    ``trainer_rank``'s buckets over the network, in replica order."""
    groups = push_groups(spec)
    shared = shared_groups(spec, groups)
    out: dict[int, list[tuple[int, int]]] = {r: [] for r in range(spec.rollout_tp)}
    for e in range(spec.num_replicas):
        for r in range(spec.rollout_tp):
            if kind(spec, trainer_rank, e, r) == NET:
                g = _shared(spec, shared, trainer_rank, worker_id(spec, e, r))
                out[r].append((g, groups[g].index(worker_id(spec, e, r))))
    return out


def shared_groups(spec: PushSpec, groups: list[list[int]]) -> dict[tuple[int, int], int]:
    """(trainer rank, worker) -> the first group holding both: the one their buckets go through."""
    out: dict[tuple[int, int], int] = {}
    t_count = spec.num_trainer_ranks
    for g, members in enumerate(groups):
        trainers = [m for m in members if m < t_count]
        for w in members:
            if w >= t_count:
                for t in trainers:
                    out.setdefault((t, w), g)
    return out


def _shared(spec: PushSpec, shared: dict[tuple[int, int], int], trainer_rank: int, worker: int) -> int:
    try:
        return shared[trainer_rank, worker]
    except KeyError:
        raise ValueError(f"weight push {spec.key}: no push group holds trainer rank {trainer_rank} and worker "
                         f"{worker} although their pair is NET") from None


def shm_root() -> Path:
    """Where rings live: /dev/shm when writable, else the temp dir (still shared page cache)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def ring_path(key: str, trainer_rank: int) -> Path:
    """This process's ring for push set-up ``key``: inside its per-process run directory, so the
    start-up sweep of dead runs (``local_state.dead_run_dirs``) removes it after a crash."""
    return shm_root() / run_dir_name() / "weight_push" / f"{key}-t{trainer_rank}.ring"


def engine_init_info(spec: PushSpec, replica: int, rings: list[dict], fingerprint: str) -> dict:
    """The ``init_info`` of replica ``replica`` for vLLM's ``init_weight_transfer_engine``.

    ``rings[t]`` is what trainer rank t's open returned (``path``, and on GPU ``ipc_handle``).
    ``local[t]["ranks"]``: the TP ranks that map t's ring; ``groups``: every group holding one of
    this replica's workers, in group order (the order every member joins them in), with the
    group rank of each such TP rank and, per TP rank, the group rank of each trainer rank it
    receives from there."""
    tp_ranks = range(spec.rollout_tp)
    local = {}
    for t in range(spec.num_trainer_ranks):
        ranks = [r for r in tp_ranks if kind(spec, t, replica, r) == LOCAL]
        if ranks:
            local[str(t)] = {**rings[t], "slot": local_replicas(spec, t).index(replica), "ranks": ranks}
    net = [t for t in range(spec.num_trainer_ranks) if any(kind(spec, t, replica, r) == NET for r in tp_ranks)]
    all_groups = push_groups(spec)
    shared = shared_groups(spec, all_groups)
    groups = []
    for g, members in enumerate(all_groups):
        mine = {str(r): members.index(worker_id(spec, replica, r)) for r in tp_ranks
                if worker_id(spec, replica, r) in members}
        if not mine:
            continue
        sources: dict[str, dict[str, int]] = {r: {} for r in mine}
        for r in mine:
            w = worker_id(spec, replica, int(r))
            for t in range(spec.num_trainer_ranks):
                if kind(spec, t, replica, int(r)) == NET and _shared(spec, shared, t, w) == g:
                    sources[r][str(t)] = members.index(t)
        host, port = group_address(spec, g)
        groups.append({"index": g, "host": host, "port": port, "world_size": len(members), "ranks": mine,
                       "sources": sources})
    return {"key": spec.key, "trainer": list(spec.trainer), "rollout_tp": spec.rollout_tp, "dtype": spec.dtype,
            "bucket_bytes": spec.bucket_bytes, "num_slots": spec.num_slots, "timeout_s": spec.timeout_s,
            "device": spec.device, "replica": replica,
            "name": spec.replica_names[replica] if spec.replica_names else f"engine {replica}",
            "local": local, "net_sources": net, "groups": groups, "fingerprint": fingerprint}
