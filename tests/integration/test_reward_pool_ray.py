"""The reward pool on real Ray actors: scoring in workers, dispatch, timeouts, cancel."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from megatron_rl.config.schema import AlgorithmConfig, RewardConfig
from megatron_rl.reward.pool.reward_pool import RewardPool
from megatron_rl.sample import Prompt, Sample

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def make_sample(tokenizer, prompt_id: str, index: int, text: str, answer: str) -> Sample:
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return Sample(prompt=Prompt(prompt_id=prompt_id, token_ids=[1], answer=answer),
                  response_index=index, response_ids=ids, finish_reason="stop")


def test_ray_pool_scores_in_two_workers(ray_session, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = RewardConfig(num_workers=2, worker_num_cpus=0.25, timeout_s=2.0, timeout_reward=-0.1)
    pool = RewardPool(cfg, str(tokenizer_dir), max_new_tokens=256, algorithm_cfg=AlgorithmConfig())
    try:
        pool.ready(timeout_s=120)
        slow = make_sample(tok, "p", 0, "\\boxed{(10^{10^{10}})!}", "5")   # hangs sympy
        fast = [
            make_sample(tok, "p", 1, "\\boxed{5}", "5"),
            make_sample(tok, "p", 2, "#### 6", "5"),
            make_sample(tok, "q", 0, "\\boxed{\\frac{2}{4}}", "#### 0.5"),
            make_sample(tok, "q", 1, "nothing", "#### 0.5"),
        ]
        slow_handle = pool.submit(slow)
        handles = [pool.submit(s) for s in fast]
        # Least-loaded: the slow task occupies worker 0 only briefly in the queue view, but
        # both workers must receive work.
        assert {h.worker for h in [slow_handle, *handles]} == {0, 1}
        pool.wait([slow_handle, *handles], timeout_s=120)
        assert [s.reward for s in fast] == [1.0, 0.0, 1.0, 0.0]
        assert [s.correct for s in fast] == [True, False, True, False]
        # The hang was cut off inside the actor (no signal in its worker thread) and scored
        # with timeout_reward.
        assert slow.reward == pytest.approx(-0.1)
        assert slow_handle.outcome.status == "timeout"
        assert pool.status_counts == {"ok": 3, "no_answer": 1, "timeout": 1}
        assert pool.loads() == [0, 0]
    finally:
        pool.shutdown()


def test_ray_pool_cancel_and_wait_timeout(ray_session, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = RewardConfig(num_workers=1, worker_num_cpus=0.25, timeout_s=3.0)
    pool = RewardPool(cfg, str(tokenizer_dir), max_new_tokens=256)
    try:
        pool.ready(timeout_s=120)
        blocker = pool.submit(make_sample(tok, "p", 0, "\\boxed{(10^{10^{10}})!}", "5"))
        queued = [pool.submit(make_sample(tok, "p", i, "\\boxed{5}", "5")) for i in (1, 2)]
        with pytest.raises(TimeoutError, match="still pending"):
            pool.wait([blocker], timeout_s=0.5)
        pool.cancel(queued[:1])
        assert queued[0].cancelled
        done = pool.wait([blocker, *queued], timeout_s=60)
        assert [s.response_index for s in done] == [0, 2]       # the cancelled one is left out
        assert queued[0].sample.reward is None                  # and never scored into the sample
        assert queued[1].sample.reward == 1.0
        assert blocker.outcome.status == "timeout"
    finally:
        pool.shutdown()


def test_cancel_right_after_submit_does_not_stall_the_worker(ray_session, tokenizer_dir: Path) -> None:
    """Regression: tail batching cancels responses moments after submitting them. With
    ray.cancel on those ordered actor tasks, one not yet pushed to the actor left a hole in its
    sequence numbers: the actor waited 30 s, then failed every queued task (a whole step scored
    timeout_reward). Cooperative skips must keep every other response scored within seconds.

    The race is timing-dependent: with ray.cancel in RewardPool.cancel this test failed (a 30 s
    stall) in about half of the runs on a 2-core box, with the many cancels below."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = RewardConfig(num_workers=1, worker_num_cpus=0.25, timeout_s=5.0, timeout_reward=-1.0)
    pool = RewardPool(cfg, str(tokenizer_dir), max_new_tokens=256)
    try:
        pool.ready(timeout_s=120)
        start = time.monotonic()
        handles, cancelled = [], []
        for i in range(240):
            handle = pool.submit(make_sample(tok, "p", i, "\\boxed{5}", "5"))
            if i % 3 == 1:
                pool.cancel([handle])                        # immediately, likely before it is pushed
                cancelled.append(handle)
            else:
                handles.append(handle)
        handles += [pool.submit(make_sample(tok, "q", i, "\\boxed{5}", "5")) for i in range(20)]
        done = pool.wait(handles, timeout_s=20)          # the stall would raise TimeoutError here
        elapsed = time.monotonic() - start
        assert len(done) == 180
        assert [h.outcome.status for h in handles] == ["ok"] * 180
        assert all(s.reward == 1.0 and s.correct for s in done)
        assert all(h.sample.reward is None for h in cancelled)
        assert elapsed < 15.0, f"scoring stalled: {elapsed:.1f} s"
        metrics = pool.step_metrics()
        assert metrics["reward/cancelled"] == 80.0
        assert metrics["reward/errors"] == 0.0 and metrics["reward/retries"] == 0.0
        assert metrics["reward/scored"] == 180.0
    finally:
        pool.shutdown()
