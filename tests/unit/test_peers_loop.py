"""The off-policy seam in the loop, in seconds: ``Trainer`` with a fake engine and a fake policy
whose logprobs are a function of the weight version (tests/helpers/versioned_fakes.py), the
in-process reward pool grading the fake answers.

* each peer trains its older tokens with the engine's logprobs as the behaviour policy and the
  truncated importance weight against the current policy (exp(-0.1 k) for a token k versions
  old here), under both ways of getting the old logprobs (a scoring pass, the training forward);
  parity is measured on on-policy tokens only; the off-policy metrics are in every step;
* one-step-off never lets a request run across a weight sync (the fake engine refuses the reload);
* checkpoint and resume keep the carried responses / the prefetched batch(es, two steps ahead):
  every prompt is trained exactly once across the resume;
* the strict on-policy check still refuses stale samples for the baseline and tail batching, and
  a peer's check refuses anything older than its declared bound.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import signal

import pytest

from megatron_rl.config.loading import apply_override
from megatron_rl.config.plugins import load_plugin_packages, make_scheduler
from megatron_rl.config.schema import RunConfig
from megatron_rl.config.tis import resolve_off_policy_tis
from megatron_rl.data.datasets import apply_chat_template
from megatron_rl.loop.trainer import Trainer, TrainerParts
from megatron_rl.sample import Prompt, Sample
from tests.helpers.versioned_fakes import AnsweringEngine, VersionedPolicy

P0, R0 = 4, 2
TICK = 0.003


def make_parts(tmp_path, tokenizer, tokenizer_dir, scheduler, *, steps=4, overrides=(), run="run") -> TrainerParts:
    from megatron_rl.reward.pool.reward_pool import RewardPool

    load_plugin_packages()
    cfg = RunConfig()
    for assignment in [f"model.hf_path={tokenizer_dir}", f"trainer.run_dir={tmp_path / run}", f"trainer.steps={steps}",
                       f"data.prompts_per_step={P0}", f"data.responses_per_prompt={R0}", "trainer.tensorboard=false",
                       "trainer.progress_bar=false", "reward.num_workers=1", "rollout.max_new_tokens=48",
                       "rollout.weight_sync_format=hf", "data.shuffle=false", f"scheduler.name={scheduler}", *overrides]:
        apply_override(cfg, assignment)
    sched = make_scheduler(cfg)
    resolve_off_policy_tis(cfg, sched.max_staleness(cfg))  # as megatron_rl.train does
    prompts = [Prompt(prompt_id=f"q:{i}", token_ids=apply_chat_template(tokenizer, f"What is {i} - {i} + 7?"),
                      answer="7", text=f"What is {i} - {i} + 7?", metadata={"format": "gsm8k"}) for i in range(64)]
    lengths = {p.prompt_id: len(p.token_ids) for p in prompts}

    def length(req) -> int:  # q:i with i % 4 == 0 is long; a continuation generates what is left
        match = re.search(r"q:(\d+)", req.request_id)
        if match is None:
            return 4  # the warm-up request
        i = int(match.group(1))
        total = 40 + i if i % 4 == 0 else 12  # the long ones differ: one of two finishes first
        return max(1, total - (len(req.prompt_ids) - lengths[f"q:{match.group(1)}"]))

    return TrainerParts(cfg=cfg, policy=VersionedPolicy(cfg), engine=AnsweringEngine(tokenizer, length, tick_s=TICK),
                        rewards=RewardPool.from_run_config(cfg, use_ray=False), train_prompts=prompts,
                        eval_prompts=[], scheduler=sched, weight_sync_dir=str(tmp_path / run / "weights"), on_cpu=True)


def run(parts: TrainerParts) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(parts)
    try:
        return trainer, asyncio.run(asyncio.wait_for(trainer.run(), timeout=120))
    finally:
        parts.rewards.shutdown()


def trained_rows(parts: TrainerParts) -> list[list[str]]:
    path = parts.cfg.trainer.run_dir + "/trained_prompts.jsonl"
    return [json.loads(line)["prompt_ids"] for line in open(path)]


RECOMPUTE = pytest.mark.parametrize("recompute", ["algorithm.recompute_old_logprobs=true",
                                                  "algorithm.recompute_old_logprobs=null"])


@RECOMPUTE
def test_partial_rollout_trains_stale_tokens_with_truncated_importance_weights(tmp_path, tokenizer, tokenizer_dir,
                                                                               recompute):
    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, "partial_rollout", steps=4, overrides=[recompute])
    assert parts.cfg.algorithm.tis_cap == 2.0  # turned on by the scheduler's bound (off_policy_tis_cap)
    trainer, history = run(parts)
    assert trainer.max_staleness == 2 and [m["round_type"] for m in history] == ["partial"] * 4
    stale_steps = 0
    for m, trained in zip(history, parts.policy.trained):
        assert m["batch/samples_trained"] == P0 * R0
        # Parity over the tokens the current weights generated only: exact here, whatever the rest.
        assert m["rollout/logprob_abs_diff_max"] == 0.0
        lags = [lag for s in trained for lag in (s.staleness or [0] * len(s.response_ids))]
        assert m["off_policy/token_fraction"] == pytest.approx(sum(lag > 0 for lag in lags) / len(lags))
        assert m["off_policy/staleness_max"] == max(lags) <= 2
        if max(lags) == 0:
            assert not any(s.staleness for s in trained) and "off_policy/tis_weight_mean" not in m
            continue
        stale_steps += 1
        # Each stale token weighs min(pi_now / pi_behaviour, cap) = exp(-0.1 x its lag).
        stale = [lag for lag in lags if lag]
        assert m["off_policy/tis_weight_mean"] == pytest.approx(sum(math.exp(-0.1 * k) for k in stale) / len(stale))
        assert m["off_policy/tis_weight_max"] == pytest.approx(math.exp(-0.1 * min(stale)))
        assert m["train/tis_weight_mean"] < 1.0
    assert stale_steps >= 2  # the long prompts were carried and continued
    assert sum(m["rollout/responses_continued"] for m in history) > 0
    rows = trained_rows(parts)
    flat = [p for r in rows for p in r]
    assert len(flat) == len(set(flat)) == 4 * P0


@RECOMPUTE
def test_one_step_off_trains_one_version_old_batches_and_never_syncs_under_running_requests(
        tmp_path, tokenizer, tokenizer_dir, recompute):
    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, "one_step_off", steps=4, overrides=[recompute])
    # The fake engine refuses a reload with requests in flight: the loop's before_weight_sync
    # must have ended the overlapping rollout first.
    trainer, history = run(parts)
    assert trainer.max_staleness == 1
    assert [m["off_policy/staleness_max"] for m in history] == [0.0, 1.0, 1.0, 1.0]
    assert [m["off_policy/token_fraction"] for m in history] == [0.0, 1.0, 1.0, 1.0]
    assert "rollout/logprob_abs_diff_max" in history[0] and history[0]["rollout/logprob_abs_diff_max"] == 0.0
    for m in history[1:]:
        assert "rollout/logprob_abs_diff_max" not in m  # no on-policy token to hold against the engine
        assert m["off_policy/tis_weight_mean"] == pytest.approx(math.exp(-0.1))
        assert m["rollout/prefetched"] == 1.0
    assert all("time/rollout_wait" in m for m in history[:-1]) and "time/rollout_wait" not in history[-1]
    assert parts.policy.scored == (4 if recompute.endswith("true") else 0)
    flat = [p for r in trained_rows(parts) for p in r]
    assert len(flat) == len(set(flat)) == 4 * P0


def test_one_step_off_two_steps_ahead_trains_each_batch_at_its_lag_and_resumes_with_both_waiting(
        tmp_path, tokenizer, tokenizer_dir):
    k2 = "peers.one_step_off.max_staleness=2"
    from megatron_rl.runtime.graceful_stop import GracefulStop

    # A SIGTERM before the run: it stops after step 0, whose checkpoint holds steps 1 and 2's batches.
    first = make_parts(tmp_path, tokenizer, tokenizer_dir, "one_step_off", steps=5, overrides=[k2])
    first.stop = GracefulStop()
    first.stop.handle(signal.SIGTERM)
    trainer, history = run(first)
    assert trainer.max_staleness == 2 and len(history) == 1
    assert history[0]["rollout/batches_ahead"] == 2.0
    resumed = make_parts(tmp_path, tokenizer, tokenizer_dir, "one_step_off", steps=5,
                         overrides=[k2, "trainer.resume=true"])
    _, history = run(resumed)
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    assert [m["rollout/prefetched"] for m in history] == [1.0] * 4
    # Steps 1 and 2 trained what step 0 generated (version 0); 3 and 4 what steps 1 and 2 did.
    assert [m["off_policy/staleness_max"] for m in history] == [1.0, 2.0, 2.0, 2.0]
    for m, lag in zip(history, (1, 2, 2, 2)):
        assert m["off_policy/tis_weight_mean"] == pytest.approx(math.exp(-0.1 * lag))
    flat = [p for r in trained_rows(resumed) for p in r]
    assert len(flat) == len(set(flat)) == 5 * P0


@pytest.mark.parametrize("scheduler", ["partial_rollout", "one_step_off"])
def test_resume_keeps_what_each_peer_carries_and_trains_every_prompt_once(tmp_path, tokenizer, tokenizer_dir,
                                                                          scheduler):
    from megatron_rl.runtime.graceful_stop import GracefulStop

    # A SIGTERM before the run: it stops after step 0 with a checkpoint (step_000001) holding
    # the carried responses (partial) or step 1's prefetched batch (one-step-off).
    first = make_parts(tmp_path, tokenizer, tokenizer_dir, scheduler, steps=4)
    first.stop = GracefulStop()
    first.stop.handle(signal.SIGTERM)
    _, history = run(first)
    assert len(history) == 1 and first.stop.stopped_after == 0
    resumed = make_parts(tmp_path, tokenizer, tokenizer_dir, scheduler, steps=4, overrides=["trainer.resume=true"])
    trainer, history = run(resumed)
    assert [m["step"] for m in history] == [1, 2, 3]
    rows = trained_rows(resumed)
    flat = [p for r in rows for p in r]
    assert len(rows) == 4 and len(flat) == len(set(flat)) == 4 * P0  # none lost, none twice across the resume
    if scheduler == "one_step_off":
        assert history[0]["rollout/prefetched"] == 1.0  # the checkpointed batch, trained not regenerated
        assert history[0]["off_policy/staleness_max"] == 1.0
    else:
        assert any(r.request_id.endswith("-c1") for r in resumed.engine.submitted)  # continued after the resume


@pytest.mark.parametrize("scheduler", ["baseline", "tail_batching"])
def test_the_strict_check_still_refuses_stale_samples(tmp_path, tokenizer, tokenizer_dir, scheduler):
    trainer = Trainer(make_parts(tmp_path, tokenizer, tokenizer_dir, scheduler))
    try:
        assert trainer.max_staleness == 0 and trainer.cfg.algorithm.tis_cap == 0.0
        trainer.version = 3
        prompt = trainer.p.train_prompts[0]
        old = Sample(prompt=prompt, response_index=0, request_id="old", policy_version=2, response_ids=[1, 2])
        with pytest.raises(RuntimeError, match=r"not generated by the current policy version 3 \(e.g. \['old'\]\)"):
            trainer._check_on_policy([old])
        # A sample of the current version with one token of an older one is refused too.
        mixed = Sample(prompt=prompt, response_index=1, request_id="mixed", policy_version=3, response_ids=[1, 2],
                       token_versions=[2, 3])
        with pytest.raises(RuntimeError, match=r"e.g. \['mixed'\]"):
            trainer._check_on_policy([mixed])
        current = Sample(prompt=prompt, response_index=2, request_id="now", policy_version=3, response_ids=[1, 2])
        trainer._check_on_policy([current])
        assert current.staleness == []  # an on-policy batch trains exactly as before
    finally:
        trainer.p.rewards.shutdown()


def test_a_peer_check_refuses_tokens_beyond_its_declared_bound(tmp_path, tokenizer, tokenizer_dir):
    trainer = Trainer(make_parts(tmp_path, tokenizer, tokenizer_dir, "partial_rollout",
                                 overrides=["peers.partial.max_continuations=2"]))
    try:
        trainer.version = 5
        prompt = trainer.p.train_prompts[0]
        ok = Sample(prompt=prompt, response_index=0, request_id="ok", policy_version=5, response_ids=[1, 2, 3],
                    token_versions=[3, 4, 5])
        trainer._check_on_policy([ok])
        assert ok.staleness == [2, 1, 0]
        too_old = Sample(prompt=prompt, response_index=1, request_id="old", policy_version=5, response_ids=[1, 2],
                         token_versions=[2, 5])
        future = Sample(prompt=prompt, response_index=2, request_id="future", policy_version=6, response_ids=[1])
        for bad in (too_old, future):
            with pytest.raises(RuntimeError, match="declared a staleness bound of 2"):
                trainer._check_on_policy([bad])
    finally:
        trainer.p.rewards.shutdown()
