"""Reward-scheduler measurements of one pool, per step (pure logic, no Ray).

:class:`RewardStats` accumulates what the pool reports as it goes (queue wait and worker time of
every collected result, busy workers over time, scaling events, timeouts, errors, retries,
cancellations); :func:`step_metrics` drains one step's window into the ``reward/*`` metrics
(the metrics table in docs/metrics.md) and warns when responses timed out or failed; :func:`reward_overlap`
measures from a step's samples how much reward time was hidden under rollout. Every count is per
step: draining resets it. ``wait_ema`` is not reset: it is the autoscaler's trailing signal.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from megatron_rl.sample import Sample

logger = logging.getLogger(__name__)

_WAIT_EMA_ALPHA = 0.3


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


def step_metrics(stats: RewardStats, num_workers: int, adaptive_anchors: int, timeout_reward: float,
                 samples: list[Sample] | None = None) -> dict[str, float]:
    """Drain ``stats`` into the step's ``reward/*`` metrics, plus ``reward/adaptive_anchors``
    (problems with an adaptive code timeout) and, given the step's samples, :func:`reward_overlap`.
    Logs a warning when any response timed out or failed (they scored ``timeout_reward``)."""
    metrics = stats.drain(num_workers)
    metrics["reward/adaptive_anchors"] = float(adaptive_anchors)
    if metrics["reward/timeouts"] or metrics["reward/errors"]:
        logger.warning("reward: %d timeouts and %d errors among %d responses scored since the last step "
                       "(they scored timeout_reward=%s; %d retries)", metrics["reward/timeouts"],
                       metrics["reward/errors"], metrics["reward/scored"], timeout_reward,
                       metrics["reward/retries"])
    if samples:
        metrics.update(reward_overlap(samples))
    return metrics
