"""EnginePool routing, abort ownership, merged completions and stats, on in-process fakes."""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.rollout.driver.engine_pool import EnginePool
from megatron_rl.rollout.engine import Completion, EngineStats, GenerationRequest, RolloutEngine


class FakeEngine(RolloutEngine):
    """Holds requests until told to finish or abort them; ``generate`` adds partial tokens.

    With ``defer_aborts`` an abort only takes effect at ``flush_aborts()`` (a migration abort
    still in flight); with ``gate`` set, submit waits until the event is set; an exception put
    on ``queue`` ends ``completions()`` with it (the engine died).
    """

    def __init__(self, running: int = 0, kv: float = 0.0, defer_aborts: bool = False) -> None:
        self.submitted: list[str] = []
        self.requests: dict[str, GenerationRequest] = {}
        self.progress: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.pending_aborts: list[str] = []
        self.defer_aborts = defer_aborts
        self.gate: asyncio.Event | None = None
        self.reloads: list[tuple[str, int]] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self._stats = EngineStats(running=running, waiting=1, preemptions=2, kv_cache_usage=kv, capacity=8)
        self.closed = False
        self.asleep = False
        self.sleeps = self.wakes = 0
        self.version = 0

    tensor_parallel_size = 1
    """A fake engine holds no model shards; it stands for one TP-1 engine."""

    async def submit(self, request):
        if request.request_id == "bad":
            raise ValueError("rejected")
        if self.asleep:
            raise RuntimeError(f"asleep: {request.request_id} refused")
        self.submitted.append(request.request_id)
        self.requests[request.request_id] = request
        if self.gate is not None:
            await self.gate.wait()

    def generate(self, rid: str, tokens: list[int]) -> None:
        self.progress.setdefault(rid, []).extend(tokens)

    def finish(self, rid: str, reason: str = "stop", tokens: list[int] | None = None) -> None:
        self.requests.pop(rid, None)
        got = self.progress.pop(rid, [1] if tokens is None else []) + (tokens or [])
        self.queue.put_nowait(Completion(rid, got, [-0.5] * len(got), reason, self.version))

    async def completions(self):
        while True:
            item = await self.queue.get()
            if isinstance(item, Exception):
                raise item  # the engine died
            yield item

    async def abort(self, request_ids):
        self.aborted.extend(request_ids)
        self.pending_aborts.extend(request_ids)
        if not self.defer_aborts:
            self.flush_aborts()

    def flush_aborts(self) -> None:
        for rid in self.pending_aborts:
            if rid in self.requests:  # unknown or finished ids are ignored, as in vLLM
                self.finish(rid, "abort")
        self.pending_aborts = []

    async def reload_weights(self, weights_dir, version):
        if getattr(self, "weights_asleep", self.asleep):
            raise RuntimeError("reload while asleep")
        self.reloads.append((weights_dir, version))
        self.version = version

    async def sleep(self, level=1):
        if self.requests:
            raise RuntimeError(f"sleep with {len(self.requests)} in flight")
        self.asleep = self.weights_asleep = True
        self.sleeps += 1
        self.sleep_level = level
        self.moves = getattr(self, "moves", []) + [f"sleep({level})"]

    async def wake_up(self, tags=None):
        self.moves = getattr(self, "moves", []) + [f"wake({','.join(tags) if tags else 'all'})"]
        if tags is None or "weights" in tags:
            self.weights_asleep = False
        if tags is None or "kv_cache" in tags:
            self.asleep = False
            self.wakes += 1

    async def stats(self):
        return self._stats

    async def shutdown(self):
        self.closed = True


def req(rid: str, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2], max_tokens=max_tokens, seed=0)


async def next_completion(stream) -> Completion:
    return await asyncio.wait_for(stream.__anext__(), 5)


def only_part(engine: FakeEngine, rid: str) -> GenerationRequest:
    """The continuation of ``rid`` that ``engine`` received (exactly one)."""
    parts = [r for r in engine.requests.values() if r.request_id.startswith(rid + "#")]
    assert len(parts) == 1, parts
    return parts[0]


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


