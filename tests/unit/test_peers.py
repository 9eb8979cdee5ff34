"""RollPacker's peers on a fake engine: partial rollout (what is kept, what continues and how,
the versions every token records, the staleness bound, no prompt trained twice or lost, the
checkpointed carried responses) and one-step-off (the next step's rollout overlaps training, one
version old, settled before the weights change, the prefetched batch checkpointed). The loop
around them: tests/unit/test_peers_loop.py; the real stack: tests/integration/test_peers_vllm_loop.py."""
from __future__ import annotations

import asyncio
import math
import pickle

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.config.validation import validate
from megatron_rl.config.values import ConfigError
from megatron_rl.data.cursor import PromptCursor
from megatron_rl.loop.hooks import RolloutContext
from megatron_rl.loop.off_policy import check_staleness, token_versions
from megatron_rl.sample import Prompt
from rollpacker.peers.one_step_off import OneStepOffScheduler
from rollpacker.peers.partial_rollout import PartialRolloutScheduler
from tests.helpers.fake_engine import FakeEngine

P0, R0 = 4, 2
LONG, SHORT = 40, 6
TICK = 0.004
"""Seconds per decoded token: slow enough that the scheduler's bookkeeping takes well under one."""


def make_prompts(n: int) -> list[Prompt]:
    """Prompt i is long (its responses need LONG ticks) when i % 5 == 4, else SHORT."""
    return [Prompt(prompt_id=f"p{i}", token_ids=[7, i], answer=str(i)) for i in range(n)]


def remaining_length(req) -> int:
    """What is left of the response's length: a continuation's prompt holds the tokens so far."""
    total = LONG if req.prompt_ids[1] % 5 == 4 else SHORT
    return max(1, total - (len(req.prompt_ids) - 2))


HARNESSES: list[Harness] = []
"""The harnesses the running test made (closed at its end)."""


@pytest.fixture(autouse=True)
def _close_harnesses():
    yield
    while HARNESSES:
        HARNESSES.pop().close()


class Harness:
    """The loop's part for a scheduler alone: cursor, scorer, context, engine version per step."""

    def __init__(self, prompts, engine, overrides=(), steps: int = 100):
        HARNESSES.append(self)
        self.cfg = load_config(None, [f"data.prompts_per_step={P0}", f"data.responses_per_prompt={R0}",
                                      "rollout.max_new_tokens=64", f"trainer.steps={steps}", *overrides])
        self.prompts, self.engine = prompts, engine
        self.cursor = PromptCursor(len(prompts), seed=0, shuffle=False)
        self.scored: list[str] = []
        self.completed: list[str] = []
        """Prompt ids of the groups reported complete (ctx.on_group_complete), in order."""
        self.loop = asyncio.new_event_loop()

    async def score(self, sample):
        await asyncio.sleep(TICK / 2)  # a reward takes a moment: a group must wait for its scores
        sample.reward = float(sample.response_index % 2)
        self.scored.append(sample.request_id)
        return sample

    def ctx(self, step: int) -> RolloutContext:
        return RolloutContext(cfg=self.cfg, engine=self.engine, score=self.score, cancel_scores=lambda ss: None,
                              next_prompts=lambda n: [self.prompts[i] for i in self.cursor.take(n)],
                              policy_version=step, step=step, on_group_complete=self.group_complete)

    def group_complete(self, group) -> None:
        """Plug-ins hear of a group only once every response in it is scored."""
        assert all(s.reward is not None for s in group), [s.request_id for s in group if s.reward is None]
        self.completed.append(group[0].prompt.prompt_id)

    def step(self, sched, step: int):
        """One step: the engine holds version ``step`` (the loop synced it), the batch is made,
        'training' happens, then the scheduler settles before the next sync."""
        self.engine.version = step

        async def one():
            batch = await sched.next_batch(self.ctx(step))
            await asyncio.sleep(0)  # training: the engine may generate meanwhile
            settled = await sched.before_weight_sync(step)
            assert not self.engine.running and not self.engine.waiting, "requests left across the weight sync"
            return batch, settled

        return self.loop.run_until_complete(asyncio.wait_for(one(), timeout=60))

    def close(self) -> None:
        """The engine's ticker stopped, then the loop closed (its tasks end with it, none left pending)."""
        self.loop.run_until_complete(self.engine.shutdown())
        self.loop.close()


