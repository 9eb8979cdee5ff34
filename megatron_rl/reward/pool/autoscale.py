"""Reward-pool autoscaling policy (pure logic, no Ray; applied by
:class:`~megatron_rl.reward.pool.worker_set.WorkerSet`).

The pool grows when responses queue up behind busy workers and shrinks when workers sit idle:

* **grow** by one worker (up to ``max_workers``) when no new worker is still starting and either
  the responses in flight exceed ``up_queue_per_worker`` per worker, or some are queued and the
  recent queue wait (exponential average over collected results) exceeds ``up_wait_s``;
* **shrink** by one worker (down to ``min_workers``) that has been idle for ``down_idle_s``.

One worker at a time, and none while one is starting: a new Ray actor needs seconds (tokenizer,
grading process) before it helps, and adding more meanwhile would overshoot.
"""
from __future__ import annotations

from dataclasses import dataclass


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
