"""What the driver, the trainer ranks and the vLLM workers agree on for a tensor weight push.

The driver (``push.transport``) decides a :class:`PushSpec`: the engines' TP, the wire
dtype, bucket size and count, the timeout, the device kind, and the *wiring*: for every (trainer
rank, engine replica) pair whether the replica's workers map that rank's ring on their node
("local": shared memory on CPU, CUDA IPC on GPU) or get its buckets over the push group ("net":
gloo on CPU, NCCL on GPU). Trainer ranks open their side from the spec (``training.weight_push``),
and each engine replica gets :func:`engine_init_info` through vLLM's
``init_weight_transfer_engine`` (``push.receiver``).

Group ranks: trainer ranks ``0..T-1``, then the TP ranks of every replica with at least one "net"
pair, replica by replica (:func:`net_replicas`).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_rl.distributed.local_state import run_dir_name

LOCAL, NET = "local", "net"


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
    wiring: list[list[str]]
    """``wiring[t][e]``: LOCAL or NET for trainer rank t and engine replica e."""
    host: str = ""
    """Address of trainer rank 0 (hosts the push group's store), when any pair is NET."""
    port: int = 0
    """Port of that store (trainer rank 0 picks it when it opens)."""
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
    """LOCAL where a trainer rank and an engine replica share a node (unless ``network_only``)."""
    return [[LOCAL if not network_only and t == e else NET for e in replica_nodes] for t in trainer_nodes]


def local_replicas(spec: PushSpec, trainer_rank: int) -> list[int]:
    """Replicas that map ``trainer_rank``'s ring; the position in this list is the replica's
    consumer slot in that ring."""
    return [e for e, kind in enumerate(spec.wiring[trainer_rank]) if kind == LOCAL]


def net_replicas(spec: PushSpec) -> list[int]:
    """Replicas in the push group (at least one NET pair), in group order."""
    return [e for e in range(spec.num_replicas) if any(row[e] == NET for row in spec.wiring)]


def group_size(spec: PushSpec) -> int:
    """Members of the push group (0: no group needed)."""
    n = len(net_replicas(spec))
    return spec.num_trainer_ranks + n * spec.rollout_tp if n else 0


def group_rank(spec: PushSpec, replica: int, tp_rank: int) -> int:
    """Group rank of an engine worker."""
    return spec.num_trainer_ranks + net_replicas(spec).index(replica) * spec.rollout_tp + tp_rank


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

    ``rings[t]`` is what trainer rank t's open returned (``path``, and on GPU ``ipc_handle``)."""
    local = {t: {**rings[t], "slot": local_replicas(spec, t).index(replica)}
             for t in range(spec.num_trainer_ranks) if spec.wiring[t][replica] == LOCAL}
    net = [t for t in range(spec.num_trainer_ranks) if spec.wiring[t][replica] == NET]
    group = None
    if net:
        group = {"host": spec.host, "port": spec.port, "world_size": group_size(spec),
                 "rank_offset": group_rank(spec, replica, 0)}
    return {"key": spec.key, "trainer": list(spec.trainer), "rollout_tp": spec.rollout_tp, "dtype": spec.dtype,
            "bucket_bytes": spec.bucket_bytes, "num_slots": spec.num_slots, "timeout_s": spec.timeout_s,
            "device": spec.device, "replica": replica,
            "name": spec.replica_names[replica] if spec.replica_names else f"engine {replica}",
            "local": {str(t): v for t, v in local.items()}, "net_sources": net, "group": group,
            "fingerprint": fingerprint}