# ---------------------------------------------------------------------- resource handoff


async def two_engines_with_work(max_tokens: int = 10, **kw):
    """a holds r0, r2, r4; b holds r1 (3 tokens generated) and r3 (none yet): b is released."""
    a, b = FakeEngine(**kw), FakeEngine(**kw)
    pool = EnginePool([a, b])
    for i in range(5):
        await pool.submit(req(f"r{i}", max_tokens))
    assert (a.submitted, b.submitted) == (["r0", "r2", "r4"], ["r1", "r3"])
    b.generate("r1", [50, 51, 52])
    b.generate("r3", [])
    return a, b, pool


def test_release_migrates_with_remaining_budget_and_merges_once():
    async def scenario():
        a, b, pool = await two_engines_with_work()
        stream = pool.completions()
        metrics = await pool.release_engines(1)
        assert metrics == {"migrated_requests": 2.0, "migrated_tokens": 3.0, "ended_while_migrating": 0.0,
                           "released_engines": 1.0, "release_s": pytest.approx(metrics["release_s"])}
        assert b.aborted == ["r1", "r3"] and b.asleep and b.sleeps == 1
        assert pool.active_engines == 1 and pool.released_indices == [1]

        c1, c3 = only_part(a, "r1"), only_part(a, "r3")
        assert (c1.prompt_ids, c1.max_tokens) == ([1, 2, 50, 51, 52], 7)  # 10 - 3 generated
        assert (c3.prompt_ids, c3.max_tokens, c3.seed) == ([1, 2], 10, 0)  # nothing generated: unchanged
        assert c1.seed != 0

        # Released engines get nothing new; the pool routes everything to a.
        await pool.submit(req("r5"))
        assert b.submitted == ["r1", "r3"] and a.submitted[-1] == "r5"
        stats = await pool.stats()
        assert stats.capacity == 8 and stats.extra["released"] == [1] and stats.extra["sleeping"] == [1]
        assert stats.extra["routed_in_flight"] == [6, 0] and stats.extra["migrated_requests"] == 2

        a.finish(c1.request_id, "length", tokens=[60, 61, 62, 63, 64, 65, 66])
        done = await next_completion(stream)
        assert (done.request_id, done.finish_reason) == ("r1", "length")
        assert done.token_ids == [50, 51, 52, 60, 61, 62, 63, 64, 65, 66]
        assert len(done.token_ids) == 10 and len(done.logprobs) == 10
        for rid in list(a.requests):
            a.finish(rid)
        got = [await next_completion(stream) for _ in range(5)]
        assert sorted(c.request_id for c in got) == ["r0", "r2", "r3", "r4", "r5"]
        assert (await pool.stats()).extra["routed_in_flight"] == [0, 0]
        with pytest.raises(asyncio.TimeoutError):  # nothing else: exactly one completion per id
            await asyncio.wait_for(stream.__anext__(), 0.05)

    asyncio.run(scenario())


def test_partial_that_used_the_whole_budget_ends_with_length():
    async def scenario():
        a, b, pool = await two_engines_with_work(max_tokens=3)
        stream = pool.completions()
        metrics = await pool.release_engines(1)
        # r1 had generated its 3 tokens when the abort hit: nothing left to continue.
        assert (metrics["migrated_requests"], metrics["migrated_tokens"], metrics["ended_while_migrating"]) == (1, 0, 1)
        done = await next_completion(stream)
        assert (done.request_id, done.token_ids, done.finish_reason) == ("r1", [50, 51, 52], "length")
        assert not any(r.startswith("r1#") for r in a.submitted)

    asyncio.run(scenario())


