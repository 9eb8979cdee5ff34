"""What one per-step weight sync costs on a GPU cluster, per ``rollout.weight_sync_format``: a
bandwidth model of the three paths as they are implemented (torch-free; the simulator charges it
every step, ``rollpacker-simulate`` prints it).

Every figure rests on the stated link speeds of :class:`SyncAssumptions` (none is measured on a
GPU here; the CPU benchmark measures the same paths on one box, ``megatron_rl/benchmarks/benchmark_weight_sync.py``).
Phases of a file sync run one after another (the loop waits for each); the tensor push streams,
so its time is its slowest link. B is one copy of the weights in the engines' layout (bf16).

* ``sharded``: the trainer ranks move their shards to the writer ranks on rank 0's node (network
  into that node's GPUs), writers copy them to host memory and write rank files into /dev/shm;
  on a multi-node run the directory goes to every other node through Ray's object store; every
  engine replica then reads its ranks' files (B per replica, from /dev/shm) and copies its slice
  to its GPUs; vLLM's loaders copy it into the parameters.
* ``hf``: rank 0 gathers the whole model (over its one link), writes it once, fan-out as above,
  and every engine *rank* reads the whole model (B per rank) before cutting its slice.
* ``tensor``: every trainer rank sends its buckets (the push plan spreads one replica's B over
  all trainer ranks) to every replica; engines on the sender's node read them over NVLink (CUDA
  IPC), the others receive them over the network (NCCL), point to point. The slowest of: a
  trainer GPU's sends, an engine GPU's receives over the network, its NVLink reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.schema import RunConfig
from megatron_rl.planning.architectures import ModelShape


@dataclass(frozen=True)
class SyncAssumptions:
    """Link speeds (GB/s, effective) behind :func:`sync_seconds`; all assumptions."""

    net_gb_s: float = 40.0
    """Inter-node bandwidth per GPU (one 400 Gb/s InfiniBand NIC per GPU, NCCL / resharder)."""
    nvlink_gb_s: float = 200.0
    """GPU-to-GPU within a node (NVLink; CUDA IPC reads of another rank's buckets)."""
    pcie_gb_s: float = 25.0
    """Host <-> GPU per GPU (PCIe Gen5 x16)."""
    shm_write_gb_s: float = 10.0
    """Writing /dev/shm files, all writers of a node together (safetensors serialisation)."""
    shm_read_gb_s: float = 20.0
    """Reading /dev/shm files, all readers of a node together."""
    fanout_gb_s: float = 5.0
    """Ray's object store copying a directory to one other node (read, transfer, write)."""
    load_gb_s: float = 500.0
    """vLLM's loaders copying into the parameters on the GPU (HBM)."""


def _layout(cfg: RunConfig) -> tuple[int, int, int, int]:
    """(nodes, GPUs per node, engine replicas, engine TP)."""
    c, r = cfg.cluster, cfg.rollout
    return max(1, c.num_nodes), max(1, c.gpus_per_node), r.num_engines, r.tensor_parallel_size


DEFAULT = SyncAssumptions()


def sync_seconds(cfg: RunConfig, shape: ModelShape, fmt: str | None = None,
                 a: SyncAssumptions = DEFAULT, bytes_per_param: int = 2) -> dict[str, float]:
    """Seconds of one weight sync of ``fmt`` (default ``rollout.weight_sync_format``) for the
    recipe: ``total`` and its phases (keys depend on the format)."""
    fmt = fmt or cfg.rollout.weight_sync_format
    nodes, per_node, replicas, tp = _layout(cfg)
    p = cfg.parallel
    trainers = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size \
        * p.data_parallel_size
    b = shape.total_params * bytes_per_param / 1e9  # GB, one copy
    slice_gb = b / tp  # what one engine GPU holds
    replicas_per_node = max(1, replicas // nodes)
    if fmt == "tensor":
        remote = replicas * (nodes - 1) / nodes  # replicas not on a given sender's node
        phases = {
            "trainer_send": b / trainers * remote / a.net_gb_s,
            "engine_receive": slice_gb * (nodes - 1) / nodes / a.net_gb_s,
            "nvlink_read": slice_gb / nodes / a.nvlink_gb_s,
        }
        phases["load"] = slice_gb / a.load_gb_s
        phases["total"] = max(phases["trainer_send"], phases["engine_receive"], phases["nvlink_read"]) + phases["load"]
        return phases
    if fmt not in ("sharded", "hf"):
        raise ValueError(f"weight_sync_cost: unknown format {fmt!r}")
    writers = min(per_node, trainers)
    if fmt == "sharded":
        phases = {"to_writers": b / (writers * a.net_gb_s) if nodes > 1 or trainers > writers else 0.0,
                  "to_host": b / writers / a.pcie_gb_s}
        read_per_node = replicas_per_node * b  # every replica reads its ranks' files: B
    else:
        phases = {"gather": b / a.net_gb_s, "to_host": b / a.pcie_gb_s}
        read_per_node = replicas_per_node * tp * b  # every engine rank reads the whole model
    phases["write_shm"] = b / a.shm_write_gb_s
    phases["fan_out"] = b / a.fanout_gb_s if nodes > 1 else 0.0
    phases["read_shm"] = read_per_node / a.shm_read_gb_s
    phases["to_gpu"] = slice_gb / a.pcie_gb_s
    phases["load"] = slice_gb / a.load_gb_s
    phases["total"] = sum(phases.values())
    return phases


def describe(a: SyncAssumptions = DEFAULT) -> str:
    """The assumptions as one line for the simulator's report."""
    return (f"network {a.net_gb_s:g} GB/s/GPU, NVLink {a.nvlink_gb_s:g}, PCIe {a.pcie_gb_s:g}, /dev/shm write "
            f"{a.shm_write_gb_s:g} / read {a.shm_read_gb_s:g} per node, Ray fan-out {a.fanout_gb_s:g} per node, "
            f"loaders {a.load_gb_s:g}")
