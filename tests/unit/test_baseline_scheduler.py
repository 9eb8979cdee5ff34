"""The baseline scheduler on a fake engine (pure scheduling; the real engine is covered by the
integration tests): P0 groups of R0 scored responses, deterministic seeds, version checks."""
import asyncio

import pytest

from megatron_rl.config.schema import RunConfig
from megatron_rl.loop.baseline import BaselineScheduler
from megatron_rl.loop.hooks import RolloutContext
from megatron_rl.loop.requests import request_seed
from megatron_rl.sample import Prompt
from tests.helpers.fake_engine import FakeEngine


def make_ctx(engine, prompts, version=0, p0=3, r0=4, completed=None):
    cfg = RunConfig()
    cfg.data.prompts_per_step = p0
    cfg.data.responses_per_prompt = r0
    cfg.rollout.max_new_tokens = 50
    it = iter(prompts)

    async def score(sample):
        await asyncio.sleep(0)
        sample.reward = float(len(sample.response_ids) % 2)
        sample.correct = bool(sample.reward)
        return sample

    return RolloutContext(cfg=cfg, engine=engine, score=score, cancel_scores=lambda s: None,
                          next_prompts=lambda n: [next(it) for _ in range(n)], policy_version=version, step=7,
                          on_group_complete=(completed.append if completed is not None else (lambda g: None)))


def prompts(n):
    return [Prompt(prompt_id=f"p{i}", token_ids=[1, 2, i], answer=str(i)) for i in range(n)]


def test_baseline_returns_p0_complete_scored_groups():
    engine = FakeEngine(length_fn=lambda r: 3 + r.seed % 40, capacity=5)
    completed = []
    ctx = make_ctx(engine, prompts(10), completed=completed)
    batch = asyncio.run(BaselineScheduler().next_batch(ctx))
    assert [g[0].prompt.prompt_id for g in batch.groups] == ["p0", "p1", "p2"]
    for group in batch.groups:
        assert [s.response_index for s in group] == [0, 1, 2, 3]
        assert all(s.reward is not None and s.policy_version == 0 for s in group)
        assert all(len(s.response_ids) == 3 + request_seed(ctx.cfg.trainer.seed, 7, s.prompt.prompt_id,
                                                           s.response_index) % 40 or s.finish_reason == "length"
                   for s in group)
    assert len(completed) == 3  # the hook saw every group once
    assert len(engine.submitted) == 12 and not engine.aborted
    assert len({r.seed for r in engine.submitted}) == 12
    assert len(batch.requests) == 12
    assert batch.metrics["rollout/responses_launched"] == 12.0


def test_stale_engine_weights_are_refused():
    engine = FakeEngine(length_fn=lambda r: 2)
    engine.version = 3  # the engine missed the sync to version 4
    ctx = make_ctx(engine, prompts(3), version=4)
    with pytest.raises(RuntimeError, match="weight version 3"):
        asyncio.run(BaselineScheduler().next_batch(ctx))


def test_seeds_are_reproducible_and_distinct():
    assert request_seed(1, 2, "p", 0) == request_seed(1, 2, "p", 0)
    assert len({request_seed(1, s, f"p{i}", r) for s in range(3) for i in range(5) for r in range(4)}) == 60


def test_a_round_reaches_the_engine_as_one_launch():
    class Launches(FakeEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.launches: list[int] = []

        async def submit(self, request):
            assert self.launches, "a request reached the engine outside a launch"
            await super().submit(request)

        async def submit_all(self, requests):
            self.launches.append(len(requests))
            for request in requests:
                await self.submit(request)

    engine = Launches(length_fn=lambda r: 3 + r.seed % 7, capacity=64)
    batch = asyncio.run(BaselineScheduler().next_batch(make_ctx(engine, prompts(3))))
    assert engine.launches == [12] and len(batch.groups) == 3


def test_a_launch_sends_nothing_when_it_fails_and_an_inner_one_leaves_the_sending_to_it():
    from megatron_rl.loop.requests import InFlight, launch, submit_prompt

    class Launches(FakeEngine):
        launches: list[list[str]] = []

        async def submit_all(self, requests):
            self.launches.append([r.request_id for r in requests])

    engine = Launches(length_fn=lambda r: 2)
    ctx, flight = make_ctx(engine, prompts(2)), InFlight()

    async def scenario():
        with pytest.raises(RuntimeError, match="drawn"):
            async with launch(ctx, flight):
                await submit_prompt(ctx, flight, prompts(1)[0], 2, "baseline")
                raise RuntimeError("drawn wrong")
        async with launch(ctx, flight):
            await submit_prompt(ctx, flight, prompts(2)[1], 1, "baseline")
            async with launch(ctx, flight):
                await submit_prompt(ctx, flight, prompts(3)[2], 1, "baseline")
            assert engine.launches == []  # the inner launch leaves the sending to the outer one

    asyncio.run(scenario())
    assert engine.launches == [["s7-a0-p1-r0", "s7-a0-p2-r0"]] and not engine.submitted


def test_a_watched_group_whose_rewards_are_cancelled_leaves_no_unretrieved_error():
    import gc

    from megatron_rl.loop.requests import InFlight, RoundWaiter
    from megatron_rl.sample import Sample

    reported = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))
        ctx, flight = make_ctx(FakeEngine(length_fn=lambda r: 2), prompts(1)), InFlight()
        sample = Sample(prompt=prompts(1)[0], response_index=0, request_id="r0", round_type="short", policy_version=0)
        flight.scoring["r0"] = asyncio.ensure_future(asyncio.sleep(10))
        flight.finished["r0"] = sample
        waiter = RoundWaiter(ctx, flight)
        waiter.watch("p0", [sample])
        flight.scoring["r0"].cancel()  # the group will not be trained: its reward work stops
        await asyncio.sleep(0.01)
        waiter._groups.clear()  # the round ends without awaiting it
        waiter.close()
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    gc.collect()
    assert not [m for m in reported if "never retrieved" in m], reported
