"""Tail batching on a fake engine: short/long rounds, the long-prompt queue, aborts, DAPO refills,
exactly-once over an epoch, checkpointed queue. (The real engine runs it in the integration tests
and in rollpacker-benchmark.)"""
from __future__ import annotations

import math

import pytest

from megatron_rl.config.schema import RunConfig
from rollpacker.tail_batching import RefillLimitError, TailBatchingScheduler
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tail_batching_harness import P0, R0, Harness, lengths, make_prompts


def test_short_round_keeps_first_r0_and_first_p0_prompts_then_aborts_the_rest():
    engine = FakeEngine(lengths(), capacity=1000)
    h = Harness(make_prompts(40), engine)
    sched = TailBatchingScheduler()
    batch = h.run(sched, 0)
    n_prompts, n_resp = math.ceil(1.25 * P0), math.ceil(1.25 * R0)
    assert batch.round_type == "short"
    assert len(engine.submitted) == n_prompts * n_resp == batch.metrics["rollout/responses_launched"]
    # p4 is the long prompt of the first five: it did not complete and went whole into the queue.
    assert sorted(g[0].prompt.prompt_id for g in batch.groups) == ["p0", "p1", "p2", "p3"]
    assert [p.prompt_id for p in sched.queue] == ["p4"]
    for group in batch.groups:
        assert len(group) == R0 and all(s.reward is not None and s.round_type == "short" for s in group)
        # The kept responses are the first R0 to finish: the shortest of the eta_R x R0.
        pid = group[0].prompt.prompt_id
        all_lengths = sorted(5 + r.seed % 7 for r in engine.submitted if f"-{pid}-" in r.request_id)
        assert sorted(len(s.response_ids) for s in group) == all_lengths[:R0]
    # Everything unfinished was aborted; nothing is left running in the engine.
    assert not engine.running and not engine.waiting
    assert batch.metrics["rollout/responses_aborted"] == len(engine.aborted) >= n_resp  # p4's responses
    assert batch.metrics["rollout/aborted_tokens"] > 0
    assert batch.metrics["rollout/wasted_tokens"] >= batch.metrics["rollout/aborted_tokens"]
    assert batch.metrics["rollout/length_bias/ratio"] <= 1.0


def test_extra_responses_have_their_reward_work_cancelled():
    engine = FakeEngine(lengths(), capacity=1000)
    h = Harness(make_prompts(40), engine)
    batch = h.run(TailBatchingScheduler(), 0)
    kept = {s.request_id for g in batch.groups for s in g}
    # The 5th finished response of every complete prompt was cancelled, never kept.
    assert h.cancelled and not (set(h.cancelled) & kept)


def test_long_round_after_four_short_rounds_and_exactly_once():
    engine = FakeEngine(lengths(), capacity=1000)
    h = Harness(make_prompts(20), engine)
    sched = TailBatchingScheduler()
    rounds, trained = [], []
    for step in range(5):
        before = len(engine.submitted)
        batch = h.run(sched, step)
        rounds.append(batch.round_type)
        trained += [g[0].prompt.prompt_id for g in batch.groups]
        if batch.round_type == "long":
            # No over-provisioning: exactly P0 x R0 requests, nothing aborted.
            assert len(engine.submitted) - before == P0 * R0
            assert batch.metrics["rollout/responses_aborted"] == 0
            assert all(len(g) == R0 and g[0].round_type == "long" for g in batch.groups)
    assert rounds == ["short"] * 4 + ["long"]
    assert sorted(trained, key=lambda p: int(p[1:])) == [f"p{i}" for i in range(20)]  # each exactly once
    assert len(sched.queue) == 0


def test_queue_survives_checkpoint_and_resume():
    h = Harness(make_prompts(20), FakeEngine(lengths(), capacity=1000))
    sched = TailBatchingScheduler()
    trained = []
    for step in range(2):
        trained += [g[0].prompt.prompt_id for g in h.run(sched, step).groups]
    state, cursor_state = sched.state_dict(), h.cursor.state_dict()
    assert [p.prompt_id for p in state["queue"]] == ["p4", "p9"]
    # "Restart": a fresh scheduler, cursor and engine restored from the checkpointed state.
    h2 = Harness(make_prompts(20), FakeEngine(lengths(), capacity=1000))
    h2.cursor.load_state_dict(cursor_state)
    resumed = TailBatchingScheduler()
    resumed.load_state_dict(state)
    for step in range(2, 5):
        trained += [g[0].prompt.prompt_id for g in h2.run(resumed, step).groups]
    assert sorted(trained, key=lambda p: int(p[1:])) == [f"p{i}" for i in range(20)]


