"""megatron_rl.rollout.engine.generate_all: one batch in, each request's completion out (the
tools' way to drive an engine), on the fake engine; the real engine runs it in the tools'
benchmarks and ``megatron-rl-benchmark speculative_engine_check``."""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.rollout.engine import GenerationRequest, generate_all
from tests.helpers.fake_engine import FakeEngine


def _req(rid: str, n: int) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3], max_tokens=n, seed=0)


def test_every_request_gets_its_completion_and_others_are_passed_over():
    async def go():
        engine = FakeEngine(lambda r: r.max_tokens, capacity=8)
        await engine.submit(_req("earlier", 1))  # another caller's request, finished meanwhile
        got = await generate_all(engine, [_req(f"r{i}", 2 + i) for i in range(4)])
        await engine.shutdown()
        return got

    got = asyncio.run(go())
    assert sorted(got) == ["r0", "r1", "r2", "r3"]
    assert [len(got[f"r{i}"].token_ids) for i in range(4)] == [2, 3, 4, 5]


def test_no_requests_returns_at_once():
    async def go():
        engine = FakeEngine(lambda r: 1)
        got = await asyncio.wait_for(generate_all(engine, []), timeout=5)
        await engine.shutdown()
        return got

    assert asyncio.run(go()) == {}


def test_a_stream_that_ends_early_is_an_error():
    class Ending(FakeEngine):
        async def completions(self):
            return
            yield  # an async generator that yields nothing

    async def go():
        engine = Ending(lambda r: 1)
        try:
            await generate_all(engine, [_req("a", 1), _req("b", 1)])
        finally:
            await engine.shutdown()

    with pytest.raises(RuntimeError, match="2 of 2 requests still unanswered"):
        asyncio.run(go())
