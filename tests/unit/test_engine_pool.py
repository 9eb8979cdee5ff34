"""EnginePool routing, abort ownership, merged completions and stats, on in-process fakes."""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.rollout.engine import Completion, EngineStats, GenerationRequest, RolloutEngine
from megatron_rl.rollout.ray_engine import EnginePool


class FakeEngine(RolloutEngine):
    """Holds requests until told to finish or abort them."""

    def __init__(self, running: int = 0, kv: float = 0.0) -> None:
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.reloads: list[tuple[str, int]] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self._stats = EngineStats(running=running, waiting=1, preemptions=2, kv_cache_usage=kv, capacity=8)
        self.closed = False

    async def submit(self, request):
        if request.request_id == "bad":
            raise ValueError("rejected")
        self.submitted.append(request.request_id)

    def finish(self, rid: str, reason: str = "stop") -> None:
        self.queue.put_nowait(Completion(rid, [1], [-0.5], reason, 0))

    async def completions(self):
        while True:
            yield await self.queue.get()

    async def abort(self, request_ids):
        self.aborted.extend(request_ids)
        for rid in request_ids:
            self.finish(rid, "abort")

    async def reload_weights(self, weights_dir, version):
        self.reloads.append((weights_dir, version))

    async def stats(self):
        return self._stats

    async def shutdown(self):
        self.closed = True


def req(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2], max_tokens=4, seed=0)


def test_least_loaded_routing_abort_by_owner_and_merge():
    async def scenario():
        a, b = FakeEngine(running=3, kv=0.2), FakeEngine(running=1, kv=0.6)
        pool = EnginePool([a, b])
        for rid in ["r0", "r1", "r2"]:
            await pool.submit(req(rid))
        # Ties go to the lower index: r0 -> a, r1 -> b, r2 -> a.
        assert (a.submitted, b.submitted) == (["r0", "r2"], ["r1"])
        with pytest.raises(ValueError, match="already in flight"):
            await pool.submit(req("r0"))

        stream = pool.completions()
        b.finish("r1")
        first = await asyncio.wait_for(stream.__anext__(), 5)
        assert (first.request_id, first.finish_reason) == ("r1", "stop")
        # b is now empty, a holds two: the next request goes to b.
        await pool.submit(req("r3"))
        assert b.submitted == ["r1", "r3"]

        await pool.abort(["r2", "r3", "unknown"])
        assert (a.aborted, b.aborted) == (["r2"], ["r3"])
        got = {(await asyncio.wait_for(stream.__anext__(), 5)).request_id for _ in range(2)}
        assert got == {"r2", "r3"}

        stats = await pool.stats()
        assert (stats.running, stats.waiting, stats.preemptions, stats.capacity) == (4, 2, 4, 16)
        assert stats.kv_cache_usage == pytest.approx(0.4)
        assert stats.extra["routed_in_flight"] == [1, 0]  # only r0 left, on a

        await pool.reload_weights("/dev/shm/w", 5)
        assert a.reloads == b.reloads == [("/dev/shm/w", 5)]
        await pool.shutdown()
        assert a.closed and b.closed

    asyncio.run(scenario())


def test_failed_submit_is_not_counted():
    async def scenario():
        a = FakeEngine()
        pool = EnginePool([a])
        with pytest.raises(ValueError, match="rejected"):
            await pool.submit(req("bad"))
        assert (await pool.stats()).extra["routed_in_flight"] == [0]
        await pool.submit(req("bad2"))  # the pool still accepts requests

    asyncio.run(scenario())


def test_empty_pool_is_an_error():
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([])
