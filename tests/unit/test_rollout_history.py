"""Rollout history (rollpacker.history) and its use by tail batching on the fake engine:
references for the drafter, long-prompt prediction scored against outcomes, history routing,
bounded memory, checkpoint round trip."""
from __future__ import annotations

from collections import Counter

import pytest

from megatron_rl.loop.hooks import RolloutContext
from rollpacker.history import RolloutHistory
from rollpacker.tail_batching import TailBatchingScheduler
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tail_batching_harness import Harness, lengths, make_prompts

STEPS_PER_EPOCH = 5  # 20 prompts: four short rounds of ceil(1.25 x 4) = 5 prompts, one long round


def test_history_is_bounded_newest_first_and_predicts_from_earlier_epochs_only():
    h = RolloutHistory(max_prompts=2, max_responses=2, max_tokens=3)
    for i in range(3):
        h.add_response("a", [i, i, i, i, i])
    assert h.references("a") == [[2, 2, 2], [1, 1, 1]]  # newest first, cut to 3 tokens, 2 kept
    h.set_outcome("a", 0, "long")
    assert not h.predicts_long("a", 0) and h.predicts_long("a", 1)  # only an earlier epoch counts
    h.seen("b", 0)
    h.seen("c", 0)  # a third prompt drops the least recently seen ('a')
    assert h.get("a") is None and len(h) == 2
    h.add_response("b", [9])
    copy = RolloutHistory(max_prompts=2, max_responses=2, max_tokens=3)
    copy.load_state_dict(h.state_dict())
    assert copy.state_dict() == h.state_dict() and copy.references("b") == [[9]]
    with pytest.raises(ValueError, match="outcome"):
        h.set_outcome("b", 0, "medium")
    none = RolloutHistory(max_responses=0)
    none.add_response("x", [1])
    assert none.references("x") == []


class EpochHarness(Harness):
    def ctx(self, step: int) -> RolloutContext:
        ctx = super().ctx(step)
        ctx.epoch = lambda: self.cursor.epoch
        take = ctx.next_prompts

        def next_prompts(n):
            prompts = take(n)
            self.drawn.extend(p.prompt_id for p in prompts)
            return prompts

        ctx.next_prompts = next_prompts
        return ctx


def run_epochs(routing: bool, epochs: int = 2):
    engine = FakeEngine(lengths(), capacity=1000)
    h = EpochHarness(make_prompts(20), engine)
    h.drawn = []
    h.cfg.tail_batching.history_routing = routing
    h.cfg.rollout.speculative.method, h.cfg.rollout.speculative.rounds = "suffix", "short,long"
    sched = TailBatchingScheduler()
    rows, trained = [], []
    for step in range(epochs * STEPS_PER_EPOCH):
        batch = h.run(sched, step)
        rows.append(dict(batch.metrics, round_type=batch.round_type))
        trained.append([g[0].prompt.prompt_id for g in batch.groups])
    return rows, trained, engine, sched, h.drawn


def total(rows, key, steps):
    return sum(rows[s][key] for s in steps)


def test_prediction_is_scored_without_routing_and_routing_saves_aborted_tokens():
    plain, plain_trained, _, plain_sched, plain_drawn = run_epochs(routing=False)
    routed, routed_trained, engine, sched, routed_drawn = run_epochs(routing=True)
    first, second = range(STEPS_PER_EPOCH), range(STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH)
    long_prompts = {f"p{i}" for i in range(4, 20, 5)}  # the fake engine's 200-tick prompts
    # First epoch: nothing is known, nothing predicted.
    assert total(plain, "rollout/history/true_long", first) + total(plain, "rollout/history/true_short", first) == 0
    # Second epoch, routing off: every long prompt is launched, predicted long and queued again.
    assert total(plain, "rollout/history/true_long", second) == len(long_prompts)
    assert total(plain, "rollout/history/false_long", second) == total(plain, "rollout/history/false_short", second) == 0
    assert total(plain, "rollout/history/true_short", second) == 20 - len(long_prompts)
    assert plain[-1]["rollout/history/prompts"] == 20
    # Routing on: the long prompts go to the queue without a launch, so their aborted tokens are saved.
    assert total(routed, "rollout/history/routed", second) == len(long_prompts)
    assert total(routed, "rollout/history/true_long", second) == 0  # routed prompts are not launched
    aborted = {name: total(rows, "rollout/aborted_tokens", second) for name, rows in (("plain", plain), ("routed", routed))}
    assert aborted["routed"] < aborted["plain"], aborted
    # No short-round request (only short rounds launch a fifth response, index 4) of a long
    # prompt in the second epoch.
    assert not [r.request_id for r in engine.submitted if r.prompt_ids[1] % 5 == 4 and r.request_id.endswith("-r4")
                and int(r.request_id.split("-")[0][1:]) >= STEPS_PER_EPOCH]
    # Exactly once: every prompt drawn is trained or still waits in the queue (routing moves
    # long rounds earlier, so epochs and steps do not line up the same way in both runs).
    for trained, drawn, queue in ((plain_trained, plain_drawn, plain_sched.queue),
                                  (routed_trained, routed_drawn, sched.queue)):
        assert Counter(p for step in trained for p in step) + Counter(p.prompt_id for p in queue) == Counter(drawn)
        assert max(Counter(drawn).values()) <= 3 and len(set(drawn)) == 20
    # Second-epoch requests carry earlier responses of their prompt as draft references.
    second_reqs = [r for r in engine.submitted if int(r.request_id.split("-")[0][1:]) >= STEPS_PER_EPOCH]
    assert second_reqs and all(r.draft_references for r in second_reqs)
    # The checkpointed state restores the predictions.
    fresh = TailBatchingScheduler()
    fresh.load_state_dict(sched.state_dict())
    assert fresh.state_dict() == sched.state_dict()
    assert all(fresh.history.predicts_long(p, 9) for p in long_prompts)
    assert [fresh.history.predicts_long(f"p{i}", 9) for i in range(20)] == [
        sched.history.predicts_long(f"p{i}", 9) for i in range(20)]



@pytest.mark.parametrize("routing", [False, True])
def test_small_data_set_never_launches_a_prompt_twice_in_a_round(routing):
    """8 prompts, P0 = 4: prompts wait in the queue while the cursor hands them out again (found
    by the loop test: vLLM refused a second request with the same id)."""
    engine = FakeEngine(lengths(long_every=3), capacity=1000)
    h = EpochHarness(make_prompts(8, long_every=3), engine)
    h.drawn = []
    h.cfg.tail_batching.history_routing = routing
    sched = TailBatchingScheduler()
    trained = []
    for step in range(12):
        batch = h.run(sched, step)
        ids = [r.request_id for r in engine.submitted if r.request_id.startswith(f"s{step}-")]
        assert len(ids) == len(set(ids)), ids
        groups = [g[0].prompt.prompt_id for g in batch.groups]
        assert len(groups) == len(set(groups)) == 4
        trained += groups
    assert Counter(trained) + Counter(p.prompt_id for p in sched.queue) == Counter(h.drawn)