def trained_prompt_ids(batch) -> list[str]:
    return [g[0].prompt.prompt_id for g in batch.groups]


# ---------------------------------------------------------------------------------------- partial


def test_partial_rollout_aborts_at_p0_and_keeps_every_generated_token():
    engine = FakeEngine(remaining_length, capacity=1000, tick_s=TICK)
    h = Harness(make_prompts(40), engine, ["scheduler.name=partial_rollout", "peers.partial.over_provision=1.25"])
    sched = PartialRolloutScheduler()
    batch, _ = h.step(sched, 0)
    launched = math.ceil(1.25 * P0)
    assert len(engine.submitted) == launched * R0 == batch.metrics["rollout/responses_launched"]
    # p4 is long: the first P0 complete groups are p0-p3; p4's two responses were aborted once
    # those were in, and kept with their tokens, not thrown away.
    assert sorted(trained_prompt_ids(batch)) == ["p0", "p1", "p2", "p3"]
    assert all(len(g) == R0 and all(s.reward is not None and s.round_type == "partial" for s in g)
               for g in batch.groups)
    [carried] = sched.carried
    assert carried.prompt.prompt_id == "p4" and carried.carries == 1 and not carried.finished
    n = len(carried.partial[0].response_ids)
    assert SHORT <= n < LONG and [len(s.response_ids) for s in carried.partial] == [n, n]
    assert all(s.token_versions == [0] * n and len(s.engine_logprobs) == n for s in carried.partial)
    assert batch.metrics["rollout/responses_aborted"] == 2 and batch.metrics["rollout/aborted_tokens"] == 2 * n
    assert batch.metrics["rollout/wasted_tokens"] == 0 and batch.metrics["rollout/partial/carried_tokens"] == 2 * n

    # Next step, version 1: each kept response continues from where it stopped (prompt + its
    # tokens as the prefix, the rest of the budget), before any fresh prompt is launched.
    before = len(engine.submitted)
    kept = {s.response_index: list(s.response_ids) for s in carried.partial}
    batch, _ = h.step(sched, 1)
    continued = engine.submitted[before:before + R0]
    for req in continued:
        idx = int(req.request_id.split("-r")[1].split("-")[0])
        assert req.request_id.endswith("-c1") and req.prompt_ids == [7, 4] + kept[idx]
        assert req.max_tokens == 64 - n
    # Fresh prompts fill the round up to over_provision x P0 groups.
    assert len(engine.submitted) - before == R0 + (launched - 1) * R0
    assert batch.metrics["rollout/responses_continued"] == R0