def test_scheduler_abort_while_migration_abort_is_pending():
    async def scenario():
        a, b, pool = await two_engines_with_work(defer_aborts=True)
        stream = pool.completions()
        release = asyncio.create_task(pool.release_engines(1))
        await asyncio.sleep(0.01)
        assert not release.done() and b.pending_aborts == ["r1", "r3"]
        await pool.abort(["r1"])  # the scheduler gives up on r1 mid-migration
        assert b.aborted == ["r1", "r3"]  # no second abort sent: the pending one ends it
        b.flush_aborts()
        metrics = await asyncio.wait_for(release, 5)
        assert (metrics["migrated_requests"], metrics["ended_while_migrating"]) == (1, 1)
        done = await next_completion(stream)
        assert (done.request_id, done.token_ids, done.finish_reason) == ("r1", [50, 51, 52], "abort")
        assert not any(r.startswith("r1#") for r in a.submitted)
        assert only_part(a, "r3").max_tokens == 10

    asyncio.run(scenario())


def test_scheduler_abort_after_migration_reaches_the_continuation():
    async def scenario():
        a, b, pool = await two_engines_with_work()
        stream = pool.completions()
        await pool.release_engines(1)
        cont = only_part(a, "r1")
        a.generate(cont.request_id, [70, 71])
        await pool.abort(["r1", "unknown"])
        assert a.aborted == [cont.request_id]
        done = await next_completion(stream)
        assert (done.request_id, done.token_ids, done.finish_reason) == ("r1", [50, 51, 52, 70, 71], "abort")
        assert len(done.logprobs) == 5

    asyncio.run(scenario())


def test_scheduler_abort_while_continuation_submit_is_pending():
    async def scenario():
        a, b, pool = await two_engines_with_work()
        stream = pool.completions()
        a.gate = asyncio.Event()  # a's submits hang: the continuations are in transit
        release = asyncio.create_task(pool.release_engines(1))
        await asyncio.sleep(0.01)
        assert not release.done() and b.asleep is False
        cont = only_part(a, "r1")
        await pool.abort(["r1"])
        assert a.aborted == []  # sent once the submit returns
        a.gate.set()
        await asyncio.wait_for(release, 5)
        assert a.aborted == [cont.request_id] and b.asleep
        done = await next_completion(stream)
        assert (done.request_id, done.token_ids, done.finish_reason) == ("r1", [50, 51, 52, 1], "abort")

    asyncio.run(scenario())


def test_an_engine_dying_reaches_the_consumer_and_a_release_waiting_on_it():
    async def scenario():
        a, b, pool = await two_engines_with_work(defer_aborts=True)
        stream = pool.completions()
        release = asyncio.create_task(pool.release_engines(1))
        await asyncio.sleep(0.01)
        assert not release.done()  # waiting for b's aborted requests
        b.queue.put_nowait(RuntimeError("engine b died"))
        with pytest.raises(RuntimeError, match=r"engine\(s\) \[1\] failed while draining"):
            await asyncio.wait_for(release, 5)
        with pytest.raises(RuntimeError, match="engine b died"):
            await next_completion(stream)

    asyncio.run(scenario())


def test_release_refuses_to_release_every_engine():
    async def scenario():
        pool = EnginePool([FakeEngine(), FakeEngine(), FakeEngine()])
        for count in (0, 3, 4, -1):
            with pytest.raises(ValueError, match="at least one must stay active"):
                await pool.release_engines(count)
        await pool.release_engines(2)
        assert pool.released_indices == [1, 2]  # idle ties go to the highest indices
        with pytest.raises(ValueError, match="at least one must stay active"):
            await pool.release_engines(1)
        single = EnginePool([FakeEngine()])
        with pytest.raises(ValueError, match="1..0 of the 1"):
            await single.release_engines(1)

    asyncio.run(scenario())


