"""Ray placement of the run's processes: trainer ranks, rollout engines, reward workers.

On CPU every process is a plain Ray actor with logical CPUs (fractional for light ones, because
whole-CPU oversubscription makes later placements wait forever); ``cluster.placement=split`` pins
the trainer ranks to the driver's node and keeps the engines off it (a node-affinity and a
node-label strategy), so the weight push always crosses nodes.

On GPUs :func:`place_run` reserves every GPU of the run as one Ray placement group, one bundle per
GPU (:mod:`megatron_rl.distributed.gpu_bundles`), and :class:`RunPlacement` puts each trainer rank
and engine rank into the bundle :mod:`megatron_rl.distributed.gpu_layout` names, the rule the
dry-run plan prints too: colocated (the hybrid engine: trainer rank i and the engine rank on GPU i
take half of bundle i each, the engine sleeping while the trainer trains) or split (whole GPUs,
trainer ranks on the driver's node, engines on the others). A TP-k engine is an actor without a GPU
in its first bundle that runs vLLM's Ray executor: ``VLLM_RAY_BUNDLE_INDICES`` names its k bundles
(one node) and ``VLLM_RAY_PER_WORKER_GPUS`` each worker's share (``vllm/v1/executor/ray_executor.py``
``_init_workers_ray``; vLLM finds the placement group as the actor's own,
``vllm/engine/arg_utils.py`` ``create_engine_config``).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray

from megatron_rl.config.schema import RunConfig
from megatron_rl.distributed.gpu_bundles import NODE_ID_LABEL, reserve_gpus
from megatron_rl.distributed.gpu_layout import GpuLayout, run_layout, world_size
from megatron_rl.distributed.local_state import ray_temp_dir
from megatron_rl.distributed.ray_start import init_local_ray
from megatron_rl.runtime.fault_injection import FAULTS_DIR_ENV, FAULTS_ENV

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
    """Logical CPUs for a local run: one per trainer rank and engine, plus the reward workers. Engines
    counted at rollout TP 1, the most a run's rollout devices can hold: an elastic switch to a smaller TP
    (``at_rollout_tp``) starts more engines than the run started with, and an actor Ray cannot fit stays
    pending until the engine start times out."""
    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size * p.data_parallel_size
    most_engines = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
    need = (world * TRAINER_CPUS + most_engines * ENGINE_CPUS
            + cfg.reward.num_workers * cfg.reward.worker_num_cpus)
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


TRAINER_CPUS = 1.0
"""Logical CPUs of a trainer rank's actor."""
ENGINE_CPUS = 1.0
"""Logical CPUs of an engine's actor (vLLM's Ray workers ask for none, as vLLM starts them)."""
COLOCATED_SHARE = 0.5
"""GPU share of a trainer rank and of an engine rank that sit on the same GPU (the hybrid engine)."""


def trainer_actor_options(cfg: RunConfig, device: str) -> dict:
    """Ray options for one trainer rank of a CPU run (GPU runs: :meth:`RunPlacement.trainer_options`)."""
    _cpu_only(device)
    placed = _split_strategy("trainer") if cfg.cluster.placement == "split" else {}
    return {"num_cpus": TRAINER_CPUS, "num_gpus": 0, **placed}


def engine_actor_options(cfg: RunConfig, device: str) -> dict:
    """Ray options for one rollout engine actor of a CPU run (GPU runs: :meth:`RunPlacement.engine_options`)."""
    _cpu_only(device)
    placed = _split_strategy("engine") if cfg.cluster.placement == "split" else {}
    return {"num_cpus": ENGINE_CPUS, "num_gpus": 0, **placed}


def _cpu_only(device: str) -> None:
    if device != "cpu":
        raise ValueError(f"device {device!r}: GPU processes are placed through cluster.place_run's RunPlacement")


