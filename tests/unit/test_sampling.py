"""The round wait every scheduler uses (``megatron_rl.loop.requests.RoundWaiter``) on a hand-driven engine:
which event each completion makes, when a watched group counts as scored, what aborting the rest
returns, and the cases the schedulers' own tests do not reach (a completion read but not yet
reported when the round stops, a stale completion, a failed reward)."""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.config.schema import RunConfig
from megatron_rl.loop.hooks import RolloutContext
from megatron_rl.loop.requests import (
    Aborted,
    Finished,
    GroupScored,
    InFlight,
    RoundWaiter,
    submit_continuation,
    submit_prompt,
)
from megatron_rl.rollout.engine import Completion
from megatron_rl.sample import Prompt


class HandEngine:
    """Completes requests only when the test says so; an abort ends a request with the tokens it
    was given so far, and ignores a request that already finished (the engine contract)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Completion] = asyncio.Queue()
        self.running: dict[str, list[int]] = {}
        self.aborted: list[str] = []

    async def submit(self, request) -> None:
        self.running[request.request_id] = []

    async def completions(self):
        while True:
            yield await self.queue.get()

    def finish(self, rid: str, tokens: list[int], reason: str = "stop") -> None:
        self.running.pop(rid)
        self.queue.put_nowait(Completion(rid, tokens, [-0.5] * len(tokens), reason, 0))

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.aborted.append(rid)
            if rid in self.running:
                self.finish(rid, self.running[rid], "abort")


class Rewards:
    """``ctx.score`` whose results the test releases one response at a time."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.fail: set[str] = set()

    def release(self, *rids: str) -> None:
        for rid in rids:
            self.gates.setdefault(rid, asyncio.Event()).set()

    async def __call__(self, sample):
        await self.gates.setdefault(sample.request_id, asyncio.Event()).wait()
        if sample.request_id in self.fail:
            raise ValueError(f"grader failed on {sample.request_id}")
        sample.reward = float(len(sample.response_ids))
        return sample


def make_ctx(engine: HandEngine, rewards: Rewards, cancelled: list | None = None) -> RolloutContext:
    cfg = RunConfig()
    cfg.rollout.max_new_tokens = 8
    return RolloutContext(cfg=cfg, engine=engine, score=rewards,
                          cancel_scores=(cancelled.extend if cancelled is not None else lambda s: None),
                          next_prompts=lambda n: [], policy_version=0, step=3)


PROMPT = Prompt(prompt_id="p", token_ids=[1, 2], answer="")


async def _drain_until(waiter: RoundWaiter, want: int) -> list:
    events = []
    while len(events) < want:
        events += await asyncio.wait_for(waiter.next(), 5)
    return events


def test_completions_become_events_and_a_watched_group_is_reported_once_every_reward_is_in():
    async def main():
        engine, rewards = HandEngine(), Rewards()
        ctx, flight = make_ctx(engine, rewards), InFlight()
        r0, r1 = await submit_prompt(ctx, flight, PROMPT, 2, "short")
        with RoundWaiter(ctx, flight) as waiter:
            engine.finish(r1, [5, 6, 7])
            engine.finish(r0, [5])
            first, second = await _drain_until(waiter, 2)
            assert isinstance(first, Finished) and first.sample.request_id == r1 and first.sample.response_ids == [5, 6, 7]
            assert isinstance(second, Finished) and second.sample.response_index == 0
            waiter.watch("p", [first.sample, second.sample])
            rewards.release(r0)
            await asyncio.sleep(0.01)
            assert waiter.busy and not flight.samples  # one reward still out: nothing to report yet
            rewards.release(r1)
            (scored,) = await _drain_until(waiter, 1)
        assert isinstance(scored, GroupScored) and scored.key == "p"
        assert [s.response_index for s in scored.group] == [0, 1]
        assert [s.reward for s in scored.group] == [1.0, 3.0]
        assert not waiter.busy
        with pytest.raises(RuntimeError, match="no request runs"):
            await waiter.next()

    asyncio.run(main())


def test_a_completion_of_another_round_is_skipped():
    async def main():
        engine, rewards = HandEngine(), Rewards()
        ctx, flight = make_ctx(engine, rewards), InFlight()
        (rid,) = await submit_prompt(ctx, flight, PROMPT, 1, "short")
        engine.queue.put_nowait(Completion("s2-a0-p-r0", [9], [-0.1], "stop", 0))  # an earlier round's request
        engine.finish(rid, [4, 4])
        with RoundWaiter(ctx, flight) as waiter:
            assert await asyncio.wait_for(waiter.next(), 5) == []
            (event,) = await asyncio.wait_for(waiter.next(), 5)
        assert isinstance(event, Finished) and event.sample.request_id == rid
        assert list(flight.finished) == [rid] and len(flight.requests) == 1

    asyncio.run(main())


