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
  always IPC (``network_only`` cannot apply to it), and the NCCL pairs get a group per sending
  trainer rank: the rank and the workers it sends to over the network, split where two of those
  workers share a GPU. A group has one trainer rank, so it never holds two processes of its GPU.
"""
from __future__ import annotations

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
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
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
    tp = len(replicas[0]) if replicas else 0
    groups: list[list[int]] = []
    for t, row in enumerate(wiring):
        bins: list[tuple[set[str], list[int]]] = []  # GPUs in the group, its workers
        for e, workers in enumerate(replicas):
            for r, w in enumerate(workers):
                if (row[e] if isinstance(row[e], str) else row[e][r]) != NET:
                    continue
                target = next((b for b in bins if w.gpu not in b[0]), None)
                if target is None:
                    target = ({trainer[t].gpu}, [])
                    bins.append(target)
                target[0].add(w.gpu)
                target[1].append(len(trainer) + e * tp + r)
        groups.extend([t, *members] for _, members in bins)
    return wiring, groups
