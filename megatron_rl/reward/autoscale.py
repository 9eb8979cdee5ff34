"""Reward-pool autoscaling policy and reward-scheduler metrics (pure logic, no Ray).

The pool grows when responses queue up behind busy workers and shrinks when workers sit idle:

* **grow** by one worker (up to ``max_workers``) when no new worker is still starting and either
  the responses in flight exceed ``up_queue_per_worker`` per worker, or some are queued and the
  recent queue wait (exponential average over collected results) exceeds ``up_wait_s``;
* **shrink** by one worker (down to ``min_workers``) that has been idle for ``down_idle_s``.

One worker at a time, and none while one is starting: a new Ray actor needs seconds (tokenizer,
grading process) before it helps, and adding more meanwhile would overshoot.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from megatron_rl.sample import Sample

_WAIT_EMA_ALPHA = 0.3


@dataclass
class ScalePolicy:
    """Bounds and triggers of pool autoscaling."""

    min_workers: int
    """Never fewer workers than this."""
    max_workers: int
    """Never more workers than this (== min_workers disables autoscaling)."""
    up_queue_per_worker: float = 2.0
    """Grow when responses in flight per worker exceed this."""
    up_wait_s: float = 1.0
    """Grow when the recent mean queue wait exceeds this many seconds."""
    down_idle_s: float = 60.0
    """Shrink a worker idle for this many seconds."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"reward pool bounds need 1 <= min_workers <= max_workers, got "
                             f"{self.min_workers}..{self.max_workers}")

    @property
    def enabled(self) -> bool:
        return self.max_workers > self.min_workers

    def decide(self, loads: dict[int, int], starting: int, wait_ema: float,
               idle_since: dict[int, float | None], now: float) -> tuple[int, int | None]:
        """(+1, None) to add a worker, (-1, worker_id) to remove one, (0, None) to do nothing.

        ``loads``: responses in flight per worker; ``starting``: workers not yet ready;
        ``idle_since``: per worker, when it last became idle (None while busy).
        """
        n = len(loads)
        in_flight = sum(loads.values())
        # The wait average only counts while responses queue (more in flight than workers): it
        # is a trailing signal and would otherwise keep growing an already drained pool.
        if n < self.max_workers and starting == 0 and (
                in_flight > self.up_queue_per_worker * n or (wait_ema > self.up_wait_s and in_flight > n)):
            return 1, None
        if n > self.min_workers and in_flight < n:
            idle = [(since, wid) for wid, since in idle_since.items()
                    if since is not None and loads.get(wid, 0) == 0 and now - since >= self.down_idle_s]
            if idle:
                return -1, min(idle)[1]  # the one idle longest
        return 0, None


@dataclass
class RewardStats:
    """Running reward-scheduler measurements; ``drain`` returns and resets one step's window."""

    wait_ema: float = 0.0
    """Exponential average of recent queue waits (drives autoscaling)."""
    _waits: list[float] = field(default_factory=list)
    _work_s: float = 0.0
    _busy_area: float = 0.0
    _busy_now: int = 0
    _since: float = field(default_factory=time.monotonic)
    _last: float = field(default_factory=time.monotonic)
    scale_ups: int = 0
    scale_downs: int = 0
    retries: int = 0
    """Reward tasks resubmitted because their worker lost them (actor died or dropped its queue)."""
    cancelled: int = 0
    """Responses whose reward work was cancelled (results dropped; not scored, not errors)."""
    _timeouts: int = 0
    _errors: int = 0

    def set_busy(self, busy_workers: int, now: float | None = None) -> None:
        """Record that ``busy_workers`` workers have work from now on (time-weighted mean)."""
        now = time.monotonic() if now is None else now
        self._busy_area += self._busy_now * max(0.0, now - self._last)
        self._busy_now, self._last = busy_workers, now

    def record(self, queue_wait_s: float, work_s: float, status: str = "ok") -> None:
        """One collected result: how long it queued, how long the worker spent on it, and its
        status ('timeout' and 'error' are counted: they score ``timeout_reward``, not the answer)."""
        wait = max(0.0, queue_wait_s)
        self._waits.append(wait)
        self._work_s += max(0.0, work_s)
        self._timeouts += status == "timeout"
        self._errors += status == "error"
        self.wait_ema = wait if len(self._waits) == 1 and not self.wait_ema else (
            _WAIT_EMA_ALPHA * wait + (1 - _WAIT_EMA_ALPHA) * self.wait_ema)

    def drain(self, num_workers: int, now: float | None = None) -> dict[str, float]:
        """Metrics since the last drain: queue wait, busy workers, worker seconds, scaling events,
        and how many results were timeouts or errors (scored ``timeout_reward``), were retried or
        were cancelled."""
        now = time.monotonic() if now is None else now
        self.set_busy(self._busy_now, now)
        window = max(1e-9, now - self._since)
        waits = self._waits
        out = {
            "reward/queue_wait_mean": sum(waits) / len(waits) if waits else 0.0,
            "reward/queue_wait_max": max(waits, default=0.0),
            "reward/busy_workers_mean": self._busy_area / window,
            "reward/workers": float(num_workers),
            "reward/scored": float(len(waits)),
            "reward/worker_time_s": self._work_s,
            "reward/scale_ups": float(self.scale_ups),
            "reward/scale_downs": float(self.scale_downs),
            "reward/timeouts": float(self._timeouts),
            "reward/errors": float(self._errors),
            "reward/retries": float(self.retries),
            "reward/cancelled": float(self.cancelled),
        }
        self._waits, self._work_s, self._busy_area = [], 0.0, 0.0
        self._since = now
        self.scale_ups = self.scale_downs = self.retries = self.cancelled = self._timeouts = self._errors = 0
        return out


def reward_overlap(samples: list[Sample]) -> dict[str, float]:
    """How much reward time was hidden under rollout in one step.

    Each response's reward latency runs from its ``finished`` stamp to ``reward_done``; the part
    before the step's last response finished overlapped with generation. ``reward/tail_s`` is
    what the step still waited for rewards after generation ended.
    """
    stamped = [s for s in samples if "finished" in s.timings and "reward_done" in s.timings]
    if not stamped:
        return {}
    last_finish = max(s.timings["finished"] for s in stamped)
    total = hidden = 0.0
    for s in stamped:
        start, end = s.timings["finished"], s.timings["reward_done"]
        total += max(0.0, end - start)
        hidden += max(0.0, min(end, last_finish) - start)
    return {
        "reward/latency_s": total,
        "reward/hidden_s": hidden,
        "reward/hidden_fraction": hidden / total if total > 0 else 1.0,
        "reward/tail_s": max(0.0, max(s.timings["reward_done"] for s in stamped) - last_finish),
    }