def test_a_failed_reward_raises_from_the_wait():
    async def main():
        engine, rewards = HandEngine(), Rewards()
        ctx, flight = make_ctx(engine, rewards), InFlight()
        (rid,) = await submit_prompt(ctx, flight, PROMPT, 1, "short")
        rewards.fail.add(rid)
        rewards.release(rid)
        engine.finish(rid, [3])
        with RoundWaiter(ctx, flight) as waiter:
            (event,) = await _drain_until(waiter, 1)
            waiter.watch("p", [event.sample])
            with pytest.raises(ValueError, match="grader failed"):
                await asyncio.wait_for(waiter.next(), 5)

    asyncio.run(main())


def test_abort_rest_reports_a_completion_read_before_the_round_stopped_and_the_aborted_tokens():
    async def main():
        engine, rewards = HandEngine(), Rewards()
        ctx, flight = make_ctx(engine, rewards), InFlight()
        r0, r1, r2 = await submit_prompt(ctx, flight, PROMPT, 3, "short")
        rewards.release(r0, r1)
        with RoundWaiter(ctx, flight) as waiter:
            engine.finish(r0, [1, 2])
            (done,) = await _drain_until(waiter, 1)
            waiter.watch("p", [done.sample])
            (scored,) = await _drain_until(waiter, 1)  # the group came first: the read of r1 is still pending
            assert isinstance(scored, GroupScored)
            engine.finish(r1, [3])
            engine.running[r2] = [7, 7, 7]
            await asyncio.sleep(0.01)  # r1's completion reaches the pending read, unreported
            events = await asyncio.wait_for(waiter.abort_rest(), 5)
        assert [(type(e), e.completion.request_id) for e in events] == [(Finished, r1), (Aborted, r2)]
        assert engine.aborted == [r2]  # r1 had finished: not aborted, not lost
        assert events[1].sample.response_ids == [7, 7, 7] and flight.aborted[r2] is events[1].sample
        assert flight.num_aborted == 1 and flight.aborted_tokens == 3 and not flight.samples

    asyncio.run(main())


def test_a_continued_response_is_awaited_under_its_continuation_and_an_earlier_rounds_sample_is_not():
    async def main():
        engine, rewards = HandEngine(), Rewards()
        ctx = make_ctx(engine, rewards)
        earlier, flight = InFlight(), InFlight()
        a, b = await submit_prompt(ctx, earlier, PROMPT, 2, "partial")
        engine.running[b] = [8, 8]
        rewards.release(a)
        with RoundWaiter(ctx, earlier) as waiter:
            engine.finish(a, [1])
            (finished,) = await _drain_until(waiter, 1)
            (aborted,) = await asyncio.wait_for(waiter.abort_rest(), 5)
        await earlier.scoring[a]
        cont = f"{b}-c4"
        assert await submit_continuation(ctx, flight, aborted.sample, earlier.sent[b], cont)
        with RoundWaiter(ctx, flight) as waiter:
            engine.finish(cont, [9])
            (event,) = await _drain_until(waiter, 1)
            assert event.sample is aborted.sample and event.sample.response_ids == [8, 8, 9]
            waiter.watch("p", [finished.sample, event.sample])
            await asyncio.sleep(0.01)
            assert waiter.busy  # waits for the continuation's reward only (the sample keeps its first id)
            rewards.release(b)
            (scored,) = await _drain_until(waiter, 1)
        assert [s.response_index for s in scored.group] == [0, 1] and scored.group[1].reward == 3.0

    asyncio.run(main())


def test_cancel_groups_stops_the_reward_work_it_waited_for():
    async def main():
        engine, rewards = HandEngine(), Rewards()
        ctx, flight = make_ctx(engine, rewards), InFlight()
        (rid,) = await submit_prompt(ctx, flight, PROMPT, 1, "short")
        engine.finish(rid, [2])
        with RoundWaiter(ctx, flight) as waiter:
            (event,) = await _drain_until(waiter, 1)
            waiter.watch("p", [event.sample])
            waiter.cancel_groups()
            assert not waiter.busy
        await asyncio.sleep(0.01)
        assert flight.scoring[rid].cancelled()

    asyncio.run(main())