def test_the_named_members_are_released_at_the_level_asked():
    """The stream trainer names the engines whose GPUs are whole trainer replicas, and they sleep at level
    2 (the push after the step refills their weights); members that are not active, or a count that does
    not match, are refused before anything moves."""
    async def scenario():
        engines = [FakeEngine(), FakeEngine(), FakeEngine()]
        pool = EnginePool(engines)
        for members in ([3], [0, 0], [0]):
            with pytest.raises(ValueError, match="members"):
                await pool.release_engines(2 if members == [0, 0] else 1 if members != [0] else 2, members=members)
        assert pool.released_indices == []
        await pool.release_engines(1, members=[0], level=2)
        assert pool.released_indices == [0] and engines[0].asleep and engines[0].sleep_level == 2
        assert not engines[1].asleep and not engines[2].asleep  # idle engines 1 and 2 would have been the default
        with pytest.raises(ValueError, match="members"):
            await pool.release_engines(1, members=[0])  # already released: not active

    asyncio.run(scenario())


def test_least_loaded_engine_is_released():
    async def scenario():
        a, b = FakeEngine(), FakeEngine()
        pool = EnginePool([a, b])
        for i in range(3):
            await pool.submit(req(f"r{i}"))  # a: r0, r2; b: r1
        a.finish("r0")
        a.finish("r2")
        stream = pool.completions()
        assert {(await next_completion(stream)).request_id for _ in range(2)} == {"r0", "r2"}
        metrics = await pool.release_engines(1)
        assert pool.released_indices == [0] and metrics["migrated_requests"] == 0 and a.asleep

    asyncio.run(scenario())


def test_reload_and_restore_wake_released_engines():
    async def scenario():
        a, b, pool, stream = await released_then_drained()
        await pool.reload_weights("/dev/shm/w", 2)
        assert (b.wakes, b.asleep, pool.active_engines, pool.released_indices) == (1, False, 2, [])
        assert a.reloads == b.reloads == [("/dev/shm/w", 2)]  # the released engine got them too
        await pool.submit(req("after"))
        await pool.submit(req("after2"))
        assert a.submitted[-1] == "after" and b.submitted[-1] == "after2"  # routed to b again

        a.finish("after")
        b.finish("after2")
        [await next_completion(stream) for _ in range(2)]
        await pool.release_engines(1)
        restored = await pool.restore_engines()
        assert restored["restored_engines"] == 1 and pool.active_engines == 2
        assert await pool.restore_engines() == {"restored_engines": 0.0, "wake_s": pytest.approx(0, abs=1)}

    asyncio.run(scenario())


def test_pool_sleep_and_wake_up():
    async def scenario():
        a, b = FakeEngine(), FakeEngine()
        pool = EnginePool([a, b])
        await pool.submit(req("r0"))
        with pytest.raises(RuntimeError, match="in flight"):
            await pool.sleep()
        a.finish("r0")
        await next_completion(pool.completions())
        await pool.sleep()
        assert a.asleep and b.asleep and pool.active_engines == 0
        with pytest.raises(RuntimeError, match="no active engine"):
            await pool.submit(req("r1"))
        await pool.wake_up()
        assert not a.asleep and not b.asleep and pool.active_engines == 2

    asyncio.run(scenario())


async def released_then_drained():
    """Two engines, b released mid-round, every request finished: the state after a stream round."""
    a, b, pool = await two_engines_with_work()
    stream = pool.completions()
    await pool.release_engines(1)
    for rid in list(a.requests):
        a.finish(rid)
    assert len([await next_completion(stream) for _ in range(5)]) == 5
    assert (a.asleep, b.asleep, b.sleeps) == (False, True, 1)
    return a, b, pool, stream


async def routed_to_both(a: FakeEngine, b: FakeEngine, pool: EnginePool, stream) -> None:
    await pool.submit(req("next0"))
    await pool.submit(req("next1"))
    assert a.submitted[-1] == "next0" and b.submitted[-1] == "next1"
    a.finish("next0")
    b.finish("next1")
    [await next_completion(stream) for _ in range(2)]


