"""Ray placement of the run's processes: trainer ranks, rollout engines, reward workers.

On CPU every process is a plain Ray actor with logical CPUs (fractional for light ones, because
whole-CPU oversubscription makes later placements wait forever). On GPUs the trainer ranks get a
placement group packed per node, one GPU each, and engines are colocated on the same GPUs
(hybrid engine: the engine sleeps while the trainer trains). ``cluster.placement=split`` pins
the trainer ranks to the driver's node and keeps the engines off it (a node-affinity and a
node-label strategy), so the weight push always crosses nodes.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import ray

from megatron_rl.config import RunConfig
from megatron_rl.distributed.local_state import ray_temp_dir
from megatron_rl.distributed.ray_start import init_local_ray
from megatron_rl.fault_injection import FAULTS_DIR_ENV, FAULTS_ENV

log = logging.getLogger(__name__)


def start_ray(cfg: RunConfig, run_dir: Path, device: str) -> None:
    """Connect to the configured Ray cluster or start a local one with quiet, contained state."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Children (trainer ranks, engines) inherit this: keep vLLM's caches and sockets in the run.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(run_dir / ".cache" / "vllm"))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # Workers of an existing cluster do not inherit the driver's environment: pass on what they need
    # (armed fault points too, so fault-injection tests reach every process).
    env = {"env_vars": {k: os.environ[k] for k in ("RAY_AUTH_MODE", "VLLM_CACHE_ROOT", "VLLM_CPU_OMP_THREADS_BIND",
                                                    "PYTHONPATH", FAULTS_ENV, FAULTS_DIR_ENV) if k in os.environ}}
    if cfg.cluster.ray_address:
        ray.init(address=cfg.cluster.ray_address, runtime_env=env, log_to_driver=True)
        log.info("Ray cluster at %s: %s", cfg.cluster.ray_address, describe_nodes())
        return
    temp = ray_temp_dir()  # follows TMPDIR, short enough for Ray's socket paths
    num_cpus = cfg.cluster.num_cpus or _needed_cpus(cfg, device)
    init_local_ray(num_cpus=num_cpus, include_dashboard=False, _temp_dir=str(temp), runtime_env=env,
                   log_to_driver=True, configure_logging=False)


def _needed_cpus(cfg: RunConfig, device: str) -> int:
    """Logical CPUs for a local run: one per trainer rank and engine, plus the reward workers."""
    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size * p.data_parallel_size
    need = world + cfg.rollout.num_engines + cfg.reward.num_workers * cfg.reward.worker_num_cpus
    return max(int(need + 0.999), os.cpu_count() or 1)


def describe_nodes() -> str:
    """The alive Ray nodes, one ``<node id> (<ip>, <n> CPU, <m> GPU)`` each, head first."""
    nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: not n.get("IsHeadNode", False))
    parts = [f"{n['NodeID']} ({n['NodeManagerAddress']}, {n['Resources'].get('CPU', 0):g} CPU, "
             f"{n['Resources'].get('GPU', 0):g} GPU)" for n in nodes]
    return f"{len(parts)} node(s) alive: " + ", ".join(parts)


def describe_placement(rank_nodes: list[tuple[str, str]], engine_nodes: list[str]) -> str:
    """Which node holds which trainer ranks and engine replicas (``rank_nodes``: (node id, ip) per
    rank; ``engine_nodes``: node id per replica), for the start-up log."""
    ips = dict(rank_nodes) | {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}

    def on_nodes(what: str, nodes: list[str]) -> str:
        by_node: dict[str, list[int]] = {}
        for index, node in enumerate(nodes):
            by_node.setdefault(node, []).append(index)
        return "; ".join(f"{what} {','.join(map(str, idx))} on node {node} ({ips.get(node, '?')})"
                         for node, idx in by_node.items())

    return f"{on_nodes('trainer ranks', [n for n, _ in rank_nodes])}; {on_nodes('engine replicas', engine_nodes)}"


NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its own id (what node-label strategies match on)."""


def _split_strategy(role: str) -> dict:
    """``cluster.placement=split``: trainer ranks pinned to the driver's node (hard affinity),
    engines on any node but that one (a hard node-label rule, so Ray still picks among the rest)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, NodeLabelSchedulingStrategy, NotIn

    here = ray.get_runtime_context().get_node_id()
    if role == "trainer":
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=here, soft=False)}
    return {"scheduling_strategy": NodeLabelSchedulingStrategy(hard={NODE_ID_LABEL: NotIn(here)})}


def check_engine_nodes(cfg: RunConfig) -> None:
    """Before starting replacement engines: under ``cluster.placement=split`` they may only go to
    a node other than the driver's, and when none is left alive (the engines' node was lost) they
    would wait for a placement forever. Raises naming the lost nodes; no-op otherwise."""
    if cfg.cluster.placement != "split":
        return
    here = ray.get_runtime_context().get_node_id()
    nodes = ray.nodes()
    if any(n.get("Alive") and n["NodeID"] != here for n in nodes):
        return
    lost = [f"{n['NodeID'][:12]} ({n.get('NodeManagerAddress', '?')})" for n in nodes if not n.get("Alive")]
    raise RuntimeError(f"cluster.placement=split: no alive Ray node besides the driver's ({here[:12]}) to start the "
                       f"rollout engines on; node(s) lost: {', '.join(lost) or 'none'}")


def trainer_actor_options(cfg: RunConfig, device: str) -> dict:
    """Ray options for one trainer rank."""
    placed = _split_strategy("trainer") if cfg.cluster.placement == "split" else {}
    if device == "cuda":
        # Colocated with the engines (half a GPU each so both fit on every bundle) unless split.
        return {"num_cpus": 1, "num_gpus": 1 if placed else 0.5, **placed}
    return {"num_cpus": 1, "num_gpus": 0, **placed}


def engine_actor_options(cfg: RunConfig, device: str) -> dict:
    """Ray options for one rollout engine actor (TP>1 engines spawn their own GPU workers)."""
    placed = _split_strategy("engine") if cfg.cluster.placement == "split" else {}
    if device == "cuda" and cfg.rollout.tensor_parallel_size == 1:
        # Colocated with the trainer ranks unless split: then a whole GPU of another node.
        return {"num_cpus": 1, "num_gpus": 1 if placed else 0.5, **placed}
    return {"num_cpus": 1, "num_gpus": 0, **placed}
