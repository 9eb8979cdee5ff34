"""Validate a loaded :class:`RunConfig` up front: values, the parallel layout, the model's shape and
the plug-in sections' own checks (:func:`register_validator`). Each error names the key."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from megatron_rl.config.plugins import PluginError, scheduler_path
from megatron_rl.config.schema import RunConfig
from megatron_rl.config.values import ConfigError, comma_list


def _choice(value: str, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


def _positive(value: float, key: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def read_hf_architecture(hf_path: str) -> dict | None:
    """config.json of the model, or None when the model is not built yet (local run builds it)."""
    cfg_file = Path(hf_path) / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model.hf_path: {cfg_file} is not valid JSON: {exc}") from None


def resolve_device(cfg: RunConfig) -> str:
    if cfg.cluster.device != "auto":
        return cfg.cluster.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def validate(cfg: RunConfig, arch: dict | None = None, device: str | None = None) -> None:
    """Check values and the parallel layout; raises ConfigError naming the key."""
    _choice(cfg.model.dtype, ("float32", "bfloat16"), "model.dtype")
    _choice(cfg.model.transformer_impl, ("auto", "local", "transformer_engine"), "model.transformer_impl")
    _choice(cfg.cluster.device, ("auto", "cpu", "cuda"), "cluster.device")
    _choice(cfg.cluster.placement, ("auto", "split"), "cluster.placement")
    if cfg.cluster.placement == "split" and cfg.cluster.num_nodes < 2:
        raise ConfigError("cluster.placement 'split' puts the engines on other nodes than the trainer ranks: "
                          f"it needs cluster.num_nodes >= 2 (got {cfg.cluster.num_nodes})")
    _choice(cfg.rollout.backend, ("vllm",), "rollout.backend")
    _choice(cfg.rollout.cpu_executor, ("auto", "inproc", "mp"), "rollout.cpu_executor")
    _choice(cfg.rollout.cpu_engine_start, ("fork", "spawn"), "rollout.cpu_engine_start")
    _positive(cfg.rollout.cpu_threads, "rollout.cpu_threads", allow_zero=True)
    _choice(cfg.model.local_attention, ("sdpa", "unfused"), "model.local_attention")
    _choice(cfg.reward.kind, ("math", "code", "mixed", "judge"), "reward.kind")
    _choice(cfg.reward.sandbox_isolation, ("auto", "namespaces", "audit"), "reward.sandbox_isolation")
    if cfg.reward.kind == "judge" and not cfg.reward.judge_model:
        raise ConfigError("reward.judge_model is required when reward.kind is 'judge'")
    _validate_reward_scaling(cfg)
    try:
        scheduler_path(cfg.scheduler.name)
    except PluginError as exc:
        raise ConfigError(str(exc)) from None
    _choice(cfg.rollout.weight_sync_format, ("hf", "sharded", "tensor"), "rollout.weight_sync_format")
    _choice(cfg.rollout.weight_push_channel, ("auto", "network"), "rollout.weight_push_channel")
    if cfg.rollout.weight_push_bucket_mb <= 0 or cfg.rollout.weight_push_timeout_s <= 0:
        raise ConfigError("rollout.weight_push_bucket_mb and rollout.weight_push_timeout_s must be > 0")
    _positive(cfg.rollout.weight_push_buffers, "rollout.weight_push_buffers")
    if cfg.rollout.sleep_level not in (1, 2):
        raise ConfigError(f"rollout.sleep_level: must be 1 (weights to host) or 2 (weights discarded), "
                          f"got {cfg.rollout.sleep_level}")
    _validate_speculative(cfg)
    _choice(cfg.algorithm.advantage, ("grpo", "drgrpo"), "algorithm.advantage")
    _choice(cfg.algorithm.loss_agg, ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"), "algorithm.loss_agg")
    _choice(cfg.algorithm.kl_type, ("k1", "k3"), "algorithm.kl_type")
    _choice(cfg.trainer.wandb_mode, ("offline", "online"), "trainer.wandb_mode")
    fmt = ("auto", "gsm8k", "math", "deepmath", "kodcode", "builtin", "custom")
    _choice(cfg.data.format, fmt, "data.format")
    _choice(cfg.data.eval_format, fmt, "data.eval_format")
    if cfg.data.format == "custom" and not (cfg.data.prompt_key and cfg.data.answer_key):
        raise ConfigError("data.prompt_key and data.answer_key are required when data.format is 'custom'")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "data_parallel_size"):
        _positive(getattr(cfg.parallel, key), f"parallel.{key}")
    if cfg.parallel.context_parallel_size > 1:
        # Megatron-Core CP needs TE's CP attention (ring/all-to-all over cp_group), each sequence cut into
        # 2 x CP load-balanced chunks per rank and CP-aware DP sample division and grad reduction; none is wired.
        raise ConfigError(
            f"parallel.context_parallel_size={cfg.parallel.context_parallel_size}: context parallelism is not "
            "supported (Megatron-Core CP needs Transformer Engine's context-parallel attention, the load-balanced "
            "2 x CP split of every sequence and CP-aware sample division, none of which this trainer wires; CP ranks "
            "would train on duplicate data). Set it to 1 and use tensor/pipeline parallelism instead")
    _choice(cfg.parallel.recompute_granularity, RECOMPUTE_GRANULARITIES, "parallel.recompute_granularity")
    for key in ("tensor_parallel_size", "num_engines", "max_new_tokens", "max_num_seqs"):
        _positive(getattr(cfg.rollout, key), f"rollout.{key}")
    _positive(cfg.rollout.temperature, "rollout.temperature", allow_zero=True)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p: must be in (0, 1], got {cfg.rollout.top_p}")
    for key in ("prompts_per_step", "responses_per_prompt", "max_prompt_tokens"):
        _positive(getattr(cfg.data, key), f"data.{key}")
    _positive(cfg.data.eval_every, "data.eval_every", allow_zero=True)
    if not 0 <= cfg.data.max_overlong_fraction <= 1:
        raise ConfigError(f"data.max_overlong_fraction: must be in [0, 1], got {cfg.data.max_overlong_fraction}")
    _positive(cfg.reward.timeout_s, "reward.timeout_s")
    _positive(cfg.reward.num_workers, "reward.num_workers")
    _positive(cfg.algorithm.clip_low, "algorithm.clip_low", allow_zero=True)
    _positive(cfg.algorithm.clip_high, "algorithm.clip_high", allow_zero=True)
    _positive(cfg.algorithm.kl_coef, "algorithm.kl_coef", allow_zero=True)
    _positive(cfg.algorithm.tis_cap, "algorithm.tis_cap", allow_zero=True)
    _positive(cfg.algorithm.off_policy_tis_cap, "algorithm.off_policy_tis_cap", allow_zero=True)
    if cfg.algorithm.clip_ratio_c and cfg.algorithm.clip_ratio_c <= 1.0:
        raise ConfigError(f"algorithm.clip_ratio_c: the dual-clip bound must be > 1 (or 0 to disable), "
                          f"got {cfg.algorithm.clip_ratio_c}")
    _positive(cfg.algorithm.log_ratio_clamp, "algorithm.log_ratio_clamp", allow_zero=True)
    _positive(cfg.algorithm.ppo_mini_batches, "algorithm.ppo_mini_batches")
    if cfg.algorithm.overlong_buffer_tokens >= cfg.rollout.max_new_tokens:
        raise ConfigError("algorithm.overlong_buffer_tokens must be smaller than rollout.max_new_tokens")
    _positive(cfg.optimizer.lr, "optimizer.lr")
    _positive(cfg.optimizer.micro_batch_tokens, "optimizer.micro_batch_tokens")
    _positive(cfg.trainer.steps, "trainer.steps")
    _positive(cfg.trainer.save_every, "trainer.save_every", allow_zero=True)
    _positive(cfg.trainer.keep_checkpoints, "trainer.keep_checkpoints")
    if cfg.algorithm.recompute_old_logprobs is False and cfg.algorithm.ppo_mini_batches != 1:
        raise ConfigError("algorithm.recompute_old_logprobs=false needs algorithm.ppo_mini_batches = 1: after the "
                          f"first optimizer step the weights are no longer the old policy (got {cfg.algorithm.ppo_mini_batches})")
    if cfg.data.prompts_per_step % cfg.algorithm.ppo_mini_batches:
        raise ConfigError("algorithm.ppo_mini_batches must divide data.prompts_per_step")
    if cfg.rollout.max_model_len and cfg.rollout.max_model_len < cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens:
        raise ConfigError("rollout.max_model_len must be >= data.max_prompt_tokens + rollout.max_new_tokens")
    if cfg.optimizer.micro_batch_tokens < cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens:
        raise ConfigError("optimizer.micro_batch_tokens must hold one full sequence "
                          "(>= data.max_prompt_tokens + rollout.max_new_tokens)")

    device = device or resolve_device(cfg)
    par = cfg.parallel
    if device == "cpu":
        if par.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel is for GPU runs (Transformer Engine's norms); on CPU only the "
                              "rules tests run it, through the CPU shim's tagged RMSNorm")
        if par.use_distributed_optimizer:
            raise ConfigError("parallel.use_distributed_optimizer needs CUDA (Megatron's distributed optimizer "
                              "accepts only torch.cuda parameters); set it to false for CPU runs")
        if cfg.model.dtype == "bfloat16":
            raise ConfigError("model.dtype bfloat16 is GPU-only here; use float32 on CPU")
        if cfg.model.transformer_impl == "transformer_engine":
            raise ConfigError("model.transformer_impl 'transformer_engine' needs a GPU; use 'auto' or 'local'")
        cpus = cfg.cluster.num_cpus or os.cpu_count() or 1
        # Each trainer rank and each engine needs one whole logical CPU; reward workers share.
        need = (_world_size(cfg) + cfg.rollout.num_engines
                + max(cfg.reward.num_workers, cfg.reward.max_workers) * cfg.reward.worker_num_cpus)
        if need > cpus * 4:
            raise ConfigError(f"cluster.num_cpus: layout needs {need:g} logical CPUs (trainer ranks + engines + "
                              f"reward workers) but only {cpus} CPUs are available (oversubscription capped at 4x)")
    else:
        gpus = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
        # Colocated: trainer ranks and engines share the same GPUs, so each must fit on its own.
        if _world_size(cfg) > gpus:
            raise ConfigError(f"parallel: trainer world size {_world_size(cfg)} (TPxPPxCPxDP) exceeds "
                              f"cluster.num_nodes x cluster.gpus_per_node = {gpus} GPUs")
        engine_gpus = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
        if engine_gpus > gpus:
            raise ConfigError(f"rollout: {engine_gpus} GPUs for engines (tensor_parallel_size x num_engines) "
                              f"exceed the {gpus} GPUs of the cluster")
        if cfg.rollout.tensor_parallel_size > cfg.cluster.gpus_per_node:
            raise ConfigError("rollout.tensor_parallel_size: a TP group must fit in one node "
                              f"({cfg.cluster.gpus_per_node} GPUs)")
        if cfg.cluster.placement == "split" and _world_size(cfg) > cfg.cluster.gpus_per_node:
            raise ConfigError(f"cluster.placement 'split' keeps the trainer ranks on the driver's node: trainer world "
                              f"size {_world_size(cfg)} exceeds its {cfg.cluster.gpus_per_node} GPUs")
    _validate_quantization(cfg, device)
    for check in _VALIDATORS:  # plug-in packages' sections (e.g. RollPacker's tail_batching, stream, planner)
        check(cfg)
    if arch is not None:
        validate_against_architecture(cfg, arch)


_VALIDATORS: list[Callable[[RunConfig], None]] = []


def register_validator(check: Callable[[RunConfig], None]) -> None:
    """Run ``check(cfg)`` as part of :func:`validate` (plug-in packages check their own sections
    this way; raise ConfigError naming the key). Idempotent."""
    if check not in _VALIDATORS:
        _VALIDATORS.append(check)


SPECULATIVE_METHODS = ("off", "ngram", "suffix")
"""``rollout.speculative.method`` names; anything else must be a dotted proposer class path."""


def _validate_speculative(cfg: RunConfig) -> None:
    """``rollout.speculative.*``: the method (or a proposer class path), draft and match sizes."""
    sp = cfg.rollout.speculative
    parts = sp.method.split(".")
    if sp.method not in SPECULATIVE_METHODS and not (len(parts) >= 2 and all(p.isidentifier() for p in parts)):
        raise ConfigError(f"rollout.speculative.method: expected one of {SPECULATIVE_METHODS} or an import path "
                          f"'package.module.Class' of a vLLM custom proposer, got {sp.method!r}")
    if not 1 <= sp.num_speculative_tokens <= 32:
        raise ConfigError(f"rollout.speculative.num_speculative_tokens: must be in 1..32, got {sp.num_speculative_tokens}")
    rounds = comma_list(sp.rounds)
    if not rounds or not all(r.isidentifier() for r in rounds):
        raise ConfigError(f"rollout.speculative.rounds: expected comma-separated round types like 'long' or "
                          f"'long,short', got {sp.rounds!r}")
    if sp.step_draft_budget < 0:
        raise ConfigError(f"rollout.speculative.step_draft_budget: must be >= 0 (0: no limit), got {sp.step_draft_budget}")
    if not 1 <= sp.min_match_tokens <= sp.max_match_tokens <= 64:
        raise ConfigError("rollout.speculative.min_match_tokens and max_match_tokens must satisfy 1 <= min <= max "
                          f"<= 64, got {sp.min_match_tokens} and {sp.max_match_tokens}")
    _positive(sp.max_reference_tokens, "rollout.speculative.max_reference_tokens", allow_zero=True)


def _validate_reward_scaling(cfg: RunConfig) -> None:
    r = cfg.reward
    low, high = r.min_workers or r.num_workers, r.max_workers or r.num_workers
    if not low <= r.num_workers <= high:
        raise ConfigError(f"reward.num_workers={r.num_workers} must lie within reward.min_workers..reward.max_workers "
                          f"({low}..{high}; 0 means num_workers)")
    for key in ("code_timeout_scale", "code_timeout_min_s", "scale_up_queue_per_worker", "sandbox_memory_mb",
                "sandbox_disk_mb",
                "judge_max_new_tokens", "judge_max_prompt_tokens"):
        _positive(getattr(r, key), f"reward.{key}")
    if r.code_timeout_max_s < r.code_timeout_min_s:
        raise ConfigError("reward.code_timeout_max_s must be >= reward.code_timeout_min_s")


QUANTIZATION_METHODS = ("none", "int8", "fp8")
"""rollout.quantization values (megatron_rl.quantization.scheme.METHODS)."""


def _validate_quantization(cfg: RunConfig, device: str) -> None:
    _choice(cfg.rollout.quantization, QUANTIZATION_METHODS, "rollout.quantization")
    _positive(cfg.rollout.quantization_tis_cap, "rollout.quantization_tis_cap", allow_zero=True)
    if cfg.rollout.quantization == "fp8" and device == "cpu":
        raise ConfigError("rollout.quantization=fp8 needs GPUs (vLLM's FP8 linear kernels take bf16/fp16 "
                          "activations; the CPU engine runs float32): use rollout.quantization=int8 on CPU")

# parallel.recompute_granularity values; megatron_rl.model.qwen2 maps them to TransformerConfig.
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")

def _world_size(cfg: RunConfig) -> int:
    p = cfg.parallel
    return p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size * p.data_parallel_size


def validate_against_architecture(cfg: RunConfig, arch: dict) -> None:
    heads = arch.get("num_attention_heads")
    kv = arch.get("num_key_value_heads", heads)
    layers = arch.get("num_hidden_layers")
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    if heads % tp:
        raise ConfigError(f"parallel.tensor_model_parallel_size={tp} does not divide the model's "
                          f"{heads} attention heads")
    if kv % tp:
        raise ConfigError(f"parallel.tensor_model_parallel_size={tp} does not divide the model's "
                          f"{kv} KV groups (num_key_value_heads)")
    if layers % pp:
        raise ConfigError(f"parallel.pipeline_model_parallel_size={pp} does not divide the model's {layers} layers")
    rtp = cfg.rollout.tensor_parallel_size
    if heads % rtp or (kv % rtp and rtp % kv):
        raise ConfigError(f"rollout.tensor_parallel_size={rtp} does not fit {heads} heads / {kv} KV heads")
    max_pos = arch.get("max_position_embeddings")
    total = cfg.rollout.max_model_len or (cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    if max_pos and total > max_pos:
        raise ConfigError(f"rollout.max_new_tokens + data.max_prompt_tokens = {total} exceeds the model's "
                          f"max_position_embeddings {max_pos}")
