"""Qwen2 / Qwen2.5 on Megatron-Core: HF config.json -> TransformerConfig, layer spec, GPTModel.

Used for the trainable policy and the frozen reference model alike. The Transformer Engine
layer spec is chosen at run time (GPU present, TE importable, ``model.transformer_impl``
allowing it); otherwise Megatron's local spec, which is what runs on CPU.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Megatron pads the vocabulary to a multiple of this x TP (its --make-vocab-size-divisible-by).
VOCAB_DIVISIBLE_BY = 128


@dataclass(frozen=True)
class Qwen2Arch:
    """The architecture facts of a Qwen2 HF config.json that the conversion needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        """Per-head size (hidden / heads)."""
        return self.hidden_size // self.num_heads


def read_qwen2_arch(hf_path: str | Path) -> Qwen2Arch:
    """Parse ``hf_path/config.json`` of a Qwen2/Qwen2.5 checkpoint; errors name the file and key."""
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model.hf_path: no config.json in {hf_path}")
    raw: dict[str, Any] = json.loads(path.read_text())
    if raw.get("model_type") not in ("qwen2",):
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not 'qwen2' (Qwen2/Qwen2.5)")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window=true is not supported")
    rope_theta = raw.get("rope_theta")
    if rope_theta is None:  # transformers 5 may nest it under rope_parameters
        rope_theta = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    try:
        arch = Qwen2Arch(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )
    except KeyError as err:
        raise ValueError(f"{path}: missing key {err.args[0]!r}") from None
    if arch.hidden_size % arch.num_heads:
        raise ValueError(f"{path}: hidden_size {arch.hidden_size} not divisible by num_attention_heads")
    return arch


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def check_parallel_fits(arch: Qwen2Arch, tp_size: int, pp_size: int) -> None:
    """Raise a clear error when TP/PP do not divide the heads, KV groups or layers."""
    if arch.num_heads % tp_size or arch.num_kv_heads % tp_size:
        raise ValueError(
            f"parallel.tensor_model_parallel_size={tp_size} must divide num_attention_heads="
            f"{arch.num_heads} and num_key_value_heads={arch.num_kv_heads}"
        )
    if arch.num_layers % pp_size:
        raise ValueError(
            f"parallel.pipeline_model_parallel_size={pp_size} must divide num_hidden_layers={arch.num_layers}"
        )


def use_transformer_engine(transformer_impl: str) -> bool:
    """Whether to build the TE layer spec: 'auto' picks TE only on a GPU with TE importable."""
    if transformer_impl not in ("auto", "local", "transformer_engine"):
        raise ValueError(f"model.transformer_impl must be auto/local/transformer_engine, got {transformer_impl!r}")
    if transformer_impl == "local":
        return False
    have_gpu = torch.cuda.is_available()
    try:
        import transformer_engine  # noqa: F401

        have_te = True
    except Exception:
        have_te = False
    if transformer_impl == "transformer_engine" and not (have_gpu and have_te):
        raise ValueError("model.transformer_impl='transformer_engine' needs a GPU and transformer_engine installed")
    return have_gpu and have_te


def build_transformer_config(
    arch: Qwen2Arch,
    dtype: str,
    tp_size: int,
    pp_size: int,
    sequence_parallel: bool = False,
) -> Any:
    """Megatron TransformerConfig equivalent to the HF Qwen2 architecture.

    Dropout is off (RL needs identical logprobs across recomputations). ``calculate_per_token_loss``
    is on: the trainer's loss is already normalised by the full batch, so Megatron must neither
    divide by the number of microbatches nor average over DP (see megatron_worker.train_step).
    """
    from megatron.core.transformer import TransformerConfig

    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    on_cpu = not torch.cuda.is_available()
    if on_cpu and sequence_parallel:
        raise ValueError("parallel.sequence_parallel needs GPUs (torch norms reject it on CPU)")
    torch_dtype = _DTYPES[dtype]
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=sequence_parallel,
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        # Shapes differ per microbatch (dynamic batch size), so PP must exchange them.
        variable_seq_lengths=True,
        # Dense model: no MoE, but Megatron rejects variable_seq_lengths with the default
        # 'allgather' MoE dispatcher even so.
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt_model(
    arch: Qwen2Arch,
    config: Any,
    tp_size: int,
    pre_process: bool,
    post_process: bool,
    transformer_impl: str = "auto",
) -> Any:
    """A Megatron GPTModel for this stage (``pre_process``: holds the embedding, ``post_process``:
    holds the final norm and output layer). Returns logits (not loss) so callers can mask the
    vocabulary padding before the vocab-parallel cross entropy."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    check_parallel_fits(arch, tp_size, config.pipeline_model_parallel_size)
    if use_transformer_engine(transformer_impl):
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, tp_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )
