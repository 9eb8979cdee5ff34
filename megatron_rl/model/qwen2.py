"""Qwen2 / Qwen2.5 on Megatron-Core: HF config.json -> TransformerConfig, layer spec, GPTModel.

Used for the trainable policy and the frozen reference model alike. The Transformer Engine
layer spec is chosen at run time (GPU present, TE importable, ``model.transformer_impl``
allowing it); otherwise Megatron's local spec, which is what runs on CPU.
"""
from __future__ import annotations

from typing import Any

import torch

# The shape parser is torch-free (arch.py); re-exported here for the Megatron-side callers.
from megatron_rl.model.arch import Qwen2Arch, padded_vocab_size, read_qwen2_arch  # noqa: F401

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# parallel.recompute_granularity -> TransformerConfig fields. Both recomputations only run in
# training mode (model.train()); logprob passes are forward-only and store nothing anyway.
_RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    # Checkpoint the core attention (softmax(QK^T)V) only; its inputs q/k/v are kept.
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    # Checkpoint every decoder layer on its own: only the layer inputs stay stored, and the
    # backward recomputes one layer at a time (the least memory for one extra forward).
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


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
    recompute_granularity: str = "none",
) -> Any:
    """Megatron TransformerConfig equivalent to the HF Qwen2 architecture.

    Dropout is off (RL needs identical logprobs across recomputations). ``calculate_per_token_loss``
    is on: the trainer's loss is already normalised by the full batch, so Megatron must neither
    divide by the number of microbatches nor average over DP (see megatron_worker.train_step).
    ``recompute_granularity`` is ``parallel.recompute_granularity`` (see :data:`_RECOMPUTE`).
    """
    from megatron.core.transformer import TransformerConfig

    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    on_cpu = not torch.cuda.is_available()
    if recompute_granularity not in _RECOMPUTE:
        raise ValueError(f"parallel.recompute_granularity must be one of {sorted(_RECOMPUTE)}, "
                         f"got {recompute_granularity!r}")
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
        **_RECOMPUTE[recompute_granularity],
    )


def build_gpt_model(
    arch: Qwen2Arch,
    config: Any,
    tp_size: int,
    pre_process: bool,
    post_process: bool,
    transformer_impl: str = "auto",
    local_attention: str = "sdpa",
) -> Any:
    """A Megatron GPTModel for this stage (``pre_process``: holds the embedding, ``post_process``:
    holds the final norm and output layer). Returns logits (not loss) so callers can mask the
    vocabulary padding before the vocab-parallel cross entropy. ``local_attention``: the local
    spec's core attention ('sdpa' or 'unfused', see ``ModelConfig.local_attention``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    check_parallel_fits(arch, tp_size, config.pipeline_model_parallel_size)
    spec: Any
    if use_transformer_engine(transformer_impl):
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        if local_attention == "sdpa":
            from megatron_rl.model.sdpa_attention import SDPADotProductAttention

            spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
        if config.sequence_parallel:
            spec = _local_spec_with_sequence_parallel_norms(spec, config)
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


def _local_spec_with_sequence_parallel_norms(layer_spec: Any, config: Any) -> Any:
    """The local spec's block with every norm (both per layer, and the final one) swapped for
    the CPU shim's SP-tagged RMSNorm: Megatron's torch norm asserts ``not sequence_parallel``
    (megatron/core/transformer/torch_norm.py). The final norm comes from the block's
    submodules, so the block is spelled out the way ``_get_block_submodules``
    (megatron/core/transformer/transformer_block.py) would build it for this PP stage.
    """
    from megatron_rl.distributed import cpu_shim

    if not cpu_shim.shim_needed():
        raise ValueError("parallel.sequence_parallel with the local layer spec on GPUs: Megatron's torch norm rejects "
                         "it; use model.transformer_impl 'auto' or 'transformer_engine' with Transformer Engine installed")
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    SequenceParallelTorchNorm = cpu_shim.SequenceParallelTorchNorm
    layer_spec.submodules.input_layernorm = SequenceParallelTorchNorm
    layer_spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)
