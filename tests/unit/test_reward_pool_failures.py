"""The reward pool when workers fail or work is cancelled: no remote cancel of ordered actor
tasks (cooperative ``skip`` calls instead), retries of tasks lost with their actor's queue, and
per-step failure/cancel metrics and warnings.

The Ray path is driven with stand-in actor handles (``score.remote`` returns an awaitable), so
these run without a Ray cluster.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.config.schema import RewardConfig
from megatron_rl.reward.pool.handles import RewardHandle
from megatron_rl.reward.pool.metrics import RewardStats
from megatron_rl.reward.pool.reward_pool import RewardPool
from megatron_rl.reward.pool.worker import CONTROL_GROUP, RewardOutcome, RewardWorker
from megatron_rl.reward.sandbox.isolated_call import CallTimeout, IsolatedCall
from megatron_rl.sample import Prompt, Sample


def unavailable() -> Exception:
    import ray

    # What every queued task gets when a Ray actor gives up on a missing sequence number.
    return ray.exceptions.ActorUnavailableError(
        "The actor is temporarily unavailable: Invalid: Timed out waiting for seq_no 402 in concurrency "
        "group , after waiting for 30 seconds. Cancelling all queued tasks.", None)


PENDING = object()
"""Script item: the task stays queued until the test (or a ``skip``) resolves it."""


class FakeActor:
    """Stands in for a Ray actor handle: ``score.remote`` returns an awaitable ref that resolves
    to the next scripted outcome (or raises it); ``PENDING`` tasks wait, and a ``skip`` call
    (recorded with its concurrency group) answers them 'cancelled' like a real worker."""

    def __init__(self, script: list) -> None:
        self.script = list(script)
        self.calls: list[tuple] = []
        self.task_ids: list[int] = []
        self.pending: dict[int, asyncio.Future] = {}
        self.skips: list[tuple[str, list[int]]] = []
        self.score = SimpleNamespace(remote=self._score)
        self.skip = SimpleNamespace(options=lambda **kw: SimpleNamespace(
            remote=lambda ids: self._skip(kw.get("concurrency_group"), ids)))

    def _score(self, *args, task_id=None):
        self.calls.append(args)
        self.task_ids.append(task_id)
        ref = asyncio.get_running_loop().create_future()
        item = self.script.pop(0)
        if item is PENDING:
            self.pending[task_id] = ref
        elif isinstance(item, BaseException):
            ref.set_exception(item)
        else:
            ref.set_result(item)
        return ref

    def _skip(self, group, ids):
        self.skips.append((group, list(ids)))
        for task_id in ids:
            ref = self.pending.pop(task_id, None)
            if ref is not None and not ref.done():
                ref.set_result(RewardOutcome(0.0, 0.0, False, "", "cancelled", "skipped before it ran", 0.0))


def fake_ray_pool(tokenizer_dir: Path, monkeypatch, *actors: FakeActor, **cfg) -> RewardPool:
    pool = RewardPool(RewardConfig(num_workers=1, timeout_reward=-0.5, **cfg), str(tokenizer_dir), 64,
                      use_ray=False, dispatch="round_robin")
    workers = pool._workers
    workers.remote = True
    workers.actors = dict(enumerate(actors))
    workers.in_flight = {i: set() for i in range(len(actors))}
    workers.idle_since = {i: None for i in range(len(actors))}
    monkeypatch.setattr(workers, "loads", lambda: {w: sum(not r.done() for r in refs)
                                                   for w, refs in workers.in_flight.items()})
    return pool


def sample(prompt_id: str = "arith:7", index: int = 3) -> Sample:
    return Sample(prompt=Prompt(prompt_id, [1, 2], "4"), response_index=index,
                  request_id=f"s2-a0-{prompt_id}-r{index}", response_ids=[65, 66])


def ok_outcome() -> RewardOutcome:
    return RewardOutcome(1.0, 1.0, True, "4", "ok", "", 0.01)


def test_cancel_never_cancels_an_ordered_actor_task(tokenizer_dir: Path, monkeypatch) -> None:
    """ray.cancel on a reward task the submitter has not pushed yet leaves a hole in the actor's
    sequence numbers: the actor then waits 30 s and fails every task queued behind it (the
    step-2 stall of runs/bench_stream/tail_batching). cancel() must drop the result and ask
    the owning worker to skip the task (a control call), never ray.cancel it."""
    import ray

    calls = []
    monkeypatch.setattr(ray, "cancel", lambda ref, *a, **k: calls.append(ref))
    actor = FakeActor([])
    pool = fake_ray_pool(tokenizer_dir, monkeypatch, actor)
    ref = object()
    pool._workers.in_flight[0].add(ref)
    handle = RewardHandle(sample(), 0, ref=ref, task_id=41)
    pool.cancel([handle])
    pool.cancel([handle])                                  # a second cancel sends nothing more
    assert handle.cancelled and not handle.done
    assert calls == []
    assert actor.skips == [(CONTROL_GROUP, [41])]
    # Until the worker answers it keeps counting as that worker's load.
    assert ref in pool._workers.in_flight[0]
    assert pool.step_metrics()["reward/cancelled"] == 1.0


def test_cancel_sends_one_skip_per_worker_with_its_task_ids(tokenizer_dir: Path, monkeypatch) -> None:
    import ray

    monkeypatch.setattr(ray, "cancel", lambda *a, **k: pytest.fail("ray.cancel called on a reward task"))
    actors = [FakeActor([PENDING] * 4), FakeActor([PENDING] * 4)]
    pool = fake_ray_pool(tokenizer_dir, monkeypatch, *actors)

    async def main():
        handles = [pool.submit(sample("arith:7", i)) for i in range(6)]   # round robin: 0,1,0,1,0,1
        assert [h.worker for h in handles] == [0, 1, 0, 1, 0, 1]
        assert len({h.task_id for h in handles}) == 6
        pool.cancel([handles[0], handles[1], handles[2], handles[4]])
        return handles

    handles = asyncio.run(main())
    assert actors[0].skips == [(CONTROL_GROUP, [handles[0].task_id, handles[2].task_id, handles[4].task_id])]
    assert actors[1].skips == [(CONTROL_GROUP, [handles[1].task_id])]
    assert [h.cancelled for h in handles] == [True, True, True, False, True, False]
    # The worker's ids are the ones its score tasks were sent with.
    assert actors[0].task_ids == [handles[0].task_id, handles[2].task_id, handles[4].task_id]


def test_skipped_task_is_ignored_and_counted_as_cancelled(tokenizer_dir: Path, monkeypatch) -> None:
    """The abort path: score() awaits a queued task, the scheduler cancels it, the worker answers
    'cancelled' at once. The outcome is never applied and is no error or timeout."""
    actor = FakeActor([PENDING, PENDING])
    pool = fake_ray_pool(tokenizer_dir, monkeypatch, actor)
    keep, drop = sample("arith:7", 0), sample("arith:7", 1)

    async def main():
        tasks = [asyncio.ensure_future(pool.score(s)) for s in (keep, drop)]
        await asyncio.sleep(0)
        pool.cancel_samples([drop])
        actor.pending.pop(actor.task_ids[0]).set_result(ok_outcome())
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)

    asyncio.run(main())
    assert actor.skips == [(CONTROL_GROUP, [actor.task_ids[1]])]
    assert (keep.reward, keep.correct) == (1.0, True)
    assert drop.reward is None and drop.correct is None   # the 'cancelled' outcome was dropped
    assert "cancelled" not in pool.status_counts
    metrics = pool.step_metrics([keep])
    assert metrics["reward/cancelled"] == 1.0
    assert metrics["reward/scored"] == 1.0
    assert metrics["reward/errors"] == 0.0 and metrics["reward/timeouts"] == 0.0
    assert pool.step_metrics()["reward/cancelled"] == 0.0  # per step


SLEEPY_CODE = "```python\nimport time\ndef work():\n    time.sleep(20)\n    return 7\n```"
TESTS = "from solution import work\n\ndef test_work():\n    assert work() == 7\n"


def test_worker_skips_queued_tasks_and_stops_a_running_sandbox(tokenizer_dir: Path) -> None:
    """RewardWorker.skip from another thread (the actor's control group): a queued id answers
    'cancelled' without running, a running sandbox program is killed, finished ids are ignored."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    worker = RewardWorker(RewardConfig(kind="code", code_timeout_max_s=30.0), str(tokenizer_dir), 512,
                          eager_start=False)
    ids = tok.encode(SLEEPY_CODE, add_special_tokens=False)
    meta = {"format": "kodcode", "tests": TESTS}
    try:
        # Queued: skipped before it runs (no sandbox started).
        assert worker.skip([3]) == 1
        start = time.monotonic()
        out = worker.score(ids, TESTS, "kod#0", meta, 30.0, task_id=3)
        assert out.status == "cancelled" and time.monotonic() - start < 1.0
        # Running: the control thread's skip kills the sandboxed program.
        result = {}
        thread = threading.Thread(target=lambda: result.update(out=worker.score(ids, TESTS, "kod#1", meta, 30.0,
                                                                                  task_id=4)))
        start = time.monotonic()
        thread.start()
        time.sleep(1.0)
        assert worker.skip([4]) == 1
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert result["out"].status == "cancelled" and "stopped" in result["out"].detail
        assert time.monotonic() - start < 6.0               # not the program's 20 s
        # Ids that already ran are not kept (nothing to leak); later ids run normally.
        assert worker.skip([3, 4]) == 0
        assert worker.cancel_stats() == {"skipped": 1, "stopped": 1, "finished": 0, "pending_skips": 0}
        fast = tok.encode("```python\ndef work():\n    return 7\n```", add_special_tokens=False)
        assert worker.score(fast, TESTS, "kod#2", meta, 30.0, task_id=5).correct is True
    finally:
        worker.close()


