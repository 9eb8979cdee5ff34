"""Ray placement of the run's processes: trainer ranks, rollout engines, reward workers.

On CPU every process is a plain Ray actor with logical CPUs (fractional for light ones, because
whole-CPU oversubscription makes later placements wait forever). On GPUs the trainer ranks get a
placement group packed per node, one GPU each, and engines are colocated on the same GPUs
(hybrid engine: the engine sleeps while the trainer trains).
"""
from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import ray

from megatron_rl.config import RunConfig
from megatron_rl.distributed.local_state import ray_temp_dir

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ray(cfg: RunConfig, run_dir: Path, device: str) -> None:
    """Connect to the configured Ray cluster or start a local one with quiet, contained state."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Children (trainer ranks, engines) inherit this: keep vLLM's caches and sockets in the run.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(run_dir / ".cache" / "vllm"))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env = {"env_vars": {k: os.environ[k] for k in ("RAY_AUTH_MODE", "VLLM_CACHE_ROOT", "VLLM_CPU_OMP_THREADS_BIND",
                                                    "PYTHONPATH") if k in os.environ}}
    if cfg.cluster.ray_address:
        ray.init(address=cfg.cluster.ray_address, runtime_env=env, log_to_driver=True)
        return
    temp = ray_temp_dir()  # follows TMPDIR, short enough for Ray's socket paths
    num_cpus = cfg.cluster.num_cpus or _needed_cpus(cfg, device)
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=str(temp), runtime_env=env,
             log_to_driver=True, configure_logging=False)


def _needed_cpus(cfg: RunConfig, device: str) -> int:
    """Logical CPUs for a local run: one per trainer rank and engine, plus the reward workers."""
    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size * p.data_parallel_size
    need = world + cfg.rollout.num_engines + cfg.reward.num_workers * cfg.reward.worker_num_cpus
    return max(int(need + 0.999), os.cpu_count() or 1)


def trainer_actor_options(cfg: RunConfig, device: str) -> dict:
    """Ray options for one trainer rank."""
    if device == "cuda":
        # Colocated with the engines: half a GPU each so both fit on every bundle.
        return {"num_cpus": 1, "num_gpus": 0.5}
    return {"num_cpus": 1, "num_gpus": 0}


def engine_actor_options(cfg: RunConfig, device: str) -> dict:
    """Ray options for one rollout engine actor (TP>1 engines spawn their own GPU workers)."""
    if device == "cuda" and cfg.rollout.tensor_parallel_size == 1:
        return {"num_cpus": 1, "num_gpus": 0.5}
    return {"num_cpus": 1, "num_gpus": 0}
