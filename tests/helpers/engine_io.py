"""Small async helpers shared by the engine tests (VLLMEngine, its Ray client)."""
from __future__ import annotations

import asyncio

from megatron_rl.rollout.engine import Completion, GenerationRequest, RolloutEngine


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float):
    """Run ``coro`` on the module's loop with a hard timeout (a hung engine fails the test)."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout=timeout))


async def collect(engine: RolloutEngine, ids: set[str]) -> dict[str, Completion]:
    """Read completions until every id in ``ids`` arrived (others are an error)."""
    got: dict[str, Completion] = {}
    async for completion in engine.completions():
        assert completion.request_id in ids, f"unexpected completion {completion.request_id}"
        got[completion.request_id] = completion
        if len(got) == len(ids):
            return got
    raise AssertionError("completions() ended early")


async def generate(engine: RolloutEngine, requests: list[GenerationRequest]) -> dict[str, Completion]:
    """Submit ``requests`` and wait for all their completions."""
    await asyncio.gather(*(engine.submit(r) for r in requests))
    return await collect(engine, {r.request_id for r in requests})