def test_score_retries_a_task_lost_with_its_actor_queue(tokenizer_dir: Path, monkeypatch) -> None:
    actor = FakeActor([unavailable(), ok_outcome()])
    pool = fake_ray_pool(tokenizer_dir, monkeypatch, actor)
    s = sample()
    asyncio.run(pool.score(s))
    assert len(actor.calls) == 2                       # resubmitted once
    assert (s.reward, s.correct) == (1.0, True)        # scored, not timeout_reward
    metrics = pool.step_metrics([s])
    assert metrics["reward/retries"] == 1.0
    assert metrics["reward/errors"] == 0.0 and metrics["reward/timeouts"] == 0.0
    assert pool._workers.in_flight[0] == set() or all(r.done() for r in pool._workers.in_flight[0])


def test_score_stops_with_pool_exhausted_after_its_retries(tokenizer_dir: Path, monkeypatch, caplog) -> None:
    """A task lost past its resubmissions means the workers keep dying: ``score`` raises, naming
    the response, instead of scoring a failure reward that a run would train on."""
    from megatron_rl.reward.pool.dispatch import RewardPoolExhausted

    actor = FakeActor([unavailable() for _ in range(10)])
    pool = fake_ray_pool(tokenizer_dir, monkeypatch, actor)
    s = sample()
    with caplog.at_level(logging.WARNING, logger="megatron_rl.reward.pool.dispatch"):
        with pytest.raises(RewardPoolExhausted, match=r"reward pool is exhausted: the reward of arith:7#3 .* lost "
                           r"with its worker \d+ times"):
            asyncio.run(pool.score(s))
    assert 2 <= len(actor.calls) <= 4                  # bounded retries
    assert s.reward is None and s.correct is None       # no failure reward scored
    metrics = pool.step_metrics([s])
    assert metrics["reward/errors"] == 0.0
    assert metrics["reward/retries"] == float(len(actor.calls) - 1)
    # Each resubmission's warning names the response, so a stalled step points at its prompts.
    assert any("arith:7#3" in r.getMessage() for r in caplog.records)


