"""Resharding Megatron (TP_t, PP_t, DP) shards into vLLM TP_r layouts over gloo, checked
tensor by tensor against vLLM's own weight loaders applied to the HF checkpoint.

Every (TP_t, PP_t, TP_r) in {1,2,4} x {1,2} x {1,2,4,8} runs on 4 spawned ranks (DP / engine
replicas fill the world; larger layouts put several shards on one process; rollout shards sit
one process over from the trainer shards of the same index), for a tied model with 8 heads /
4 KV heads (TP_r = 8 replicates KV heads) and an untied one with 8 / 8.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers.megatron_cases import run_spmd
from tests.helpers.resharding_cases import reshard_scenarios, vllm_reference_shard

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

WORLD = 4
BUCKET = 256 << 10  # small buckets: tensors get split and many rounds run


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_rl.model.tiny import build_tiny_qwen2

    root = tmp_path_factory.mktemp("reshard")
    common = dict(hidden_size=256, num_heads=8, intermediate_size=512, vocab_size=320)
    models = [
        str(build_tiny_qwen2(root / "tied_kv4", seed=3, num_layers=2, num_kv_heads=4, **common)),
        str(build_tiny_qwen2(root / "untied_kv8", seed=4, num_layers=2, num_kv_heads=8,
                             tie_word_embeddings=False, **common)),
    ]
    expected = root / "expected"
    expected.mkdir()
    for model, tp_r in itertools.product(models, (1, 2, 4, 8)):
        for rank in range(tp_r):
            torch.save(vllm_reference_shard(model, tp_r, rank), expected / f"{model.split('/')[-1]}_tp{tp_r}_r{rank}.pt")
    cases = [
        {"model": m, "tp_t": tp_t, "pp_t": pp_t, "tp_r": tp_r}
        for m in models for tp_t, pp_t, tp_r in itertools.product((1, 2, 4), (1, 2), (1, 2, 4, 8))
    ]
    per_rank = run_spmd(reshard_scenarios, WORLD, (cases, str(expected), BUCKET), root, timeout_s=540)
    return cases, per_rank


def test_every_layout_matches_vllm_loaders(results):
    cases, per_rank = results
    assert len(cases) == 2 * 24
    for index, case in enumerate(cases):
        shards = sorted(s for rank in per_rank for s in rank[index]["dst_shards"])
        assert shards == list(range(max(WORLD, case["tp_r"]))), case  # every rollout shard produced once
        for rank in per_rank:
            assert rank[index]["mismatches"] == [], (case, rank[index]["mismatches"][:5])


def test_each_destination_byte_moved_once(results):
    cases, per_rank = results
    for index, case in enumerate(cases):
        r0 = per_rank[0][index]
        sent = sum(rank[index]["sent"] for rank in per_rank)
        received = sum(rank[index]["received"] for rank in per_rank)
        local = sum(rank[index]["local"] for rank in per_rank)
        assert sent == received == r0["plan_sent"], case
        assert local == r0["plan_local"], case
        assert sent + local == r0["plan_dst"], case
        assert r0["max_bucket"] <= BUCKET
        if case["tp_t"] * case["pp_t"] == 1:
            assert sent == 0, case  # every process holds a full replica: all copies are local
        else:
            assert sent > 0, case  # bytes really crossed processes