def test_eta_one_means_no_over_provisioning():
    engine = FakeEngine(lengths(long_every=1000), capacity=1000)
    h = Harness(make_prompts(20), engine, eta_p=1.0, eta_r=1.0)
    batch = h.run(TailBatchingScheduler(), 0)
    assert len(engine.submitted) == P0 * R0 and not engine.aborted
    assert batch.metrics["rollout/length_bias/ratio"] == pytest.approx(1.0)


def test_dapo_filters_zero_variance_groups_and_refills():
    engine = FakeEngine(lengths(long_every=1000), capacity=1000)
    # Even-numbered prompts get the same reward for every response (zero variance).
    h = Harness(make_prompts(40), engine, dapo=True,
                reward_fn=lambda s: 1.0 if int(s.prompt.prompt_id[1:]) % 2 == 0 else float(s.response_index % 2))
    sched = TailBatchingScheduler()
    batch = h.run(sched, 0)
    ids = [g[0].prompt.prompt_id for g in batch.groups]
    assert len(ids) == P0 and all(int(p[1:]) % 2 == 1 for p in ids)
    assert batch.filtered_prompt_ids and all(int(p[1:]) % 2 == 0 for p in batch.filtered_prompt_ids)
    assert batch.metrics["rollout/refills"] >= 1
    # Filtered groups never enter the queue.
    assert not set(batch.filtered_prompt_ids) & {p.prompt_id for p in sched.queue}


def test_dapo_refill_bound_is_a_clear_error():
    h = Harness(make_prompts(40), FakeEngine(lengths(long_every=1000), capacity=1000), dapo=True,
                reward_fn=lambda s: 1.0, max_refills=2)
    with pytest.raises(RefillLimitError, match="tail_batching.max_refills"):
        h.run(TailBatchingScheduler(), 0)


def test_samples_carry_the_current_policy_version():
    engine = FakeEngine(lengths(), capacity=1000)
    engine.version = 0
    h = Harness(make_prompts(20), engine)
    batch = h.run(TailBatchingScheduler(), 0)
    assert {s.policy_version for s in batch.samples} == {0}


TAIL_BATCHING_KEYS = ("eta_prompts", "eta_responses", "max_refills", "history_routing", "history_responses",
                      "history_response_tokens", "history_prompts")


def test_tail_batching_settings_are_rollpackers_section_not_the_cores():
    from dataclasses import fields

    from megatron_rl.config.schema import SchedulerConfig, plugin_sections

    assert [f.name for f in fields(SchedulerConfig)] == ["name"]
    section, _ = plugin_sections()["tail_batching"]
    assert tuple(f.name for f in fields(section)) == TAIL_BATCHING_KEYS
    cfg = RunConfig()
    assert (cfg.tail_batching.eta_prompts, cfg.tail_batching.max_refills) == (1.25, 4)


@pytest.mark.parametrize("key", TAIL_BATCHING_KEYS)
def test_an_old_scheduler_key_fails_naming_its_new_key(key, tmp_path):
    from megatron_rl.config.loading import load_config
    from megatron_rl.config.values import ConfigError

    value = "true" if key == "history_routing" else "2"
    new = rf"did you mean 'tail_batching\.{key}'\?"
    with pytest.raises(ConfigError, match=rf"unknown key 'scheduler\.{key}' in command-line override .*{new}"):
        load_config(None, [f"scheduler.{key}={value}"])
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"scheduler:\n  name: tail_batching\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=rf"unknown key 'scheduler\.{key}' in {recipe}.*{new}"):
        load_config(recipe)
    assert getattr(load_config(None, [f"tail_batching.{key}={value}"]).tail_batching, key) in (True, 2)


@pytest.mark.parametrize("override", ["tail_batching.eta_prompts=0.9", "tail_batching.eta_responses=0.5",
                                      "tail_batching.max_refills=-1", "tail_batching.history_responses=-1",
                                      "tail_batching.history_response_tokens=0", "tail_batching.history_prompts=0"])
def test_bad_tail_batching_settings_are_refused_naming_the_key(override):
    from megatron_rl.config.loading import load_config
    from megatron_rl.config.validation import validate
    from megatron_rl.config.values import ConfigError

    key = override.split("=")[0]
    cfg = load_config(None, [override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, device="cpu")
    validate(load_config(None, []), device="cpu")  # the defaults pass


def test_the_core_reads_no_tail_batching_setting():
    """Only RollPacker reads them; megatron_rl may call the scheduler's own methods."""
    import re
    from pathlib import Path

    import megatron_rl

    pattern = re.compile(r"\.(?:scheduler|tail_batching)\.(?:" + "|".join(TAIL_BATCHING_KEYS) + r")\b")
    readers = [f"{path}:{n}" for path in sorted(Path(megatron_rl.__file__).parent.rglob("*.py"))
               for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not readers, readers
