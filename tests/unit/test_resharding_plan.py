"""Resharding plans executed in one process, checked against an independent cut of the HF
tensors by vLLM's sharding rules; plan invariants (bytes moved once, bucket bound, rounds)."""
import itertools

import pytest
import torch

from megatron_rl.model.hf_weights import hf_to_megatron_shard
from megatron_rl.model.qwen2 import Qwen2Arch
from megatron_rl.resharding.execute import allocate_destinations, execute_plan
from megatron_rl.resharding.layouts import MegatronLayout, VLLMLayout, logical_shapes
from megatron_rl.resharding.plan import build_plan


def make_arch(kv: int, tied: bool, vocab: int = 320) -> Qwen2Arch:
    return Qwen2Arch(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                     num_kv_heads=kv, max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-6,
                     tie_word_embeddings=tied)


def random_hf(arch: Qwen2Arch) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in logical_shapes(arch).items()}


def vllm_cut(hf: dict, arch: Qwen2Arch, tp: int, r: int) -> dict[str, torch.Tensor]:
    """vLLM's per-rank tensors written out directly from its weight-loader formulas."""
    d, kv = arch.head_dim, arch.num_kv_heads
    padded = -(-arch.vocab_size // 64) * 64
    replicas = max(1, tp // kv)
    kv_rows = max(1, kv // tp) * d

    def vocab(w):
        full = torch.zeros(padded, w.shape[1])
        full[: w.shape[0]] = w
        return full.chunk(tp)[r]

    out = {"model.embed_tokens.weight": vocab(hf["model.embed_tokens.weight"]), "model.norm.weight": hf["model.norm.weight"]}
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = vocab(hf["lm_head.weight"])
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            q = hf[f"{p}self_attn.q_proj.{kind}"].chunk(tp)[r]
            k = hf[f"{p}self_attn.k_proj.{kind}"][(r // replicas) * kv_rows:(r // replicas + 1) * kv_rows]
            v = hf[f"{p}self_attn.v_proj.{kind}"][(r // replicas) * kv_rows:(r // replicas + 1) * kv_rows]
            out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([q, k, v])
        out[f"{p}self_attn.o_proj.weight"] = hf[f"{p}self_attn.o_proj.weight"].chunk(tp, dim=1)[r]
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([hf[f"{p}mlp.gate_proj.weight"].chunk(tp)[r],
                                                        hf[f"{p}mlp.up_proj.weight"].chunk(tp)[r]])
        out[f"{p}mlp.down_proj.weight"] = hf[f"{p}mlp.down_proj.weight"].chunk(tp, dim=1)[r]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{norm}.weight"] = hf[f"{p}{norm}.weight"]
    return out


def megatron_sources(hf, arch, layout):
    return {s: hf_to_megatron_shard(hf, arch, layout.coords(s)[0], layout.tp, layout.coords(s)[1], layout.pp)
            for s in range(layout.num_shards)}


@pytest.mark.parametrize("kv, tied", [(4, True), (8, False)])
@pytest.mark.parametrize("tp_t, pp_t", list(itertools.product((1, 2, 4), (1, 2))))
def test_every_rollout_tp_matches_direct_cut(kv, tied, tp_t, pp_t):
    arch = make_arch(kv, tied)
    hf = random_hf(arch)
    src = MegatronLayout(arch, tp_t, pp_t, dp=1)
    sources = megatron_sources(hf, arch, src)
    for tp_r in (1, 2, 4, 8):
        dst = VLLMLayout(arch, tp_r)
        plan = build_plan(src, dst, [0] * src.num_shards, [0] * dst.num_shards, bucket_bytes=1 << 16)
        dests = allocate_destinations(plan, 0, torch.float32)
        stats = execute_plan(plan, sources, dests, transport=None, proc=0)
        assert stats.bytes_local == plan.dst_numel * 4 and plan.sent_numel == 0
        for r in range(tp_r):
            expected = vllm_cut(hf, arch, tp_r, r)
            assert dests[r].keys() == expected.keys()
            for name, tensor in expected.items():
                assert torch.equal(dests[r][name], tensor), (tp_t, pp_t, tp_r, r, name)


def test_disjoint_plan_sends_every_byte_once_in_bounded_rounds():
    arch = make_arch(4, True)
    src = MegatronLayout(arch, 2, 2, dp=2)  # 8 trainer ranks: procs 0..7
    dst = VLLMLayout(arch, 4, replicas=2)  # 8 engine ranks: procs 8..15
    bucket = 12 << 10
    plan = build_plan(src, dst, list(range(8)), list(range(8, 16)), bucket_bytes=bucket)
    assert plan.local_numel == 0 and plan.sent_numel == plan.dst_numel
    for round_ in plan.rounds:
        senders = [b.src_proc for b in round_]
        receivers = [b.dst_proc for b in round_]
        assert len(senders) == len(set(senders)) and len(receivers) == len(set(receivers))
        assert all(0 < b.numel * 4 <= bucket for b in round_)
    # The two DP replicas share the sending work instead of replica 0 sending everything.
    sent_by = {p: sum(b.numel for r in plan.rounds for b in r if b.src_proc == p) for p in range(8)}
    assert all(v > 0 for v in sent_by.values())
    dp0 = sum(v for p, v in sent_by.items() if src.coords(p)[2] == 0)
    assert 0.4 < dp0 / plan.sent_numel < 0.6
    # Destination bytes covered exactly once: transfers tile each destination segment.
    covered = {}
    for t in [t for r in plan.rounds for b in r for t in b.transfers]:
        key = (t.dst_shard, t.dst_tensor)
        covered[key] = covered.get(key, 0) + t.numel
    for shard, specs in plan.dst_specs.items():
        for spec in specs:
            want = sum(s.length for s in spec.segments) * spec.row_numel
            assert covered.get((shard, spec.name), 0) == want, spec.name


def test_padding_rows_stay_zero_and_tied_head_is_optional():
    arch = make_arch(4, True, vocab=300)  # vLLM pads 300 -> 320; Megatron TP4 pads to 512
    hf = random_hf(arch)
    src = MegatronLayout(arch, 4, 2)
    dst = VLLMLayout(arch, 2, include_tied_lm_head=True)
    plan = build_plan(src, dst, [0] * 8, [0, 0])
    dests = allocate_destinations(plan, 0, torch.float32)
    execute_plan(plan, megatron_sources(hf, arch, src), dests, None, proc=0)
    emb, head = dests[1]["model.embed_tokens.weight"], dests[1]["lm_head.weight"]
    assert emb.shape == (160, 64) and torch.equal(emb[140:], torch.zeros(20, 64))
    assert torch.equal(emb[:140], hf["model.embed_tokens.weight"][160:])
    assert torch.equal(head, emb)


def test_clear_errors():
    arch = make_arch(4, True)
    with pytest.raises(ValueError, match="smaller than one slice"):
        build_plan(MegatronLayout(arch, 1, 1), VLLMLayout(arch, 1), [0], [1], bucket_bytes=128)
    with pytest.raises(ValueError, match="vLLM TP 3"):
        VLLMLayout(arch, 3)
    with pytest.raises(ValueError, match="Megatron TP 8"):
        MegatronLayout(arch, 8, 1)
    with pytest.raises(ValueError, match="2 source / 1 destination"):
        build_plan(MegatronLayout(arch, 1, 1), VLLMLayout(arch, 1), [0, 1], [0])
    plan = build_plan(MegatronLayout(arch, 1, 1), VLLMLayout(arch, 1), [0], [1])
    with pytest.raises(ValueError, match="a transport is needed"):
        execute_plan(plan, {}, {}, transport=None, proc=0)