@dataclass
class RunPlacement:
    """Where the run's trainer ranks and engines go: Ray options per rank and per engine, and the
    rendezvous address. CPU runs: the plain options above (``bundles`` is None)."""

    cfg: RunConfig
    """The run's config (its layout: parallel sizes, rollout TP and engines, cluster shape)."""
    device: str
    """'cpu' or 'cuda'."""
    bundles: Any = None
    """The run's :class:`~megatron_rl.distributed.gpu_bundles.GpuBundles` on GPUs, else None."""

    @property
    def split(self) -> bool:
        return self.cfg.cluster.placement == "split"

    def layout(self, cfg: RunConfig | None = None) -> GpuLayout:
        """The GPU layout of ``cfg`` (default: the run's; an elastic TP switch passes its own)."""
        return run_layout(cfg or self.cfg)

    def trainer_options(self, rank: int) -> dict:
        """Ray options of trainer rank ``rank``."""
        if self.bundles is None:
            return trainer_actor_options(self.cfg, self.device)
        gpu = self.layout().trainer_gpus[rank]
        share = 1.0 if self.split else COLOCATED_SHARE
        return {"num_cpus": TRAINER_CPUS, "num_gpus": share, "scheduling_strategy": self.bundles.strategy(gpu)}

    def all_trainer_options(self) -> list[dict]:
        """:meth:`trainer_options` of every rank, in rank order."""
        return [self.trainer_options(rank) for rank in range(world_size(self.cfg))]

    def engine_options(self, cfg: RunConfig | None = None) -> list[dict]:
        """Ray options of each engine of ``cfg`` (default: the run's; an elastic TP switch or a
        restart passes its config and gets the same GPUs by the same rule)."""
        cfg = cfg or self.cfg
        if self.bundles is None:
            return [engine_actor_options(cfg, self.device)] * cfg.rollout.num_engines
        share = 1.0 if self.split else COLOCATED_SHARE
        out = []
        for gpus in self.layout(cfg).engine_gpus:
            if len(gpus) == 1:
                out.append({"num_cpus": ENGINE_CPUS, "num_gpus": share, "scheduling_strategy": self.bundles.strategy(gpus[0])})
                continue
            # TP > 1: the actor holds no GPU; vLLM's Ray executor starts one worker per bundle named in
            # VLLM_RAY_BUNDLE_INDICES, each with VLLM_RAY_PER_WORKER_GPUS of its GPU (vllm/envs.py,
            # vllm/v1/executor/ray_executor.py). Env vars of an actor's runtime_env reach vLLM's
            # engine-core process, which the actor spawns, and merge with the job's.
            env = {"VLLM_RAY_BUNDLE_INDICES": ",".join(str(self.bundles.bundle[g]) for g in gpus),
                   "VLLM_RAY_PER_WORKER_GPUS": f"{share:g}"}
            out.append({"num_cpus": ENGINE_CPUS, "num_gpus": 0, "runtime_env": {"env_vars": env},
                        "scheduling_strategy": self.bundles.strategy(gpus[0], capture_children=True)})
        return out

    def master_addr(self) -> str:
        """Address of the rendezvous store, which trainer rank 0 hosts: its node's IP (on one node,
        loopback)."""
        if self.cfg.cluster.num_nodes == 1:
            return "127.0.0.1"
        if self.bundles is None:
            return ray.util.get_node_ip_address()  # CPU: rank 0 runs on the driver's node or where Ray put it
        return self.bundles.ip[self.layout().trainer_gpus[0]]

    def describe(self) -> str:
        """Where trainer rank 0 (the rendezvous store) and the bundles are, for the start-up log."""
        if self.bundles is None:
            return "CPU run: Ray places every actor"
        b, rank0 = self.bundles, self.layout().trainer_gpus[0]
        return (f"{len(b.bundle)} one-GPU bundles on {len(set(b.node))} node(s); trainer rank 0 on node "
                f"{b.node[rank0][:12]} ({b.ip[rank0]}) GPU {b.gpu_id[rank0]}")

    def release(self) -> None:
        """Give the GPUs back (after the actors are gone)."""
        if self.bundles is not None:
            self.bundles.remove()
            self.bundles = None


def place_run(cfg: RunConfig, device: str) -> RunPlacement:
    """The run's placement: on GPUs, every GPU of ``cluster.num_nodes`` x ``cluster.gpus_per_node``
    reserved as one bundle each (the layout is checked first: a LayoutError names the key before
    anything starts); on CPU, nothing to reserve."""
    if device == "cpu":
        return RunPlacement(cfg, device)
    layout = run_layout(cfg)
    bundles = reserve_gpus(layout.num_nodes * layout.gpus_per_node, TRAINER_CPUS + ENGINE_CPUS)
    return RunPlacement(cfg, device, bundles)


def at_rollout_tp(cfg: RunConfig, tp: int) -> RunConfig:
    """``cfg`` with the run's rollout GPUs (``tensor_parallel_size x num_engines``) split into
    engines of TP ``tp`` (``devices // tp`` of them): what an elastic TP switch starts."""
    devices = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
    if tp < 1 or devices % tp:
        raise ValueError(f"rollout TP {tp} does not divide the run's {devices} rollout GPUs")
    return replace(cfg, rollout=replace(cfg.rollout, tensor_parallel_size=tp, num_engines=devices // tp))

