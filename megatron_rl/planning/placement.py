"""Where every process of a run goes: trainer ranks (with their TP/CP/DP/PP coordinates),
rollout engines (TP groups that never cross a node) and reward workers, node by node.

The GPUs come from :func:`megatron_rl.distributed.gpu_layout.run_layout`, the rule the Ray placing
code follows too (``megatron_rl.distributed.cluster.RunPlacement``), so the dry run prints where the
run puts each process: node 0 is the driver's, ``gpu<g>`` the node's g-th GPU by CUDA id. Trainer
ranks go in Megatron's rank order (TP fastest, then CP, DP, PP); reward workers are CPU actors
spread round-robin over the nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.schema import RunConfig
from megatron_rl.distributed.gpu_layout import LayoutError, run_layout
from megatron_rl.planning.memory import PlanError


@dataclass
class GpuSlot:
    """One GPU: the trainer rank and the engine rank sharing it (colocated)."""

    trainer_rank: int | None = None
    coords: str = ""
    engine: int | None = None
    engine_rank: int | None = None


@dataclass
class NodePlan:
    index: int
    hostname: str
    gpus: list[GpuSlot]
    reward_workers: list[int] = field(default_factory=list)
    driver: bool = False


def trainer_coords(rank: int, cfg: RunConfig) -> tuple[int, int, int, int]:
    """(tp, cp, dp, pp) of a global trainer rank in Megatron's default order tp-cp-dp-pp."""
    p = cfg.parallel
    tp = rank % p.tensor_model_parallel_size
    rest = rank // p.tensor_model_parallel_size
    cp = rest % p.context_parallel_size
    rest //= p.context_parallel_size
    return tp, cp, rest % p.data_parallel_size, rest // p.data_parallel_size


def plan_placement(cfg: RunConfig, hostnames: list[str] | None = None) -> list[NodePlan]:
    """Per-node placement; PlanError when a group would cross nodes or GPUs are missing."""
    c, p = cfg.cluster, cfg.parallel
    hosts = hostnames or [f"node{i}" for i in range(c.num_nodes)]
    if len(hosts) != c.num_nodes:
        raise PlanError(f"cluster.num_nodes={c.num_nodes} but the allocation lists {len(hosts)} hosts ({', '.join(hosts)})")
    if p.tensor_model_parallel_size > c.gpus_per_node:
        raise PlanError(f"parallel.tensor_model_parallel_size={p.tensor_model_parallel_size} exceeds "
                        f"cluster.gpus_per_node={c.gpus_per_node}: TP all-reduces would cross the inter-node network")
    try:
        layout = run_layout(cfg)
    except LayoutError as exc:
        raise PlanError(str(exc)) from None
    nodes = [NodePlan(i, h, [GpuSlot() for _ in range(c.gpus_per_node)], driver=(i == 0)) for i, h in enumerate(hosts)]
    for rank, gpu in enumerate(layout.trainer_gpus):
        tp, cp, dp, pp = trainer_coords(rank, cfg)
        slot = nodes[layout.node_of(gpu)].gpus[layout.local_gpu(gpu)]
        slot.trainer_rank, slot.coords = rank, f"tp{tp} cp{cp} dp{dp} pp{pp}"
    for engine, gpus in enumerate(layout.engine_gpus):
        for r, gpu in enumerate(gpus):
            slot = nodes[layout.node_of(gpu)].gpus[layout.local_gpu(gpu)]
            slot.engine, slot.engine_rank = engine, r
    for w in range(cfg.reward.num_workers):
        nodes[w % c.num_nodes].reward_workers.append(w)
    return nodes


def format_placement(nodes: list[NodePlan]) -> list[str]:
    """One block per node: GPU -> trainer rank (coordinates) + engine rank; reward workers."""
    colocated = any(s.trainer_rank is not None and s.engine is not None for n in nodes for s in n.gpus)
    lines = ["placement (colocated: each GPU hosts a trainer rank and an engine rank):" if colocated else
             "placement (split: trainer ranks on the driver's node, engines on the others):"]
    for node in nodes:
        extra = " [driver, Ray head]" if node.driver else ""
        lines.append(f"  node {node.index} ({node.hostname}){extra}: reward workers "
                     f"{_ranges(node.reward_workers) or 'none'}")
        for g, slot in enumerate(node.gpus):
            trainer = f"trainer rank {slot.trainer_rank:>3} ({slot.coords})" if slot.trainer_rank is not None else "trainer -"
            engine = f"engine {slot.engine} rank {slot.engine_rank}" if slot.engine is not None else "engine -"
            lines.append(f"    gpu{g}: {trainer:<38} {engine}")
    return lines


def _ranges(values: list[int]) -> str:
    """'0-3,8' style compaction of sorted integers."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)
