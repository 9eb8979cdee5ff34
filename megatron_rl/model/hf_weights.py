"""Hugging Face Qwen2 <-> Megatron-Core (TP, PP) state dicts: pure tensor functions.

No torch.distributed here; the trainer gathers shards and calls these. Megatron layout facts:

* QKV is one fused ColumnParallel weight, group-major: for each query group g the rows are
  [q heads of g; k_g; v_g]. TP rank r holds groups [r*G/tp, (r+1)*G/tp) contiguously, so the
  fused tensor is simply chunked along dim 0. Same for the QKV bias.
* fc1 fuses [gate; up]; under TP each rank holds [gate_shard_r; up_shard_r].
* linear_proj and fc2 are RowParallel (split along dim 1); norms are replicated.
* The vocabulary is padded with zero rows to a multiple of 128 x TP (Megatron's convention);
  the trainer masks the padded logits, and the inverse strips the padding.
* Tied embeddings: no output_layer on a single stage; with PP > 1 the last stage holds its own
  copy (``output_layer.weight``) that Megatron keeps in sync with the first stage's embedding.
  Untied: ``output_layer.weight`` lives on the last stage only.
* Layers are numbered locally per PP stage (stage p holds global layers p*L/pp ...).

Names here are those of Megatron's local layer spec; :func:`to_te_names` maps them to the
Transformer Engine spec, where the norms are fused into the following linear layer.
"""
from __future__ import annotations

import torch

from megatron_rl.model.qwen2 import Qwen2Arch, padded_vocab_size

Tensor = torch.Tensor
StateDict = dict[str, Tensor]

# Local spec suffix -> TE spec suffix (norm fused into the next linear).
_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _stage_layers(arch: Qwen2Arch, pp_rank: int, pp_size: int) -> range:
    per_stage = arch.num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def _require(hf: StateDict, name: str) -> Tensor:
    if name not in hf:
        raise KeyError(f"HF state dict has no {name!r} (is this a Qwen2 checkpoint?)")
    return hf[name]