def test_a_group_carried_max_continuations_times_is_finished_first_and_versions_stay_in_bound():
    engine = FakeEngine(remaining_length, capacity=1000, tick_s=TICK)
    h = Harness(make_prompts(40), engine, ["scheduler.name=partial_rollout", "peers.partial.max_continuations=2"])
    sched = PartialRolloutScheduler()
    batches = [h.step(sched, step)[0] for step in range(4)]
    ids = [trained_prompt_ids(b) for b in batches]
    # p4 (launched at step 0) is carried twice, then due: step 2 waits for it and trains it,
    # while p9 (long too, launched at step 2) is carried on.
    assert "p4" not in ids[0] + ids[1] and "p4" in ids[2] and "p9" not in ids[2]
    assert h.completed == [p for row in ids for p in row]  # each trained group reported once, scored
    assert batches[2].metrics["rollout/partial/due_groups"] == 1
    p4 = next(g for g in batches[2].groups if g[0].prompt.prompt_id == "p4")
    # Its tokens came from three policy versions, oldest first, each part where the last stopped.
    for s in p4:
        versions = token_versions(s)
        assert versions == sorted(versions) and set(versions) == {0, 1, 2}
        assert len(s.engine_logprobs) == len(s.response_ids) == LONG and s.policy_version == 2
    for step, batch in enumerate(batches):
        assert len(batch.groups) == P0
        check_staleness(batch.samples, step, bound=2)  # never older than the declared bound
        with pytest.raises(RuntimeError, match="staleness bound of 1") if step == 2 else _nothing():
            check_staleness(batch.samples, step, bound=1)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_partial_rollout_trains_every_prompt_once_and_loses_none():
    engine = FakeEngine(remaining_length, capacity=1000, tick_s=TICK)
    prompts = make_prompts(30)
    h = Harness(prompts, engine, ["scheduler.name=partial_rollout", "peers.partial.over_provision=1.5"])
    sched = PartialRolloutScheduler()
    trained = []
    for step in range(6):
        trained += trained_prompt_ids(h.step(sched, step)[0])
    carried = [g.prompt.prompt_id for g in sched.carried]
    drawn = [prompts[i].prompt_id for i in range(h.cursor.consumed)]
    assert len(trained) == len(set(trained)) == 6 * P0
    assert sorted(trained + carried) == sorted(drawn)  # each drawn prompt trained once or still carried
    # Every finished response was scored exactly once, continued ones under their first id.
    scored = h.scored
    assert len(scored) == len(set(scored))


def test_carried_responses_survive_checkpoint_and_resume_or_are_dropped_and_counted():
    prompts = make_prompts(40)
    h = Harness(prompts, FakeEngine(remaining_length, capacity=1000, tick_s=TICK), ["scheduler.name=partial_rollout"])
    sched = PartialRolloutScheduler()
    trained = trained_prompt_ids(h.step(sched, 0)[0])
    saved, cursor_state = pickle.dumps(sched.state_dict()), h.cursor.state_dict()  # as a checkpoint holds it
    state = pickle.loads(saved)
    [kept] = state["carried"]
    assert kept["prompt"].prompt_id == "p4" and len(kept["partial"]) == R0 and kept["carries"] == 1
    kept_tokens = sum(len(s.response_ids) for s in kept["partial"])

    # Keep (the default): the restored scheduler continues p4's responses where they stopped.
    h2 = Harness(prompts, FakeEngine(remaining_length, capacity=1000, tick_s=TICK), ["scheduler.name=partial_rollout"])
    h2.cursor.load_state_dict(cursor_state)
    resumed = PartialRolloutScheduler()
    resumed.load_state_dict(state)
    got = trained + [p for step in (1, 2) for p in trained_prompt_ids(h2.step(resumed, step)[0])]
    assert any(r.request_id.endswith("-c1") and r.prompt_ids[:2] == [7, 4] for r in h2.engine.submitted)
    assert "p4" in got and len(got) == len(set(got))

    # Drop: the carried responses are forgotten, counted, and p4 starts again from scratch.
    h3 = Harness(prompts, FakeEngine(remaining_length, capacity=1000, tick_s=TICK),
                 ["scheduler.name=partial_rollout", "peers.partial.drop_on_resume=true"])
    h3.cursor.load_state_dict(cursor_state)
    dropped = PartialRolloutScheduler()
    dropped.load_state_dict(pickle.loads(saved))
    batch, _ = h3.step(dropped, 1)
    assert batch.metrics["rollout/partial/dropped_responses"] == R0
    assert batch.metrics["rollout/partial/dropped_tokens"] == batch.metrics["rollout/wasted_tokens"] == kept_tokens > 0
    assert not any("-c" in r.request_id for r in h3.engine.submitted)
    relaunched = [r for r in h3.engine.submitted if r.prompt_ids == [7, 4]]
    assert len(relaunched) == R0 and all(r.request_id.startswith("s1-") for r in relaunched)
    later = [p for step in (2, 3) for p in trained_prompt_ids(h3.step(dropped, step)[0])]
    got = trained + trained_prompt_ids(batch) + later
    assert "p4" in got and len(got) == len(set(got))  # not lost, not trained twice


