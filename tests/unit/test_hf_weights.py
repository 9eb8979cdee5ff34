"""HF Qwen2 <-> Megatron shard conversion: bit-exact round trips and the fused layouts."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.model.hf_weights import (
    from_te_names,
    hf_to_megatron_shard,
    megatron_shards_to_hf,
    to_te_names,
)
from megatron_rl.model.qwen2 import Qwen2Arch, padded_vocab_size


def _arch(tied: bool) -> Qwen2Arch:
    return Qwen2Arch(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
        num_kv_heads=2, max_position_embeddings=128, rope_theta=1e4, rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )


def _random_hf(arch: Qwen2Arch) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d, f = arch.hidden_size, arch.head_dim, arch.intermediate_size
    sd = {"model.embed_tokens.weight": torch.randn(arch.vocab_size, h, generator=g),
          "model.norm.weight": torch.randn(h, generator=g)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (arch.num_heads * d, h), "self_attn.q_proj.bias": (arch.num_heads * d,),
            "self_attn.k_proj.weight": (arch.num_kv_heads * d, h), "self_attn.k_proj.bias": (arch.num_kv_heads * d,),
            "self_attn.v_proj.weight": (arch.num_kv_heads * d, h), "self_attn.v_proj.bias": (arch.num_kv_heads * d,),
            "self_attn.o_proj.weight": (h, arch.num_heads * d), "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        }
        for name, shape in shapes.items():
            sd[p + name] = torch.randn(*shape, generator=g)
    if not arch.tie_word_embeddings:
        sd["lm_head.weight"] = torch.randn(arch.vocab_size, h, generator=g)
    return sd


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_exact(tied: bool, tp: int, pp: int) -> None:
    arch = _arch(tied)
    hf = _random_hf(arch)
    shards = {(t, p): hf_to_megatron_shard(hf, arch, t, tp, p, pp) for t in range(tp) for p in range(pp)}
    back = megatron_shards_to_hf(shards, arch, tp, pp)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    if tied:
        with_head = megatron_shards_to_hf(shards, arch, tp, pp, include_tied_lm_head=True)
        assert torch.equal(with_head["lm_head.weight"], hf["model.embed_tokens.weight"])


@pytest.mark.parametrize("tied", [True, False])
def test_shard_placement_per_stage(tied: bool) -> None:
    arch = _arch(tied)
    hf = _random_hf(arch)
    first = hf_to_megatron_shard(hf, arch, 0, 2, 0, 2)
    last = hf_to_megatron_shard(hf, arch, 1, 2, 1, 2)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" not in last
    # Tied with PP > 1: the last stage keeps its own copy of the embedding as output layer.
    assert "output_layer.weight" in last
    # Stage 1 holds global layers 2, 3 renumbered to 0, 1.
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"], hf["model.layers.2.input_layernorm.weight"])
    assert "decoder.layers.2.input_layernorm.weight" not in last
    single = hf_to_megatron_shard(hf, arch, 0, 1, 0, 1)
    assert ("output_layer.weight" in single) == (not tied)


def test_fused_qkv_fc1_and_vocab_layout() -> None:
    arch = _arch(True)
    hf = _random_hf(arch)
    d = arch.head_dim
    shard1 = hf_to_megatron_shard(hf, arch, 1, 2, 0, 1)
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    v = hf["model.layers.0.self_attn.v_proj.weight"]
    # TP rank 1 holds query group 1: q heads 2 and 3, then k head 1, then v head 1.
    expected = torch.cat([q[2 * d: 4 * d], k[d: 2 * d], v[d: 2 * d]])
    assert torch.equal(shard1["decoder.layers.0.self_attention.linear_qkv.weight"], expected)
    qb = hf["model.layers.0.self_attn.q_proj.bias"]
    assert torch.equal(shard1["decoder.layers.0.self_attention.linear_qkv.bias"][: 2 * d], qb[2 * d:])
    f = arch.intermediate_size
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(shard1["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[f // 2:], up[f // 2:]]))
    # Vocab 300 padded to 512 for TP=2: rank 1 holds rows 256..511, of which 256..299 are real.
    emb = shard1["embedding.word_embeddings.weight"]
    assert padded_vocab_size(300, 2) == 512 and emb.shape == (256, 64)
    assert torch.equal(emb[:44], hf["model.embed_tokens.weight"][256:]) and not emb[44:].any()
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(shard1["decoder.layers.0.self_attention.linear_proj.weight"], o[:, 32:])


def test_te_names_round_trip() -> None:
    local = {"decoder.layers.0.input_layernorm.weight": torch.ones(2),
             "decoder.layers.0.pre_mlp_layernorm.weight": torch.zeros(2),
             "decoder.final_layernorm.weight": torch.ones(2)}
    te = to_te_names(local)
    assert set(te) == {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                       "decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.final_layernorm.weight"}
    assert from_te_names(te).keys() == local.keys()


def test_missing_key_names_the_key() -> None:
    arch = _arch(False)
    hf = _random_hf(arch)
    del hf["lm_head.weight"]
    with pytest.raises(KeyError, match="lm_head.weight"):
        hf_to_megatron_shard(hf, arch, 0, 1, 0, 1)