def _pad_vocab(weight: Tensor, padded: int) -> Tensor:
    if weight.shape[0] == padded:
        return weight
    pad = torch.zeros(padded - weight.shape[0], *weight.shape[1:], dtype=weight.dtype)
    return torch.cat([weight, pad], dim=0)


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: Qwen2Arch) -> Tensor:
    """[q; k; v] (HF, head-major) -> Megatron group-major [q_g; k_g; v_g] for every group g."""
    groups = arch.num_kv_heads
    heads_per_group = arch.num_heads // groups
    d = arch.head_dim
    tail = q.shape[1:]
    q = q.reshape(groups, heads_per_group * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _split_qkv(fused: Tensor, arch: Qwen2Arch) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`_fuse_qkv`."""
    groups = arch.num_kv_heads
    heads_per_group = arch.num_heads // groups
    d = arch.head_dim
    tail = fused.shape[1:]
    grouped = fused.reshape(groups, (heads_per_group + 2) * d, *tail)
    q, k, v = torch.split(grouped, [heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron_shard(
    hf: StateDict, arch: Qwen2Arch, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
) -> StateDict:
    """The Megatron (local spec) state dict of shard (tp_rank, pp_rank) from a full HF state dict."""
    out: StateDict = {}
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    padded = padded_vocab_size(arch.vocab_size, tp_size)

    def vocab_shard(weight: Tensor) -> Tensor:
        return torch.chunk(_pad_vocab(weight, padded), tp_size, dim=0)[tp_rank].clone()

    def rows(t: Tensor) -> Tensor:
        return torch.chunk(t, tp_size, dim=0)[tp_rank].clone()

    def cols(t: Tensor) -> Tensor:
        return torch.chunk(t, tp_size, dim=1)[tp_rank].clone()

    if first:
        out["embedding.word_embeddings.weight"] = vocab_shard(_require(hf, "model.embed_tokens.weight"))
    for local, layer in enumerate(_stage_layers(arch, pp_rank, pp_size)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        attn = src + "self_attn."
        for kind in ("weight", "bias"):
            fused = _fuse_qkv(
                _require(hf, f"{attn}q_proj.{kind}"),
                _require(hf, f"{attn}k_proj.{kind}"),
                _require(hf, f"{attn}v_proj.{kind}"),
                arch,
            )
            out[f"{dst}self_attention.linear_qkv.{kind}"] = rows(fused)
        out[f"{dst}self_attention.linear_proj.weight"] = cols(_require(hf, f"{attn}o_proj.weight"))
        gate = rows(_require(hf, f"{src}mlp.gate_proj.weight"))
        up = rows(_require(hf, f"{src}mlp.up_proj.weight"))
        out[f"{dst}mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[f"{dst}mlp.linear_fc2.weight"] = cols(_require(hf, f"{src}mlp.down_proj.weight"))
        out[f"{dst}input_layernorm.weight"] = _require(hf, f"{src}input_layernorm.weight").clone()
        out[f"{dst}pre_mlp_layernorm.weight"] = _require(hf, f"{src}post_attention_layernorm.weight").clone()
    if last:
        out["decoder.final_layernorm.weight"] = _require(hf, "model.norm.weight").clone()
        if not arch.tie_word_embeddings:
            out["output_layer.weight"] = vocab_shard(_require(hf, "lm_head.weight"))
        elif pp_size > 1:
            out["output_layer.weight"] = vocab_shard(_require(hf, "model.embed_tokens.weight"))
    return out


def megatron_stage_to_hf(
    tp_shards: list[StateDict], arch: Qwen2Arch, pp_rank: int, pp_size: int
) -> StateDict:
    """HF-named tensors held by one PP stage, from that stage's TP shards (in TP-rank order).

    Replicated tensors (norms) are taken from TP rank 0. The tied last-stage copy of the
    embedding is not emitted (the first stage's embedding is the source of truth).
    """
    out: StateDict = {}
    first, last = pp_rank == 0, pp_rank == pp_size - 1

    def cat(name: str, dim: int) -> Tensor:
        try:
            return torch.cat([shard[name] for shard in tp_shards], dim=dim)
        except KeyError:
            raise KeyError(f"Megatron shard of PP stage {pp_rank} has no {name!r}") from None

    def fc1_halves(name: str) -> tuple[Tensor, Tensor]:
        halves = [torch.chunk(shard[name], 2, dim=0) for shard in tp_shards]
        return torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)

    if first:
        out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[: arch.vocab_size].clone()
    for local, layer in enumerate(_stage_layers(arch, pp_rank, pp_size)):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{layer}."
        for kind in ("weight", "bias"):
            q, k, v = _split_qkv(cat(f"{src}self_attention.linear_qkv.{kind}", 0), arch)
            out[f"{dst}self_attn.q_proj.{kind}"] = q.clone()
            out[f"{dst}self_attn.k_proj.{kind}"] = k.clone()
            out[f"{dst}self_attn.v_proj.{kind}"] = v.clone()
        out[f"{dst}self_attn.o_proj.weight"] = cat(f"{src}self_attention.linear_proj.weight", 1)
        gate, up = fc1_halves(f"{src}mlp.linear_fc1.weight")
        out[f"{dst}mlp.gate_proj.weight"] = gate
        out[f"{dst}mlp.up_proj.weight"] = up
        out[f"{dst}mlp.down_proj.weight"] = cat(f"{src}mlp.linear_fc2.weight", 1)
        out[f"{dst}input_layernorm.weight"] = tp_shards[0][f"{src}input_layernorm.weight"].clone()
        out[f"{dst}post_attention_layernorm.weight"] = tp_shards[0][f"{src}pre_mlp_layernorm.weight"].clone()
    if last:
        out["model.norm.weight"] = tp_shards[0]["decoder.final_layernorm.weight"].clone()
        if not arch.tie_word_embeddings:
            out["lm_head.weight"] = cat("output_layer.weight", 0)[: arch.vocab_size].clone()
    return out


def megatron_shards_to_hf(
    shards: dict[tuple[int, int], StateDict],
    arch: Qwen2Arch,
    tp_size: int,
    pp_size: int,
    include_tied_lm_head: bool = False,
) -> StateDict:
    """Full HF state dict from every shard, keyed ``(tp_rank, pp_rank)``.

    With ``include_tied_lm_head`` a tied model also gets ``lm_head.weight`` (a copy of the
    embedding): vLLM's CPU weight reload needs it explicitly.
    """
    out: StateDict = {}
    for pp_rank in range(pp_size):
        tp_shards = [shards[(tp_rank, pp_rank)] for tp_rank in range(tp_size)]
        out.update(megatron_stage_to_hf(tp_shards, arch, pp_rank, pp_size))
    if include_tied_lm_head and arch.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def to_te_names(state: StateDict) -> StateDict:
    """Rename local-spec keys to the Transformer Engine spec (norm weights fused into linears)."""
    out: StateDict = {}
    for name, tensor in state.items():
        for local, te in _LOCAL_TO_TE.items():
            if name.endswith(local):
                name = name[: -len(local)] + te
                break
        out[name] = tensor
    return out


def from_te_names(state: StateDict) -> StateDict:
    """Inverse of :func:`to_te_names` (keys already in local naming pass through)."""
    out: StateDict = {}
    for name, tensor in state.items():
        for local, te in _LOCAL_TO_TE.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
                break
        out[name] = tensor
    return out