def test_score_does_not_retry_an_exception_raised_by_the_worker(tokenizer_dir: Path, monkeypatch) -> None:
    import ray

    err = ray.exceptions.RayTaskError("score", "Traceback ...", ValueError("bad"))
    actor = FakeActor([err, ok_outcome()])
    pool = fake_ray_pool(tokenizer_dir, monkeypatch, actor)
    s = sample()
    asyncio.run(pool.score(s))
    assert len(actor.calls) == 1 and s.reward == -0.5
    assert pool.step_metrics([s])["reward/errors"] == 1.0


def test_stats_count_timeouts_and_errors_per_step() -> None:
    stats = RewardStats()
    stats.record(0.1, 2.0, "timeout")
    stats.record(0.1, 0.0, "error")
    stats.record(0.1, 0.01, "ok")
    stats.retries += 2
    m = stats.drain(num_workers=1)
    assert (m["reward/timeouts"], m["reward/errors"], m["reward/retries"]) == (1.0, 1.0, 2.0)
    again = stats.drain(num_workers=1)
    assert (again["reward/timeouts"], again["reward/errors"], again["reward/retries"]) == (0.0, 0.0, 0.0)


def test_isolated_call_recovers_when_a_killed_child_does_not_exit(monkeypatch) -> None:
    """A grading process that cannot be reaped after SIGKILL (e.g. stuck in the kernel) must cost
    one timeout, not raise out of the worker on this and every later call."""
    runner = IsolatedCall()
    try:
        runner.ensure_started()
        start = time.monotonic()
        with pytest.raises(CallTimeout):
            runner.call(time.sleep, (30,), 0.5)         # the caller never waits for the killed worker
        assert time.monotonic() - start < 10
        stuck = runner._server.proc

        def never_exits(timeout=None):
            raise subprocess.TimeoutExpired(stuck.args, timeout)

        monkeypatch.setattr(stuck, "wait", never_exits)
        os.kill(stuck.pid, signal.SIGKILL)              # the fork server itself goes away
        deadline = time.monotonic() + 10
        while stuck.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
        assert runner.call(abs, (-3,), 10.0) == 3      # a fresh fork server answers
        assert time.monotonic() - start < 10
        assert runner._server.proc is not stuck
    finally:
        runner.close()