def test_restore_while_the_pool_sleeps_keeps_engines_asleep_until_wake_up():
    """The loop with rollout.sleep_during_train: pool.sleep(), then the stream trainer gives the
    released engine back, then the weight sync wakes the pool and reloads."""
    async def scenario():
        a, b, pool, stream = await released_then_drained()
        await pool.sleep()
        assert (a.asleep, a.sleeps, b.sleeps) == (True, 1, 1)  # the released one is not slept twice
        restored = await pool.restore_engines()
        assert restored["restored_engines"] == 1.0
        assert a.asleep and b.asleep and (a.wakes, b.wakes) == (0, 0)  # training keeps every device
        assert pool.released_indices == [] and pool.active_engines == 0
        with pytest.raises(RuntimeError, match="no active engine"):
            await pool.submit(req("too-early"))
        assert await pool.restore_engines() == {"restored_engines": 0.0, "wake_s": pytest.approx(0, abs=1)}

        await pool.wake_up()
        assert (a.asleep, b.asleep, a.wakes, b.wakes) == (False, False, 1, 1)
        assert pool.active_engines == 2
        await pool.reload_weights("/dev/shm/w", 1)
        assert a.reloads == b.reloads == [("/dev/shm/w", 1)]
        await routed_to_both(a, b, pool, stream)

        # The next round: with the pool awake again, a restore wakes as before.
        await pool.release_engines(1)
        assert b.asleep
        await pool.restore_engines()
        assert not b.asleep and pool.active_engines == 2

    asyncio.run(scenario())


def test_restore_before_the_pool_sleeps_also_ends_with_every_engine_asleep():
    """The other order (give back, then sleep): restore wakes, sleep puts all to sleep again."""
    async def scenario():
        a, b, pool, stream = await released_then_drained()
        await pool.restore_engines()
        assert not b.asleep and pool.active_engines == 2
        await pool.sleep()
        assert a.asleep and b.asleep and pool.active_engines == 0
        await pool.wake_up()
        await pool.reload_weights("/dev/shm/w", 1)
        assert not a.asleep and not b.asleep and a.reloads == b.reloads == [("/dev/shm/w", 1)]
        await routed_to_both(a, b, pool, stream)

    asyncio.run(scenario())


def test_restore_while_awake_wakes_and_routes():
    async def scenario():
        a, b, pool, stream = await released_then_drained()
        restored = await pool.restore_engines()
        assert restored["restored_engines"] == 1.0
        assert (b.asleep, b.wakes, a.sleeps, a.wakes) == (False, 1, 0, 0)
        assert pool.active_engines == 2 and pool.released_indices == []
        await routed_to_both(a, b, pool, stream)

    asyncio.run(scenario())


def test_reload_wakes_a_sleeping_pool():
    """reload_weights needs every engine awake: on a sleeping pool it wakes it (and restores)."""
    async def scenario():
        a, b, pool, stream = await released_then_drained()
        await pool.sleep()
        await pool.reload_weights("/dev/shm/w", 3)
        assert not a.asleep and not b.asleep and a.reloads == b.reloads == [("/dev/shm/w", 3)]
        await routed_to_both(a, b, pool, stream)
        await pool.release_engines(1)
        await pool.restore_engines()  # the pool is awake again: restored engines wake
        assert not a.asleep and not b.asleep

    asyncio.run(scenario())


def test_random_release_keeps_one_completion_per_request_within_budget():
    """Tick-based fakes: requests run at once on 3 engines, 2 are released mid-round."""
    from tests.helpers.fake_engine import FakeEngine as TickEngine

    def remaining_length(r: GenerationRequest) -> int:
        # prompt = [target total length, 0]; a continuation's prompt also holds what was generated.
        return r.prompt_ids[0] - (len(r.prompt_ids) - 2)

    async def scenario():
        engines = [TickEngine(remaining_length, capacity=8, tick_s=0.001) for _ in range(3)]
        pool = EnginePool(engines)
        requests = [GenerationRequest(f"q{i}", [5 + 7 * i % 40, 0], max_tokens=30, seed=i) for i in range(40)]
        for r in requests:
            await pool.submit(r)
        stream = pool.completions()
        got = [await next_completion(stream) for _ in range(10)]
        metrics = await pool.release_engines(2)
        released = [engines[i] for i in pool.released_indices]
        seen = [len(e.submitted) for e in released]
        assert all(e.asleep for e in released) and metrics["migrated_requests"] > 0
        while len(got) < len(requests):
            got.append(await next_completion(stream))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stream.__anext__(), 0.05)
        assert [len(e.submitted) for e in released] == seen
        by_id = {c.request_id: c for c in got}
        assert sorted(by_id) == sorted(r.request_id for r in requests) and len(got) == len(by_id)
        for r in requests:
            c, target = by_id[r.request_id], r.prompt_ids[0]
            # Every part together generated exactly the target, never more than the budget.
            assert len(c.token_ids) == min(target, r.max_tokens) == len(c.logprobs)
            assert c.finish_reason == ("length" if target >= r.max_tokens else "stop")
        await pool.shutdown()

    asyncio.run(scenario())


