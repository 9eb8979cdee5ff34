"""Where every byte of a Qwen2 model lives in a sharded layout, in terms of the HF tensors.

A layout answers one question per shard: which local tensors does it hold, and which ranges of
which Hugging Face ("logical") tensors make up each of them. Everything is described along one
split dimension per tensor:

* a :class:`Segment` says "local rows ``[local_start, local_start + length)`` along ``dim`` are
  logical rows ``[logical_start, ...)`` of HF tensor ``logical``";
* rows covered by no segment are padding (vocabulary padding) and stay zero.

Two layouts are described here, both derived from the frameworks' own sharding rules:

* :class:`MegatronLayout` (TP_t, PP_t, DP): group-major fused QKV ``[q_g; k_g; v_g]`` per query
  group, fc1 ``[gate_shard; up_shard]``, vocabulary padded to 128 x TP, tied embeddings copied
  to the last PP stage as ``output_layer.weight``; local layer numbering per stage. This is the
  same mapping as ``megatron_rl.model.hf_weights`` (local layer spec names).
* :class:`VLLMLayout` (TP_r, replicas): vLLM's Qwen2 parameters. ``QKVParallelLinear`` holds
  ``[q_shard; k_shard; v_shard]`` per rank, with KV heads replicated when TP_r exceeds the KV
  head count (rank r holds KV head block ``r // (TP_r / kv_heads)``); ``MergedColumnParallelLinear``
  holds ``[gate_shard; up_shard]``; ``VocabParallelEmbedding`` pads the vocabulary to a multiple
  of 64 and gives each rank ``padded / TP_r`` rows (zero-filled past the real vocabulary).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.model.qwen2 import Qwen2Arch, padded_vocab_size

# vLLM's DEFAULT_VOCAB_PADDING_SIZE (vllm/model_executor/layers/vocab_parallel_embedding.py).
VLLM_VOCAB_PADDING = 64

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Segment:
    """Local rows ``[local_start, local_start + length)`` = logical rows ``[logical_start, ...)``."""

    logical: str
    """HF tensor name (global layer numbering)."""
    logical_start: int
    """First row (along the split dim) in the HF tensor."""
    local_start: int
    """First row (along the split dim) in the local tensor."""
    length: int
    """Number of rows."""


@dataclass(frozen=True)
class TensorSpec:
    """One local tensor of a shard: its shape, split dim and the HF ranges it is made of."""

    name: str
    """Local parameter name in the framework's naming."""
    shape: tuple[int, ...]
    """Local shape."""
    dim: int
    """Dimension the segments run along (0 for rows, 1 for RowParallel columns)."""
    segments: tuple[Segment, ...]
    """HF ranges this tensor is made of; rows outside them are zero padding."""

    @property
    def row_numel(self) -> int:
        """Elements in one slice along ``dim`` (the unit a segment length counts)."""
        return math.prod(s for i, s in enumerate(self.shape) if i != self.dim)


