"""Where the ends of a tensor weight push run, and which wire joins each pair of them.

Every trainer rank and every engine worker reports a :class:`Place`: its node and, on a GPU, the
UUID of its device. UUIDs, not device indices: each process numbers the GPUs it sees from 0 under
its own ``CUDA_VISIBLE_DEVICES``, the UUID names the physical GPU everywhere (vLLM's IPC backend
matches handles to devices by it: ``vllm/distributed/weight_transfer/ipc_engine.py``,
``IPCWeightTransferEngine.receive_weights``). :func:`pair` turns the places into the push's wiring
and groups (``push.protocol`` describes both):

* CPU: by node, as ever: a shared-memory ring between a trainer rank and the engines on its node,
  one gloo group for the rest (``rollout.weight_push_channel=network``: every pair in the group).
* GPU: by device. CUDA IPC ("local") only between a trainer rank and an engine worker on the SAME
  GPU: a worker rebuilds the trainer's slots on its own device and nowhere else, as vLLM's IPC
  backend does. Every other pair is NCCL ("net"), and no NCCL communicator may hold two processes
  of one GPU (NCCL refuses it: "Duplicate GPU detected", ncclInvalidUsage). So a pair on one GPU is
  always IPC (``network_only`` cannot apply to it), and the NCCL pairs go through groups that
  split the GPUs by one bit of their number: trainer ranks on one side, workers on the other
  (:func:`_nccl_groups`), a few groups per process however many GPUs.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

LOCAL, NET = "local", "net"
"""The two kinds of pair (``push.protocol`` re-exports them): a ring the worker maps, or a push group."""


@dataclass(frozen=True)
class Place:
    """Where one process of a push runs."""

    node: str
    """Ray node id (the host name outside Ray)."""
    gpu: str = ""
    """UUID of the process's GPU ('' on CPU)."""


def node_id() -> str:
    """The Ray node this process runs on (the host name outside Ray)."""
    # Looked up, not imported: Ray can be initialised here only if this process imported it, and
    # vLLM's workers (which pair by device_uuid) must not import Ray at all (.importlinter).
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    import socket

    return socket.gethostname()


def device_uuid(device) -> str:
    """UUID of ``device`` ('' unless it is a CUDA device): what ``torch.cuda`` reports for it,
    the same string vLLM's IPC backend keys handles by."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def check_own_gpu(handle_uuid: str, own_uuid: str) -> None:
    """Refuse a CUDA IPC handle of another GPU than the opening process's own (module docstring)."""
    if not handle_uuid or handle_uuid != own_uuid:
        raise RuntimeError(f"weight push: the trainer's IPC slots are on GPU {handle_uuid or '?'}, this worker runs "
                           f"on {own_uuid or 'no GPU'}; CUDA IPC pairs only processes of one GPU (the others go "
                           "over NCCL), so the push wiring is wrong")


def here(device) -> Place:
    """This process's place; ``device`` is where its push buffers live ('cpu' or a CUDA device)."""
    return Place(node_id(), device_uuid(device))


def _collapse(kinds: list[str]) -> str | list[str]:
    return kinds[0] if len(set(kinds)) == 1 else kinds


def pair(trainer: list[Place], replicas: list[list[Place]], device: str,
         network_only: bool = False) -> tuple[list[list[str | list[str]]], list[list[int]]]:
    """The wiring (``wiring[t][e]``) and the push groups (empty: the one group of every trainer
    rank and every worker of a replica with a NET pair) for trainer ranks at ``trainer`` and
    engine replicas whose TP rank r runs at ``replicas[e][r]``; see the module docstring."""
    if device != "cuda":
        return [[LOCAL if not network_only and t.node == workers[0].node else NET for workers in replicas]
                for t in trainer], []
    missing = [f"trainer rank {t}" for t, p in enumerate(trainer) if not p.gpu]
    missing += [f"engine {e} TP rank {r}" for e, workers in enumerate(replicas) for r, p in enumerate(workers)
                if not p.gpu]
    if missing:
        raise ValueError(f"weight push on GPU: no GPU UUID reported by {', '.join(missing[:4])}; the push pairs "
                         "processes by GPU (rollout.weight_sync_format=tensor needs every process on a GPU)")
    wiring = [[_collapse([LOCAL if w.gpu == t.gpu else NET for w in workers]) for workers in replicas]
              for t in trainer]
    return wiring, _nccl_groups(trainer, replicas, wiring)


def _nccl_groups(trainer: list[Place], replicas: list[list[Place]], wiring: list) -> list[list[int]]:
    """Groups covering every NET pair, none holding one GPU twice (module docstring).

    Number the GPUs 0..G-1. For bit k and side v, group (k, v) holds the trainer ranks whose GPU
    number has bit k == v and the workers whose GPU number has it != v: a trainer rank and a
    worker there never share a GPU. A NET pair (distinct GPUs) goes through the group of the
    lowest bit where their numbers differ, on the trainer rank's side. So 2 * ceil(log2 G) groups
    at most and a process is in at most ceil(log2 G) of them as a trainer rank or a worker,
    where a group per pair would put every process of a colocated run in about G communicators.
    Members without a pair in a group are left out; workers that share a GPU (engines on one GPU)
    go to separate copies of the group, each with the trainer ranks that send to its workers."""
    count = len(trainer)
    tp = len(replicas[0]) if replicas else 0
    numbers: dict[str, int] = {}
    for place in [*trainer, *(w for workers in replicas for w in workers)]:
        numbers.setdefault(place.gpu, len(numbers))
    doubled = {p.gpu for p in trainer if sum(q.gpu == p.gpu for q in trainer) > 1}
    if doubled:
        raise ValueError(f"weight push on GPU: several trainer ranks report GPU {sorted(doubled)[0]}")
    gpu_of = {t: numbers[p.gpu] for t, p in enumerate(trainer)}
    gpu_of.update({count + e * tp + r: numbers[w.gpu] for e, workers in enumerate(replicas)
                   for r, w in enumerate(workers)})
    # (bit, side) -> copy -> trainer ranks and workers of that copy
    found: dict[tuple[int, int], dict[int, tuple[set[int], set[int]]]] = {}
    sharing: dict[tuple[int, int], dict[int, list[int]]] = {}  # (bit, side) -> GPU -> its workers there
    for t, row in enumerate(wiring):
        for e, kinds in enumerate(row):
            for r in range(tp):
                if (kinds if isinstance(kinds, str) else kinds[r]) != NET:
                    continue
                w = count + e * tp + r
                diff = gpu_of[t] ^ gpu_of[w]
                bit = (diff & -diff).bit_length() - 1
                key = (bit, (gpu_of[t] >> bit) & 1)
                on_gpu = sharing.setdefault(key, {}).setdefault(gpu_of[w], [])
                if w not in on_gpu:
                    on_gpu.append(w)
                trainers, workers = found.setdefault(key, {}).setdefault(on_gpu.index(w), (set(), set()))
                trainers.add(t)
                workers.add(w)
    return [sorted(trainers) + sorted(workers) for key in sorted(found)
            for trainers, workers in (found[key][c] for c in sorted(found[key]))]