def test_partial_rollout_settings_are_checked_naming_the_key():
    for bad in ("peers.partial.over_provision=2.5", "peers.partial.over_provision=0.9",
                "peers.partial.max_continuations=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            validate(load_config(None, ["scheduler.name=partial_rollout", bad]), device="cpu")
    cfg = load_config(None, ["scheduler.name=partial_rollout", "peers.partial.max_continuations=3"])
    validate(cfg, device="cpu")
    assert PartialRolloutScheduler().max_staleness(cfg) == 3


# ---------------------------------------------------------------------------------------- one step off


def test_one_step_off_generates_the_next_batch_while_this_one_trains():
    engine = FakeEngine(lambda req: 5 + req.seed % 7, capacity=1000)
    h = Harness(make_prompts(40), engine, ["scheduler.name=one_step_off"], steps=4)
    sched = OneStepOffScheduler()
    assert sched.max_staleness(h.cfg) == 1
    seen, versions = [], []
    for step in range(4):
        before = len(engine.submitted)
        batch, settled = h.step(sched, step)
        seen += trained_prompt_ids(batch)
        versions.append({v for s in batch.samples for v in token_versions(s)})
        assert len(batch.groups) == P0 and batch.round_type == "one_step_off"
        assert batch.metrics["rollout/prefetched"] == float(step > 0)
        if step + 1 < 4:
            # Step t+1's requests (its seeds and ids) went out during step t, on version t.
            ahead = engine.submitted[len(engine.submitted) - P0 * R0:]
            assert all(r.request_id.startswith(f"s{step + 1}-") for r in ahead)
            assert "time/rollout_wait" in settled and list(sched.ready) == [step + 1]
        else:
            assert settled == {} and sched.ready == {}  # the last step starts nothing ahead
            assert len(engine.submitted) == before
    # Step 0 trains on-policy; every later batch is exactly one version old.
    assert versions == [{0}, {0}, {1}, {2}]
    assert len(seen) == len(set(seen)) == 4 * P0


def test_one_step_off_checkpoints_the_prefetched_batch():
    prompts = make_prompts(40)
    h = Harness(prompts, FakeEngine(lambda req: 5, capacity=1000), ["scheduler.name=one_step_off"], steps=4)
    sched = OneStepOffScheduler()
    trained = trained_prompt_ids(h.step(sched, 0)[0])
    state, cursor_state = pickle.loads(pickle.dumps(sched.state_dict())), h.cursor.state_dict()
    assert list(state["ready_by_step"]) == [1] and len(state["ready_by_step"][1].groups) == P0
    h2 = Harness(prompts, FakeEngine(lambda req: 5, capacity=1000), ["scheduler.name=one_step_off"], steps=4)
    h2.cursor.load_state_dict(cursor_state)
    resumed = OneStepOffScheduler()
    resumed.load_state_dict(state)
    batch, _ = h2.step(resumed, 1)
    assert trained_prompt_ids(batch) == trained_prompt_ids(state["ready_by_step"][1])  # trained, not regenerated
    assert not any(r.request_id.startswith("s1-") for r in h2.engine.submitted)
    trained += trained_prompt_ids(batch) + trained_prompt_ids(h2.step(resumed, 2)[0])
    assert len(trained) == len(set(trained)) == 3 * P0


def test_k_steps_ahead_fills_the_pipeline_then_generates_one_batch_per_step():
    """peers.one_step_off.max_staleness=2: step 0 generates the batches of steps 1 and 2 (on
    version 0), each later step the batch two steps on; each batch trains k = 2 versions after
    the weights that made it once the pipeline is full; the last steps start nothing past the end."""
    engine = FakeEngine(lambda req: 5 + req.seed % 7, capacity=1000)
    h = Harness(make_prompts(40), engine, ["scheduler.name=one_step_off", "peers.one_step_off.max_staleness=2"],
                steps=5)
    sched = OneStepOffScheduler()
    assert sched.max_staleness(h.cfg) == 2
    seen, versions, submitted_for = [], [], []
    for step in range(5):
        before = len(engine.submitted)
        batch, settled = h.step(sched, step)
        seen += trained_prompt_ids(batch)
        versions.append({v for s in batch.samples for v in token_versions(s)})
        assert batch.metrics["rollout/prefetched"] == float(step > 0)
        submitted_for.append(sorted({r.request_id.split("-")[0] for r in engine.submitted[before:]}))
        assert sorted(sched.ready) == [s for s in range(step + 1, min(step + 2, 4) + 1)]
        assert ("time/rollout_wait" in settled) == (step < 3)
    assert submitted_for == [["s0", "s1", "s2"], ["s3"], ["s4"], [], []]
    assert versions == [{0}, {0}, {0}, {1}, {2}]  # staleness 0, 1, 2, 2, 2
    for step, vs in enumerate(versions):
        assert step - max(vs) <= 2
    # The cursor handed prompts out in step order: the batches are consecutive slices of it.
    assert seen == [f"p{i}" for i in range(5 * P0)]


def test_k_steps_ahead_checkpoints_every_waiting_batch_and_reads_the_one_batch_format():
    prompts = make_prompts(40)
    args = ["scheduler.name=one_step_off", "peers.one_step_off.max_staleness=3"]
    h = Harness(prompts, FakeEngine(lambda req: 5, capacity=1000), args, steps=6)
    sched = OneStepOffScheduler()
    trained = trained_prompt_ids(h.step(sched, 0)[0]) + trained_prompt_ids(h.step(sched, 1)[0])
    state, cursor_state = pickle.loads(pickle.dumps(sched.state_dict())), h.cursor.state_dict()
    assert sorted(state["ready_by_step"]) == [2, 3, 4]
    h2 = Harness(prompts, FakeEngine(lambda req: 5, capacity=1000), args, steps=6)
    h2.cursor.load_state_dict(cursor_state)
    resumed = OneStepOffScheduler()
    resumed.load_state_dict(state)
    for step in range(2, 6):
        trained += trained_prompt_ids(h2.step(resumed, step)[0])
    # Only step 5's batch was generated after the resume; none lost or trained twice.
    assert sorted({r.request_id.split("-")[0] for r in h2.engine.submitted}) == ["s5"]
    assert trained == [f"p{i}" for i in range(6 * P0)]
    # A checkpoint written before max_staleness existed: one batch and the step it is for.
    old = OneStepOffScheduler()
    old.load_state_dict({"ready": state["ready_by_step"][2], "ready_for": 2})
    assert list(old.ready) == [2]
    old.load_state_dict({"ready": None, "ready_for": -1})
    assert old.ready == {}


def test_one_step_off_refuses_sleeping_engines():
    with pytest.raises(ConfigError, match="rollout.sleep_during_train cannot be used with scheduler.name=one_step_off"):
        validate(load_config(None, ["scheduler.name=one_step_off", "rollout.sleep_during_train=true"]), device="cpu")
    validate(load_config(None, ["scheduler.name=baseline", "rollout.sleep_during_train=true"]), device="cpu")
    with pytest.raises(ConfigError, match="peers.one_step_off.max_staleness: must be >= 1"):
        validate(load_config(None, ["scheduler.name=one_step_off", "peers.one_step_off.max_staleness=0"]), device="cpu")