def logical_shapes(arch: Qwen2Arch) -> dict[str, tuple[int, ...]]:
    """The HF tensors of a Qwen2 model (``lm_head`` only when untied) and their shapes."""
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {EMBED: (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        out[LM_HEAD] = (arch.vocab_size, h)
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        out.update({
            f"{p}self_attn.q_proj.weight": (q, h), f"{p}self_attn.q_proj.bias": (q,),
            f"{p}self_attn.k_proj.weight": (kv, h), f"{p}self_attn.k_proj.bias": (kv,),
            f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.v_proj.bias": (kv,),
            f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h),
            f"{p}mlp.down_proj.weight": (h, i),
            f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
        })
    return out


def _whole(name: str, logical: str, shape: tuple[int, ...]) -> TensorSpec:
    """A replicated tensor: the full HF tensor."""
    return TensorSpec(name, shape, 0, (Segment(logical, 0, 0, shape[0]),))


def _vocab(name: str, logical: str, arch: Qwen2Arch, padded: int, tp: int, rank: int) -> TensorSpec:
    """Rows ``[rank * padded/tp, ...)`` of the padded vocabulary; rows >= vocab_size are padding."""
    per_rank = padded // tp
    start = rank * per_rank
    real = max(0, min(arch.vocab_size, start + per_rank) - start)
    segments = (Segment(logical, start, 0, real),) if real else ()
    return TensorSpec(name, (per_rank, arch.hidden_size), 0, segments)


def _column(name: str, parts: list[tuple[str, int, int]], cols: int) -> TensorSpec:
    """A ColumnParallel tensor made of consecutive (logical, logical_start, length) row blocks."""
    segments, at = [], 0
    for logical, start, length in parts:
        segments.append(Segment(logical, start, at, length))
        at += length
    shape = (at, cols) if cols else (at,)
    return TensorSpec(name, shape, 0, tuple(segments))


def _row(name: str, logical: str, rows: int, total_cols: int, tp: int, rank: int) -> TensorSpec:
    """A RowParallel weight: columns ``[rank * cols/tp, ...)``."""
    per_rank = total_cols // tp
    return TensorSpec(name, (rows, per_rank), 1, (Segment(logical, rank * per_rank, 0, per_rank),))


class MegatronLayout:
    """Megatron-Core trainer layout (TP_t, PP_t, DP) with Megatron's default rank order
    ``tp-cp-ep-dp-pp``: rank = tp + TP * (dp + DP * pp) (CP = EP = 1)."""

    kind = "megatron"

    def __init__(self, arch: Qwen2Arch, tp: int, pp: int, dp: int = 1) -> None:
        if arch.num_heads % tp or arch.num_kv_heads % tp:
            raise ValueError(f"Megatron TP {tp} must divide num_attention_heads={arch.num_heads} and "
                             f"num_key_value_heads={arch.num_kv_heads}")
        if arch.num_layers % pp:
            raise ValueError(f"Megatron PP {pp} must divide num_hidden_layers={arch.num_layers}")
        if arch.intermediate_size % tp or arch.hidden_size % tp:
            raise ValueError(f"Megatron TP {tp} must divide hidden_size and intermediate_size")
        self.arch, self.tp, self.pp, self.dp = arch, tp, pp, dp

    @property
    def num_shards(self) -> int:
        """Ranks of the trainer layout (TP x PP x DP)."""
        return self.tp * self.pp * self.dp

    def coords(self, shard: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a trainer rank."""
        tp_rank = shard % self.tp
        dp_rank = (shard // self.tp) % self.dp
        return tp_rank, shard // (self.tp * self.dp), dp_rank

    def tensors(self, shard: int) -> list[TensorSpec]:
        """The local tensors (Megatron local-spec names) of a trainer rank."""
        a, (r, p, _) = self.arch, self.coords(shard)
        tp, h, d = self.tp, a.hidden_size, a.head_dim
        padded = padded_vocab_size(a.vocab_size, tp)
        out: list[TensorSpec] = []
        if p == 0:
            out.append(_vocab("embedding.word_embeddings.weight", EMBED, a, padded, tp, r))
        per_stage = a.num_layers // self.pp
        groups, hpg = a.num_kv_heads // tp, a.num_heads // a.num_kv_heads
        ffn = a.intermediate_size // tp
        for local in range(per_stage):
            g_layer = p * per_stage + local
            src, dst = f"model.layers.{g_layer}.", f"decoder.layers.{local}."
            attn = src + "self_attn."
            for kind in ("weight", "bias"):
                parts = []
                for g in range(r * groups, (r + 1) * groups):
                    parts += [(f"{attn}q_proj.{kind}", g * hpg * d, hpg * d),
                              (f"{attn}k_proj.{kind}", g * d, d), (f"{attn}v_proj.{kind}", g * d, d)]
                out.append(_column(f"{dst}self_attention.linear_qkv.{kind}", parts, h if kind == "weight" else 0))
            out.append(_row(f"{dst}self_attention.linear_proj.weight", f"{attn}o_proj.weight", h,
                            a.num_heads * d, tp, r))
            out.append(_column(f"{dst}mlp.linear_fc1.weight", [(f"{src}mlp.gate_proj.weight", r * ffn, ffn),
                                                               (f"{src}mlp.up_proj.weight", r * ffn, ffn)], h))
            out.append(_row(f"{dst}mlp.linear_fc2.weight", f"{src}mlp.down_proj.weight", h,
                            a.intermediate_size, tp, r))
            out.append(_whole(f"{dst}input_layernorm.weight", f"{src}input_layernorm.weight", (h,)))
            out.append(_whole(f"{dst}pre_mlp_layernorm.weight", f"{src}post_attention_layernorm.weight", (h,)))
        if p == self.pp - 1:
            out.append(_whole("decoder.final_layernorm.weight", "model.norm.weight", (h,)))
            if not a.tie_word_embeddings:
                out.append(_vocab("output_layer.weight", LM_HEAD, a, padded, tp, r))
            elif self.pp > 1:  # Megatron's synced copy of the tied embedding on the last stage
                out.append(_vocab("output_layer.weight", EMBED, a, padded, tp, r))
        return out

    def __repr__(self) -> str:
        return f"MegatronLayout(tp={self.tp}, pp={self.pp}, dp={self.dp})"


class VLLMLayout:
    """vLLM Qwen2 rollout layout: ``replicas`` engines of TP_r ranks each (shard = engine * TP_r +
    tp_rank). ``include_tied_lm_head`` adds ``lm_head.weight`` for tied models (vLLM's CPU
    backend keeps a separate repacked head; on GPU it is the embedding itself)."""

    kind = "vllm"

    def __init__(self, arch: Qwen2Arch, tp: int, replicas: int = 1, include_tied_lm_head: bool = False) -> None:
        if arch.num_heads % tp:
            raise ValueError(f"vLLM TP {tp} must divide num_attention_heads={arch.num_heads}")
        kv = arch.num_kv_heads
        if (tp >= kv and tp % kv) or (tp < kv and kv % tp):
            raise ValueError(f"vLLM TP {tp} and num_key_value_heads={kv}: one must divide the other")
        if arch.intermediate_size % tp or arch.hidden_size % tp:
            raise ValueError(f"vLLM TP {tp} must divide hidden_size and intermediate_size")
        padded = padded_vocab_size(arch.vocab_size, 1, VLLM_VOCAB_PADDING)
        if padded % tp:
            raise ValueError(f"vLLM TP {tp} must divide the padded vocabulary {padded}")
        self.arch, self.tp, self.replicas = arch, tp, replicas
        self.include_tied_lm_head = include_tied_lm_head
        self.padded_vocab = padded

    @property
    def num_shards(self) -> int:
        """Ranks of all engines together (TP_r x replicas)."""
        return self.tp * self.replicas

    def tensors(self, shard: int) -> list[TensorSpec]:
        """The local tensors (vLLM parameter names) of one engine rank."""
        a, r, tp = self.arch, shard % self.tp, self.tp
        h, d = a.hidden_size, a.head_dim
        q_per_rank = a.num_heads // tp * d
        # QKVParallelLinear: with tp >= kv heads every rank keeps one KV head, shared by
        # tp / kv consecutive ranks (shard_rank = tp_rank // num_kv_head_replicas).
        kv_heads = max(1, a.num_kv_heads // tp)
        kv_block = r // max(1, tp // a.num_kv_heads)
        ffn = a.intermediate_size // tp
        out = [_vocab(EMBED, EMBED, a, self.padded_vocab, tp, r)]
        for layer in range(a.num_layers):
            p = f"model.layers.{layer}."
            attn = p + "self_attn."
            for kind in ("weight", "bias"):
                out.append(_column(f"{attn}qkv_proj.{kind}", [
                    (f"{attn}q_proj.{kind}", r * q_per_rank, q_per_rank),
                    (f"{attn}k_proj.{kind}", kv_block * kv_heads * d, kv_heads * d),
                    (f"{attn}v_proj.{kind}", kv_block * kv_heads * d, kv_heads * d),
                ], h if kind == "weight" else 0))
            out.append(_row(f"{attn}o_proj.weight", f"{attn}o_proj.weight", h, a.num_heads * d, tp, r))
            out.append(_column(f"{p}mlp.gate_up_proj.weight", [(f"{p}mlp.gate_proj.weight", r * ffn, ffn),
                                                               (f"{p}mlp.up_proj.weight", r * ffn, ffn)], h))
            out.append(_row(f"{p}mlp.down_proj.weight", f"{p}mlp.down_proj.weight", h, a.intermediate_size, tp, r))
            out.append(_whole(f"{p}input_layernorm.weight", f"{p}input_layernorm.weight", (h,)))
            out.append(_whole(f"{p}post_attention_layernorm.weight", f"{p}post_attention_layernorm.weight", (h,)))
        out.append(_whole("model.norm.weight", "model.norm.weight", (h,)))
        if not a.tie_word_embeddings:
            out.append(_vocab(LM_HEAD, LM_HEAD, a, self.padded_vocab, tp, r))
        elif self.include_tied_lm_head:
            out.append(_vocab(LM_HEAD, EMBED, a, self.padded_vocab, tp, r))
        return out

    def __repr__(self) -> str:
        return f"VLLMLayout(tp={self.tp}, replicas={self.replicas})"
