"""The reward workers of one pool: where they run, what each has in flight, and autoscaling.

Contract:

* **placement**: with ``remote=True`` (needs ``ray.init`` first) every worker is a Ray actor of
  :class:`~megatron_rl.reward.pool.worker.RewardWorker` with ``num_cpus=reward.worker_num_cpus`` (light
  actors must not block the placement groups of the trainer and engines), no GPU, one restart,
  and a second concurrency group :data:`~megatron_rl.reward.pool.worker.CONTROL_GROUP` for control
  calls; with ``remote=False`` the workers are plain objects in this process (unit tests,
  debugging) whose grading children start on their first response.
* **dispatch** (:meth:`WorkerSet.pick`): 'least_loaded' (fewest responses in flight, ties in
  round-robin order) or 'round_robin'; workers still starting get work only if all are starting.
* **load**: the set tracks each worker's in-flight Ray refs (:meth:`track` / :meth:`release`);
  finished refs are pruned whenever loads are read.
* **autoscaling** (:meth:`rescale`, Ray sets only): the decision of
  :class:`~megatron_rl.reward.pool.autoscale.ScalePolicy` within ``reward.min_workers`` ..
  ``reward.max_workers``, one worker at a time; a new worker counts as starting (and is never
  retired for being idle) until its ``ping`` answers. Busy-worker time and scaling events are
  recorded in the pool's :class:`~megatron_rl.reward.pool.metrics.RewardStats`.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from megatron_rl.config.schema import AlgorithmConfig, RewardConfig
from megatron_rl.reward.pool.autoscale import ScalePolicy
from megatron_rl.reward.pool.metrics import RewardStats
from megatron_rl.reward.pool.worker import CONTROL_GROUP, RewardWorker

logger = logging.getLogger(__name__)

DISPATCH_POLICIES = ("least_loaded", "round_robin")


class WorkerSet:
    """``reward.num_workers`` workers at start, Ray actors or in-process (see the module docstring)."""

    def __init__(self, reward_cfg: RewardConfig, tokenizer_path: str, max_new_tokens: int,
                 algorithm_cfg: AlgorithmConfig | None, stats: RewardStats, *, remote: bool,
                 dispatch: str = "least_loaded") -> None:
        if dispatch not in DISPATCH_POLICIES:
            raise ValueError(f"dispatch={dispatch!r}: expected one of {DISPATCH_POLICIES}")
        self.remote = remote
        """Whether the workers are Ray actors (else in-process objects)."""
        self.dispatch = dispatch
        self.stats = stats
        low = reward_cfg.min_workers or reward_cfg.num_workers
        high = max(reward_cfg.max_workers or reward_cfg.num_workers, low)
        self.policy = ScalePolicy(low, high if remote else low, reward_cfg.scale_up_queue_per_worker,
                                  reward_cfg.scale_up_wait_s, reward_cfg.scale_down_idle_s)
        """Autoscaling bounds and triggers (in-process sets never scale)."""
        self.actors: dict[int, Any] = {}
        """Worker id -> Ray actor handle (or in-process worker)."""
        self.in_flight: dict[int, set] = {}
        """Worker id -> refs of its tasks not yet known to be finished."""
        self.starting: dict[int, Any] = {}
        """Autoscaled workers not ready yet -> their ping ref."""
        self.idle_since: dict[int, float | None] = {}
        """Worker id -> when it last became idle (None while busy or starting)."""
        self._args = (reward_cfg, tokenizer_path, max_new_tokens, algorithm_cfg)
        self._cursor = itertools.count()
        self._ids = itertools.count()
        if remote:
            import ray

            # Default group: ``score`` calls, one at a time in submission order. CONTROL_GROUP: a
            # second thread for ``skip`` (and ``cancel_stats``), so cancelling needs no ray.cancel.
            self._actor_cls = ray.remote(num_cpus=reward_cfg.worker_num_cpus, num_gpus=0, max_restarts=1,
                                         concurrency_groups={CONTROL_GROUP: 1})(RewardWorker)
        for _ in range(reward_cfg.num_workers):
            self.add(starting=False)

    def __len__(self) -> int:
        return len(self.actors)

    def add(self, starting: bool) -> int:
        """Start one more worker; ``starting``: it gets work only once its ping answered."""
        wid = next(self._ids)
        if self.remote:
            worker = self._actor_cls.remote(*self._args)
            if starting:
                self.starting[wid] = worker.ping.remote()
        else:
            # Lazy start: in-process grading children start on the first response.
            worker = RewardWorker(*self._args, eager_start=False)
        self.actors[wid] = worker
        self.in_flight[wid] = set()
        # A starting worker is not idle (it cannot take work yet): never retire it for that.
        self.idle_since[wid] = None if starting else time.monotonic()
        return wid

    def remove(self, wid: int) -> None:
        """Retire an idle Ray worker: it closes its grader and exits after any queued call."""
        worker = self.actors.pop(wid)
        self.in_flight.pop(wid, None)
        self.idle_since.pop(wid, None)
        self.starting.pop(wid, None)
        worker.close.remote()
        worker.__ray_terminate__.remote()

    def ready(self, timeout_s: float) -> None:
        """Block until every Ray worker is constructed (tokenizer loaded, grading process warm)."""
        if self.remote:
            import ray

            ray.get([w.ping.remote() for w in self.actors.values()], timeout=timeout_s)
            self.starting.clear()

    def loads(self) -> dict[int, int]:
        """Worker id -> tasks in flight (finished refs are pruned first)."""
        if self.remote:
            import ray

            for refs in self.in_flight.values():
                if refs:
                    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                    refs.difference_update(done)
        return {wid: len(refs) for wid, refs in self.in_flight.items()}

    def pick(self, avoid: int | None = None) -> int:
        """The worker the next response goes to (the dispatch policy); never ``avoid`` (the
        worker a resubmitted task was lost on, likely restarting) while another one exists."""
        ids = [wid for wid in self.actors if wid not in self.starting] or list(self.actors)
        ids = [wid for wid in ids if wid != avoid] or ids
        start = next(self._cursor) % len(ids)
        order = ids[start:] + ids[:start]
        if self.dispatch == "round_robin":
            return order[0]
        loads = self.loads()
        return min(order, key=lambda wid: loads[wid])  # min keeps the first (round-robin) on ties

    def track(self, wid: int, ref: Any) -> None:
        """A task was sent to ``wid``: it counts as its load until released or finished."""
        self.in_flight[wid].add(ref)

    def release(self, wid: int, ref: Any) -> bool:
        """Forget a task of ``wid`` (its outcome is in, or it was resubmitted elsewhere); False
        when the worker is gone."""
        if wid not in self.in_flight:
            return False
        self.in_flight[wid].discard(ref)
        return True

    def rescale(self, allow_shrink: bool) -> None:
        """Track busy/idle workers and apply the autoscaling decision (Ray sets only)."""
        now = time.monotonic()
        loads = self.loads()
        for wid, load in loads.items():
            if load or wid in self.starting:
                self.idle_since[wid] = None
            elif self.idle_since.get(wid) is None:
                self.idle_since[wid] = now
        self.stats.set_busy(sum(1 for load in loads.values() if load), now)
        if not self.remote or not self.policy.enabled:
            return
        if self.starting:
            import ray

            ready, _ = ray.wait(list(self.starting.values()), num_returns=len(self.starting), timeout=0)
            for wid in [w for w, ref in self.starting.items() if ref in ready]:
                del self.starting[wid]
        action, wid = self.policy.decide(loads, len(self.starting), self.stats.wait_ema, self.idle_since, now)
        if action > 0:
            new = self.add(starting=True)
            self.stats.scale_ups += 1
            logger.info("reward pool: +1 worker (#%d) -> %d (in flight %d, queue wait %.2f s)", new,
                        len(self), sum(loads.values()), self.stats.wait_ema)
        elif action < 0 and allow_shrink:
            self.remove(wid)
            self.stats.scale_downs += 1
            logger.info("reward pool: -1 idle worker (#%d) -> %d", wid, len(self))

    def close(self, timeout_s: float) -> None:
        """Stop every worker and its grading process."""
        if self.remote:
            import ray

            try:
                ray.get([w.close.remote() for w in self.actors.values()], timeout=timeout_s)
            except ray.exceptions.RayError as exc:
                logger.warning("reward worker close failed: %s", exc)
            for worker in self.actors.values():
                ray.kill(worker)
        else:
            for worker in self.actors.values():
                worker.close()
        self.actors = {}
        self.in_flight = {}
