"""Who goes on which GPU of a GPU run: the one rule that the Ray placing code
(:mod:`megatron_rl.distributed.gpu_bundles`, through ``cluster.RunPlacement``) and the dry-run plan
(:mod:`megatron_rl.planning.placement`) both follow. Pure: no Ray, no torch.

GPUs are numbered 0..N-1 in the order of the run's placement-group bundles once sorted (the
driver's node first, then the other nodes, then each node's GPUs by CUDA id): GPU ``g`` is local
GPU ``g % gpus_per_node`` of node ``g // gpus_per_node``.

* Colocated (``cluster.placement=auto``, the hybrid engine): trainer rank ``r`` on GPU ``r``; engine
  ``e`` of TP ``t`` on GPUs ``e*t .. e*t+t-1``, so each engine rank shares its GPU with one trainer
  rank and a TP group never crosses a node (``t`` divides ``gpus_per_node``). Rank 0 is on GPU 0,
  the driver's node.
* ``cluster.placement=split``: trainer ranks on the driver's node (GPUs ``0..world-1``), engines on
  the other nodes, from GPU ``gpus_per_node`` on, by the same contiguous rule.

An elastic TP switch or an engine restart uses the same rule (``devices // tp`` engines at TP ``tp``
on the same rollout GPUs), so new engines land where the old ones were.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.schema import RunConfig
from megatron_rl.config.values import ConfigError


class LayoutError(ConfigError):
    """The run's processes cannot be laid out on its GPUs (names the config keys at fault)."""


@dataclass(frozen=True)
class GpuLayout:
    """Per trainer rank its GPU, per engine its TP ranks' GPUs (GPU numbers as in the module docstring)."""

    gpus_per_node: int
    """GPUs of each node (``cluster.gpus_per_node``)."""
    num_nodes: int
    """Nodes of the run (``cluster.num_nodes``)."""
    trainer_gpus: tuple[int, ...]
    """GPU of global trainer rank ``r`` at index ``r``."""
    engine_gpus: tuple[tuple[int, ...], ...]
    """GPUs of engine ``e`` at index ``e``, TP rank order."""

    def node_of(self, gpu: int) -> int:
        """Index of the node (0: the driver's) holding GPU ``gpu``."""
        return gpu // self.gpus_per_node

    def local_gpu(self, gpu: int) -> int:
        """GPU ``gpu``'s index among its node's GPUs."""
        return gpu % self.gpus_per_node

    @property
    def rollout_gpus(self) -> list[int]:
        """Every GPU an engine rank uses, in engine order."""
        return [g for gpus in self.engine_gpus for g in gpus]


def gpu_layout(world: int, num_engines: int, rollout_tp: int, num_nodes: int, gpus_per_node: int,
               split: bool = False) -> GpuLayout:
    """The layout of ``world`` trainer ranks and ``num_engines`` engines of TP ``rollout_tp`` on
    ``num_nodes`` x ``gpus_per_node`` GPUs; LayoutError naming the key when it cannot be done."""
    total = num_nodes * gpus_per_node
    if min(world, num_engines, rollout_tp, num_nodes, gpus_per_node) < 1:
        raise LayoutError(f"placement needs at least one trainer rank, engine, TP rank, node and GPU per node; got world "
                          f"{world}, rollout.num_engines={num_engines}, rollout.tensor_parallel_size={rollout_tp}, "
                          f"cluster.num_nodes={num_nodes}, cluster.gpus_per_node={gpus_per_node}")
    if gpus_per_node % rollout_tp:
        raise LayoutError(f"rollout.tensor_parallel_size={rollout_tp} does not divide cluster.gpus_per_node="
                          f"{gpus_per_node}: an engine's TP group must not cross a node")
    if split:
        if num_nodes < 2:
            raise LayoutError("cluster.placement 'split' needs cluster.num_nodes >= 2")
        if world > gpus_per_node:
            raise LayoutError(f"cluster.placement 'split' keeps the trainer ranks on the driver's node: trainer world size "
                              f"{world} exceeds its cluster.gpus_per_node={gpus_per_node} GPUs")
        first, room = gpus_per_node, total - gpus_per_node
    else:
        if world > total:
            raise LayoutError(f"parallel: trainer world size {world} exceeds cluster.num_nodes x cluster.gpus_per_node = "
                              f"{total} GPUs")
        first, room = 0, total
    if num_engines * rollout_tp > room:
        where = "the nodes other than the driver's" if split else "the cluster"
        raise LayoutError(f"rollout: {num_engines} engines x tensor_parallel_size {rollout_tp} need "
                          f"{num_engines * rollout_tp} GPUs; {where} has {room}")
    engines = tuple(tuple(range(first + e * rollout_tp, first + (e + 1) * rollout_tp)) for e in range(num_engines))
    return GpuLayout(gpus_per_node, num_nodes, tuple(range(world)), engines)


def world_size(cfg: RunConfig) -> int:
    """Trainer ranks: TP x CP x DP x PP."""
    p = cfg.parallel
    return p.tensor_model_parallel_size * p.context_parallel_size * p.data_parallel_size * p.pipeline_model_parallel_size


def run_layout(cfg: RunConfig, rollout_tp: int | None = None, num_engines: int | None = None) -> GpuLayout:
    """The layout of ``cfg``'s trainer ranks and engines (at ``rollout.tensor_parallel_size``, or the
    ``num_engines`` engines of TP ``rollout_tp`` an elastic switch runs on the same GPUs)."""
    c = cfg.cluster
    return gpu_layout(world_size(cfg), num_engines or cfg.rollout.num_engines,
                      rollout_tp or cfg.rollout.tensor_parallel_size, c.num_nodes, c.gpus_per_node,
                      split=c.placement == "split")
