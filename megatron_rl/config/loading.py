"""Load a YAML recipe into :class:`RunConfig`, apply dotted overrides, validate up front.

Every error is a :class:`ConfigError` whose message names the offending key (``data.prompts_per_step``)
and, for files, the file. Validation runs before Ray, Megatron or vLLM start.
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from pathlib import Path
from typing import Any, Callable

import yaml

from megatron_rl.config import RunConfig, plugin_sections
from megatron_rl.plugins import PluginError, load_plugin_packages, scheduler_path


class ConfigError(ValueError):
    """A configuration problem, with the dotted key it concerns in the message."""


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, typ: Any, key: str, from_string: bool) -> Any:
    """Convert ``value`` to ``typ`` or raise naming ``key``. Strings from the CLI are parsed.
    ``X | None`` fields take null (YAML ``null``, ``key=null`` on the command line) or an X."""
    args = typing.get_args(typ)
    if type(None) in args and len(args) == 2:
        if value is None or (from_string and isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key, from_string)
    if from_string and isinstance(value, str) and typ is not str:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: cannot parse {value!r}: {exc}") from None
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '1e-5' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
        if from_string and value is not None:
            return str(value)
    else:  # pragma: no cover - only the four scalar types are used in RunConfig
        raise ConfigError(f"{key}: unsupported field type {typ}")
    raise ConfigError(f"{key}: expected {typ.__name__}, got {type(value).__name__} {value!r}")


def section_names(cfg: RunConfig) -> list[str]:
    """Every section a recipe may set: the core ones, then the registered plug-in sections."""
    core = [f.name for f in dataclasses.fields(RunConfig) if f.name != "extensions"]
    return core + sorted(plugin_sections())


def _unknown_key(key: str, source: str, known_here: list[str]) -> ConfigError:
    """The error for a key its section does not have; it names the keys of the same name in other
    sections (a key that moved to another section, e.g. into a plug-in's own)."""
    name = key.rsplit(".", 1)[-1]
    elsewhere: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for field_name, typ in _field_types(cls).items():
            dotted = f"{prefix}.{field_name}"
            if dataclasses.is_dataclass(typ):
                walk(typ, dotted)
            elif field_name == name and dotted != key:
                elsewhere.append(dotted)

    sections = {f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)
                if f.name != "extensions"}
    sections.update({section: cls for section, (cls, _) in plugin_sections().items()})
    for section, cls in sections.items():
        walk(cls, section)
    hint = f"; did you mean {' or '.join(repr(k) for k in sorted(elsewhere))}?" if elsewhere else ""
    return ConfigError(f"unknown key '{key}' in {source} (known here: {', '.join(sorted(known_here))}){hint}")


def _section(cfg: RunConfig, name: str, where: str) -> Any:
    if name not in section_names(cfg):
        raise ConfigError(f"unknown section '{name}' in {where} (sections: {', '.join(section_names(cfg))})")
    return getattr(cfg, name)


def _apply_mapping(obj: Any, mapping: dict, prefix: str, source: str) -> None:
    if not isinstance(mapping, dict):
        raise ConfigError(f"{prefix or 'top level'} in {source}: expected a mapping, got {mapping!r}")
    if isinstance(obj, RunConfig):
        for name, value in mapping.items():
            _apply_mapping(_section(obj, str(name), source), value, str(name), source)
        return
    types = _field_types(type(obj))
    for name, value in mapping.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in types:
            raise _unknown_key(key, source, list(types))
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            _apply_mapping(current, value, key, source)
        else:
            setattr(obj, name, _coerce(value, types[name], key, from_string=False))


