"""The push plan: trainer shards (Megatron TP x PP x DP, cut from an HF checkpoint by the trainer's
own HF -> Megatron conversion) packed bucket by bucket and unpacked on each engine rank give, at
every row that rank's vLLM layout holds, exactly the checkpoint's rows; buckets stay bounded;
each trainer rank packs only what it holds; every byte of a replica is sent once."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.model.hf_weights import hf_to_megatron_shard
from megatron_rl.model.qwen2 import read_qwen2_arch
from megatron_rl.model.tiny import build_tiny_qwen2
from megatron_rl.resharding.layouts import LM_HEAD, MegatronLayout, VLLMLayout, logical_shapes
from megatron_rl.resharding.push_plan import build_push_plan, pack_bucket
from megatron_rl.rollout.worker.push_receiver import StagedLoader
from megatron_rl.training.weights_io import LazySafetensors


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("push_plan")
    # 4 heads, 2 KV heads: TP 4 replicates KV heads; vocab 320 pads to 384 (vLLM) / 512 (Megatron TP4).
    tied = build_tiny_qwen2(root / "tied", seed=1, num_layers=4)
    untied = build_tiny_qwen2(root / "untied", seed=2, num_layers=4, tie_word_embeddings=False)
    return {"tied": tied, "untied": untied}


def _sources(model, tp, pp, dp):
    arch, hf = read_qwen2_arch(model), LazySafetensors(model)
    layout = MegatronLayout(arch, tp, pp, dp)
    out = {}
    for rank in range(layout.num_shards):
        tp_rank, pp_rank, _ = layout.coords(rank)
        out[rank] = hf_to_megatron_shard(hf, arch, tp_rank, tp, pp_rank, pp)
    return arch, hf, out


@pytest.mark.parametrize("name", ["tied", "untied"])
@pytest.mark.parametrize("trainer, rollout_tp", [((1, 1, 1), 1), ((2, 1, 1), 2), ((2, 2, 1), 1), ((2, 1, 2), 4),
                                                 ((1, 2, 1), 2), ((2, 2, 1), 4)])
def test_every_engine_rank_gets_exactly_its_vllm_rows(models, name, trainer, rollout_tp):
    arch, hf, sources = _sources(models[name], *trainer)
    bucket_bytes = 24 << 10  # small: tensors split across buckets
    plan = build_push_plan(arch, *trainer, rollout_tp, bucket_bytes, 4)
    assert plan.buckets and all(b.numel * 4 <= bucket_bytes for b in plan.buckets)
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))
    shapes = logical_shapes(arch)
    for rank in range(rollout_tp):
        fed: dict[str, torch.Tensor] = {}

        def load(batch, fed=fed):
            for n, t in batch:
                assert n not in fed, f"{n} fed twice"
                fed[n] = t

        loader = StagedLoader(plan.needed[rank], shapes, load, torch.float32, torch.device("cpu"),
                              arch.tie_word_embeddings)
        for bucket in plan.for_engine(rank):
            flat = torch.full((bucket.numel,), float("nan"))
            pack_bucket(bucket, sources[bucket.src_rank], flat)  # raises if the rank does not hold a piece
            loader.feed(loader.add(bucket, flat))
        assert loader.missing() == [] and not loader.staging
        expected = set(hf) | ({LM_HEAD} if arch.tie_word_embeddings else set())
        assert set(fed) == expected
        for spec in VLLMLayout(arch, rollout_tp).tensors(rank):
            for seg in spec.segments:
                got = fed[seg.logical].narrow(spec.dim, seg.logical_start, seg.length)
                want = hf[seg.logical].narrow(spec.dim, seg.logical_start, seg.length)
                assert torch.equal(got, want), (name, trainer, rollout_tp, rank, spec.name, seg)
        if arch.tie_word_embeddings:
            assert fed[LM_HEAD] is fed["model.embed_tokens.weight"]
    # One replica's bytes are sent once: the sum of every rank's segments.
    rows = sum(seg.length * spec.row_numel for r in range(rollout_tp)
               for spec in VLLMLayout(arch, rollout_tp).tensors(r) for seg in spec.segments)
    assert plan.total_numel == rows


def test_packing_is_spread_over_replicas_and_follows_a_global_order(models):
    arch = read_qwen2_arch(models["tied"])
    plan = build_push_plan(arch, 1, 1, 2, 2, 16 << 10, 4)  # two DP replicas hold everything
    per_rank = [sum(b.numel for b in plan.for_trainer(r)) for r in range(2)]
    assert min(per_rank) > 0.3 * sum(per_rank), per_rank  # the least-loaded holder packs
    for rank in range(2):
        order = [b.index for b in plan.for_engine(rank)]
        assert order == sorted(order)


def test_fingerprint_tells_plans_apart(models):
    arch = read_qwen2_arch(models["tied"])
    a = build_push_plan(arch, 2, 1, 1, 2, 32 << 10, 4)
    assert a.fingerprint == build_push_plan(arch, 2, 1, 1, 2, 32 << 10, 4).fingerprint
    assert a.fingerprint != build_push_plan(arch, 2, 1, 1, 2, 16 << 10, 4).fingerprint
    assert a.fingerprint != build_push_plan(arch, 2, 1, 1, 1, 32 << 10, 4).fingerprint


def test_a_piece_the_rank_does_not_hold_is_named(models):
    arch, _, sources = _sources(models["tied"], 2, 1, 1)
    plan = build_push_plan(arch, 2, 1, 1, 1, 1 << 20, 4)
    bucket = plan.for_trainer(1)[0]
    with pytest.raises(KeyError, match="trainer rank 1 does not hold"):
        pack_bucket(bucket, {}, torch.empty(bucket.numel))


def test_stray_rows_are_refused_by_the_loader(models):
    arch, _, sources = _sources(models["tied"], 1, 1, 1)
    plan = build_push_plan(arch, 1, 1, 1, 1, 1 << 20, 4)
    loader = StagedLoader(plan.needed[0], logical_shapes(arch), lambda batch: None, torch.float32,
                          torch.device("cpu"), True)
    bucket = plan.buckets[0]
    flat = torch.empty(bucket.numel)
    pack_bucket(bucket, sources[0], flat)
    loader.feed(loader.add(bucket, flat))
    with pytest.raises(RuntimeError, match="disagree on the push plan"):
        loader.add(bucket, flat)  # the same rows again