def test_a_push_into_a_sleeping_pool_wakes_only_the_weights_and_routes_after_the_kv_cache():
    """The weight sync's order (planning.moments' push moment): pool asleep at level 2, the
    weights of every engine (a released one too) woken, the reload, then the KV caches."""
    async def scenario():
        a, b, pool, stream = await released_then_drained()
        await pool.sleep(level=2)
        await pool.wake_up(["weights"])
        await pool.reload_weights("/dev/shm/w", 4)  # no full wake-up on the way
        assert a.asleep and b.asleep and pool.active_engines == 0
        assert a.moves == ["sleep(2)", "wake(weights)"] and b.moves == ["sleep(1)", "wake(weights)"]
        await pool.wake_up(["kv_cache"])
        assert a.moves[-1] == b.moves[-1] == "wake(all)" and pool.active_engines == 2
        assert a.reloads == b.reloads == [("/dev/shm/w", 4)]
        await routed_to_both(a, b, pool, stream)

    asyncio.run(scenario())


class Launching(FakeEngine):
    """Records each launch it gets (``submit_all``), its requests held until ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[list[str]] = []

    async def submit_all(self, requests):
        self.launches.append([r.request_id for r in requests])
        for r in requests:
            await self.submit(r)


def test_a_launch_is_placed_first_and_reaches_each_engine_as_one_share():
    async def scenario():
        a, b = Launching(), Launching()
        pool = EnginePool([a, b])
        stream = pool.completions()
        await pool.submit(req("early"))  # a holds one already
        a.gate = asyncio.Event()  # from here a's submits do not return until the gate opens
        launch = asyncio.create_task(pool.submit_all([req(f"r{i}") for i in range(5)]))
        await asyncio.sleep(0.05)
        # Placed by the pool's counts before any submit returned: b (empty) first, then alternating.
        assert (a.launches, b.launches) == ([["r1", "r3"]], [["r0", "r2", "r4"]])
        # A completion arriving meanwhile moves nothing that was already placed.
        a.finish("early")
        assert (await next_completion(stream)).request_id == "early"
        a.gate.set()
        await launch
        assert (await pool.stats()).extra["routed_in_flight"] == [2, 3]
        with pytest.raises(ValueError, match=r"already in flight"):
            await pool.submit_all([req("r9"), req("r9")])
        with pytest.raises(ValueError, match=r"\['r0'\] already in flight"):
            await pool.submit_all([req("r0"), req("new")])
        assert (await pool.stats()).extra["routed_in_flight"] == [2, 3]  # nothing of a refused launch placed

    asyncio.run(scenario())


def test_a_launch_an_engine_rejects_leaves_nothing_counted_there():
    async def scenario():
        a, b = Launching(), Launching()
        pool = EnginePool([a, b])
        with pytest.raises(ValueError, match="rejected"):
            await pool.submit_all([req("ok"), req("bad")])  # "bad" goes to b, which rejects it
        assert (await pool.stats()).extra["routed_in_flight"] == [1, 0]
        await pool.submit_all([req("bad2")])  # the pool still takes launches
        assert b.launches[-1] == ["bad2"]

    asyncio.run(scenario())