def apply_override(cfg: RunConfig, assignment: str) -> None:
    """Apply one ``section.field=value`` override (value parsed as YAML scalar)."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.field=value")
    dotted, raw = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) < 2:
        raise ConfigError(f"override {assignment!r} must look like section.field=value")
    obj: Any = _section(cfg, parts[0], "command-line override")
    for i, part in enumerate(parts[1:], start=1):
        key = ".".join(parts[: i + 1])
        types = _field_types(type(obj))
        if part not in types:
            raise _unknown_key(key, "command-line override", list(types))
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(obj, part)):
                raise ConfigError(f"'{key}' is a section; override one of its fields")
            setattr(obj, part, _coerce(raw, types[part], key, from_string=True))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"'{key}' is a field, not a section")


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> RunConfig:
    """Read a recipe (or start from defaults when ``path`` is None) and apply overrides. The
    installed plug-in packages register their sections first (``plugins.load_plugin_packages``),
    so their keys parse like the core's."""
    try:
        load_plugin_packages()
    except PluginError as exc:
        raise ConfigError(str(exc)) from None
    cfg = RunConfig()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: invalid YAML: {exc}") from None
        _apply_mapping(cfg, data, "", str(p))
    for assignment in overrides:
        apply_override(cfg, assignment)
    return cfg


def config_to_dict(cfg: RunConfig) -> dict:
    """The configuration as plain data, every section (core and plug-in) at the top level: what
    run_dir/config.json, checkpoint manifests and W&B get, and what :func:`load_config` reads."""
    data = dataclasses.asdict(cfg)
    data.update(data.pop("extensions"))
    return data


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


def resolve_quantization_tis(cfg: RunConfig) -> str:
    """Quantized rollout turns truncated importance sampling on by default: with
    rollout.quantization on and algorithm.tis_cap 0, set tis_cap to rollout.quantization_tis_cap.
    Returns the start-up message saying what was decided (empty without quantization)."""
    r, a = cfg.rollout, cfg.algorithm
    if r.quantization == "none":
        return ""
    if a.tis_cap > 0:
        return (f"rollout.quantization={r.quantization}: truncated importance sampling on with the given "
                f"algorithm.tis_cap={a.tis_cap:g}")
    if r.quantization_tis_cap > 0:
        a.tis_cap = r.quantization_tis_cap
        return (f"rollout.quantization={r.quantization}: truncated importance sampling on by default "
                f"(algorithm.tis_cap={a.tis_cap:g}, from rollout.quantization_tis_cap) to correct the quantized "
                "engine's logprob gap; rollout.quantization_tis_cap=0 turns it off")
    return (f"rollout.quantization={r.quantization}: truncated importance sampling OFF "
            "(rollout.quantization_tis_cap=0): the engine/trainer logprob gap goes uncorrected")


def resolve_off_policy_tis(cfg: RunConfig, max_staleness: int) -> str:
    """A scheduler that trains off-policy tokens (staleness bound ``max_staleness`` > 0) turns
    truncated importance sampling on by default: with algorithm.tis_cap 0, set it to
    algorithm.off_policy_tis_cap. Returns the start-up message (empty for an on-policy scheduler).
    Runs after :func:`resolve_quantization_tis`: one cap serves both corrections."""
    a = cfg.algorithm
    if max_staleness <= 0:
        return ""
    what = f"scheduler.name={cfg.scheduler.name} trains tokens up to {max_staleness} policy version(s) old"
    if a.tis_cap > 0:
        return f"{what}: truncated importance sampling on with algorithm.tis_cap={a.tis_cap:g}"
    if a.off_policy_tis_cap > 0:
        a.tis_cap = a.off_policy_tis_cap
        return (f"{what}: truncated importance sampling on by default (algorithm.tis_cap={a.tis_cap:g}, from "
                "algorithm.off_policy_tis_cap); algorithm.off_policy_tis_cap=0 turns it off")
    return f"{what}: truncated importance sampling OFF (algorithm.off_policy_tis_cap=0): they train uncorrected"


# parallel.recompute_granularity values; megatron_rl.model.qwen2 maps them to TransformerConfig.
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")


def comma_list(spec: str) -> list[str]:
    """A comma-separated config value (e.g. stream.rounds 'long,short') as a list of stripped items."""
    return [r.strip() for r in spec.split(",") if r.strip()]


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
