"""The driver-side reward scheduler: a pool of reward workers fed one response at a time.

Scoring runs in the workers (:class:`~megatron_rl.reward.scorer.RewardWorker`), never in the
trainer. On a cluster each worker is a Ray actor with a fractional ``num_cpus`` (light actors must
not block placement groups of the trainer and engines); in unit tests the same class runs
in-process. A scheduler calls ``submit(sample)`` (or awaits ``score(sample)``) the moment a
response finishes, so rewards overlap with generation of the rest of the batch; results are
written into the ``Sample`` in place, and a step waits only for its last reward.

Beyond dispatch the pool owns what must be shared by all workers:

* **adaptive code timeouts** (:mod:`~megatron_rl.reward.adaptive_timeout`): the timeout sent
  with each code response comes from the slowest correct run seen for its problem;
* **autoscaling** (:mod:`~megatron_rl.reward.autoscale`): with ``reward.max_workers`` above
  ``reward.min_workers`` the pool adds a Ray worker when responses queue up and removes one that
  stays idle while results flow;
* **metrics** (:meth:`RewardPool.step_metrics`): queue wait, busy workers, reward time hidden
  under rollout, and per step how many responses timed out, failed or were retried;
* **retries**: a task its actor lost (the actor died, or dropped its queued tasks; scoring is
  pure, so running it twice is harmless) is resubmitted up to ``MAX_RETRIES`` times before it
  scores ``reward.timeout_reward``; an exception raised by the scoring itself is not retried;
* **cancellation** (:meth:`RewardPool.cancel`, e.g. after a scheduler aborts requests): the
  owning worker is told to skip the tasks (a control call in the actor's second concurrency
  group), so queued ones return at once and a running code-sandbox run is killed; the results
  are dropped and counted as ``reward/cancelled``, never as errors or timeouts;
* the optional **LLM judge** (``reward.kind='judge'``), awaited on the driver.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from megatron_rl.config import AlgorithmConfig, RewardConfig, RunConfig
from megatron_rl.reward.adaptive_timeout import AdaptiveTimeouts, TimeoutPolicy
from megatron_rl.reward.autoscale import RewardStats, ScalePolicy, reward_overlap
from megatron_rl.reward.handles import RewardHandle, apply_outcome, response_label
from megatron_rl.reward.scorer import (CONTROL_GROUP, REWARD_KINDS, RewardOutcome, RewardWorker, make_outcome,
                                       route_for)
from megatron_rl.sample import Sample

logger = logging.getLogger(__name__)

__all__ = ["RewardPool", "RewardHandle", "RewardOutcome", "RewardWorker", "apply_outcome", "REWARD_KINDS"]
DISPATCH_POLICIES = ("least_loaded", "round_robin")
MAX_RETRIES = 2
"""Resubmissions of one response whose task was lost with its actor (RayActorError)."""


class RewardPool:
    """Driver-side dispatcher over reward workers (``reward.num_workers`` at start).

    ``use_ray=True`` (needs ``ray.init`` first) runs each worker as a Ray actor with
    ``num_cpus=reward_cfg.worker_num_cpus`` and autoscales within ``reward.min_workers`` ..
    ``reward.max_workers``; ``use_ray=False`` keeps a fixed set of workers in this process and
    scores synchronously inside ``submit`` (unit tests, debugging). Dispatch is 'least_loaded'
    (fewest responses in flight, ties in round-robin order) or 'round_robin'. ``judge`` (an
    :class:`~megatron_rl.reward.llm_judge.LLMJudge`) scores responses routed to 'judge'.
    """

    def __init__(self, reward_cfg: RewardConfig, tokenizer_path: str, max_new_tokens: int,
                 algorithm_cfg: AlgorithmConfig | None = None, *, use_ray: bool = True,
                 dispatch: str = "least_loaded", judge: Any = None) -> None:
        if reward_cfg.num_workers < 1:
            raise ValueError(f"reward.num_workers={reward_cfg.num_workers} must be >= 1")
        if dispatch not in DISPATCH_POLICIES:
            raise ValueError(f"dispatch={dispatch!r}: expected one of {DISPATCH_POLICIES}")
        if reward_cfg.kind == "judge" and judge is None:
            raise ValueError("reward.kind='judge' needs a judge (RewardPool.from_run_config builds one "
                             "from reward.judge_model)")
        self._cfg = reward_cfg
        self._use_ray = use_ray
        self._dispatch = dispatch
        self._judge = judge
        self._tokenizer_path = tokenizer_path
        self._tokenizer: Any = None  # the policy tokenizer on the driver, only for judge responses
        self._max_new_tokens = max_new_tokens
        self._algo = algorithm_cfg or AlgorithmConfig()
        self._cursor = itertools.count()
        self._worker_ids = itertools.count()
        self._task_ids = itertools.count()  # increasing: a worker runs its tasks in this order
        self._workers: dict[int, Any] = {}
        self._in_flight: dict[int, set] = {}
        self._starting: dict[int, Any] = {}  # autoscaled workers not ready yet -> their ping ref
        self._idle_since: dict[int, float | None] = {}
        self._by_request: dict[str, RewardHandle] = {}
        self.status_counts: dict[str, int] = {}
        """How many collected outcomes had each status ('ok', 'timeout', ...)."""
        self.timeouts = AdaptiveTimeouts(TimeoutPolicy(reward_cfg.code_timeout_scale, reward_cfg.code_timeout_min_s,
                                                       reward_cfg.code_timeout_max_s))
        """Per-problem code timeouts (online anchors)."""
        low = reward_cfg.min_workers or reward_cfg.num_workers
        high = max(reward_cfg.max_workers or reward_cfg.num_workers, low)
        self.scale_policy = ScalePolicy(low, high if use_ray else low, reward_cfg.scale_up_queue_per_worker,
                                        reward_cfg.scale_up_wait_s, reward_cfg.scale_down_idle_s)
        """Autoscaling bounds and triggers (in-process pools never scale)."""
        self.stats = RewardStats()
        """Queue waits, busy workers and scaling events since the last ``step_metrics``."""
        self._args = (reward_cfg, tokenizer_path, max_new_tokens, algorithm_cfg)
        if use_ray:
            import ray

            # Default group: ``score`` calls, one at a time in submission order. CONTROL_GROUP: a
            # second thread for ``skip`` (and ``cancel_stats``), so cancelling needs no ray.cancel.
            self._actor_cls = ray.remote(num_cpus=reward_cfg.worker_num_cpus, num_gpus=0, max_restarts=1,
                                         concurrency_groups={CONTROL_GROUP: 1})(RewardWorker)
        for _ in range(reward_cfg.num_workers):
            self._add_worker(starting=False)

    @classmethod
    def from_run_config(cls, cfg: RunConfig, *, use_ray: bool = True) -> "RewardPool":
        """A pool for a run: tokenizer from ``model.hf_path``, budget ``rollout.max_new_tokens``,
        and for ``reward.kind='judge'`` a judge engine on ``reward.judge_model``."""
        judge = None
        if cfg.reward.kind == "judge":
            from megatron_rl.reward.llm_judge import create_judge

            judge = create_judge(cfg.reward, cfg.rollout, cfg.trainer.seed, use_ray=use_ray)
        return cls(cfg.reward, cfg.model.hf_path, cfg.rollout.max_new_tokens, cfg.algorithm,
                   use_ray=use_ray, judge=judge)

    # ------------------------------------------------------------------ workers
    def _add_worker(self, starting: bool) -> int:
        wid = next(self._worker_ids)
        if self._use_ray:
            worker = self._actor_cls.remote(*self._args)
            if starting:
                self._starting[wid] = worker.ping.remote()
        else:
            # Lazy start: in-process grading children start on the first response.
            worker = RewardWorker(*self._args, eager_start=False)
        self._workers[wid] = worker
        self._in_flight[wid] = set()
        # A starting worker is not idle (it cannot take work yet): never retire it for that.
        self._idle_since[wid] = None if starting else time.monotonic()
        return wid

    def _remove_worker(self, wid: int) -> None:
        """Retire an idle Ray worker: it closes its grader and exits after any queued call."""
        worker = self._workers.pop(wid)
        self._in_flight.pop(wid, None)
        self._idle_since.pop(wid, None)
        self._starting.pop(wid, None)
        worker.close.remote()
        worker.__ray_terminate__.remote()

    @property
    def num_workers(self) -> int:
        """Number of workers in the pool now."""
        return len(self._workers)

    @property
    def num_starting(self) -> int:
        """Autoscaled workers still starting (not yet given work)."""
        return len(self._starting)

    def maintain(self) -> None:
        """Re-evaluate autoscaling now (it otherwise runs on each submit and result)."""
        self._rescale(allow_shrink=True)

    def ready(self, timeout_s: float = 120.0) -> None:
        """Block until every worker is constructed (tokenizer loaded, grading process warm)."""
        if self._use_ray:
            import ray

            ray.get([w.ping.remote() for w in self._workers.values()], timeout=timeout_s)
            self._starting.clear()

    def _loads(self) -> dict[int, int]:
        if self._use_ray:
            import ray

            for refs in self._in_flight.values():
                if refs:
                    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                    refs.difference_update(done)
        return {wid: len(refs) for wid, refs in self._in_flight.items()}

    def loads(self) -> list[int]:
        """Responses in flight per worker, in worker order (finished ones are pruned first)."""
        return list(self._loads().values())

    def _pick_worker(self) -> int:
        ids = [wid for wid in self._workers if wid not in self._starting] or list(self._workers)
        start = next(self._cursor) % len(ids)
        order = ids[start:] + ids[:start]
        if self._dispatch == "round_robin":
            return order[0]
        loads = self._loads()
        return min(order, key=lambda wid: loads[wid])  # min keeps the first (round-robin) on ties

    def _rescale(self, allow_shrink: bool) -> None:
        """Track busy/idle workers and apply the autoscaling decision (Ray pools only)."""
        now = time.monotonic()
        loads = self._loads()
        for wid, load in loads.items():
            if load or wid in self._starting:
                self._idle_since[wid] = None
            elif self._idle_since.get(wid) is None:
                self._idle_since[wid] = now
        self.stats.set_busy(sum(1 for load in loads.values() if load), now)
        if not self._use_ray or not self.scale_policy.enabled:
            return
        if self._starting:
            import ray

            ready, _ = ray.wait(list(self._starting.values()), num_returns=len(self._starting), timeout=0)
            for wid in [w for w, ref in self._starting.items() if ref in ready]:
                del self._starting[wid]
        action, wid = self.scale_policy.decide(loads, len(self._starting), self.stats.wait_ema,
                                               self._idle_since, now)
        if action > 0:
            new = self._add_worker(starting=True)
            self.stats.scale_ups += 1
            logger.info("reward pool: +1 worker (#%d) -> %d (in flight %d, queue wait %.2f s)", new,
                        self.num_workers, sum(loads.values()), self.stats.wait_ema)
        elif action < 0 and allow_shrink:
            self._remove_worker(wid)
            self.stats.scale_downs += 1
            logger.info("reward pool: -1 idle worker (#%d) -> %d", wid, self.num_workers)

    # ------------------------------------------------------------------ scoring
    def _timeout_for(self, sample: Sample, route: str) -> float | None:
        if route != "code":
            return None  # the math reward's fixed reward.timeout_s
        if not self._cfg.adaptive_timeout:
            return self._cfg.code_timeout_max_s
        return self.timeouts.timeout_s(sample.prompt.prompt_id, sample.prompt.metadata)

    def _score_args(self, sample: Sample) -> tuple:
        route = route_for(self._cfg.kind, sample.prompt.metadata)
        if route == "judge":
            raise ValueError(f"{sample.request_id}: judge rewards are scored on the driver; await score()")
        return (sample.response_ids, sample.prompt.answer, response_label(sample), sample.prompt.metadata,
                self._timeout_for(sample, route))

    def _send(self, sample: Sample, args: tuple) -> tuple[int, Any, int]:
        """Send a scoring task to a Ray worker: (worker index, ObjectRef, task id)."""
        index = self._pick_worker()
        task_id = next(self._task_ids)
        ref = self._workers[index].score.remote(*args, task_id=task_id)
        self._in_flight[index].add(ref)
        self._rescale(allow_shrink=False)
        return index, ref, task_id

    def submit(self, sample: Sample) -> RewardHandle:
        """Send one finished response to a worker now; returns its handle."""
        args = self._score_args(sample)
        sample.timings["reward_submitted"] = time.monotonic()
        if not self._use_ray:
            index = self._pick_worker()
            handle = RewardHandle(sample, index)
            self._collect(handle, self._workers[index].score(*args))
            return handle
        index, ref, task_id = self._send(sample, args)
        return RewardHandle(sample, index, ref=ref, task_id=task_id)

    def _retry(self, handle: RewardHandle, exc: Exception) -> bool:
        """Resubmit a task its actor lost; False once ``MAX_RETRIES`` resubmissions are spent."""
        if handle.cancelled or handle.attempts > MAX_RETRIES:
            return False
        lost_on = handle.worker
        if lost_on in self._in_flight:
            self._in_flight[lost_on].discard(handle.ref)
        handle.worker, handle.ref, handle.task_id = self._send(handle.sample, self._score_args(handle.sample))
        handle.attempts += 1
        self.stats.retries += 1
        logger.warning("reward of %s (request %s) lost on worker #%d after %.1f s, resubmitted to worker #%d "
                       "(attempt %d of %d): %s", response_label(handle.sample), handle.sample.request_id, lost_on,
                       self._since_submit(handle), handle.worker, handle.attempts, MAX_RETRIES + 1, exc)
        return True

    @staticmethod
    def _since_submit(handle: RewardHandle) -> float:
        submitted = handle.sample.timings.get("reward_submitted")
        return 0.0 if submitted is None else time.monotonic() - submitted

    async def _await_outcome(self, handle: RewardHandle) -> RewardOutcome:
        """The outcome of a Ray task, retrying tasks lost with their actor."""
        import ray

        while True:
            try:
                return await handle.ref
            except ray.exceptions.TaskCancelledError:
                raise asyncio.CancelledError(f"reward of {handle.sample.request_id} cancelled") from None
            except ray.exceptions.RayActorError as exc:
                if not self._retry(handle, exc):
                    return self._failure(exc, handle)
            except ray.exceptions.RayError as exc:
                return self._failure(exc, handle)

    async def score(self, sample: Sample) -> Sample:
        """Score one finished response without blocking the event loop (the rollout path).

        Returns the same sample with reward/correct filled in. Awaiting tasks can be cancelled
        through :meth:`cancel_samples` (e.g. after an abort).
        """
        if route_for(self._cfg.kind, sample.prompt.metadata) == "judge":
            return await self._score_with_judge(sample)
        handle = self.submit(sample)
        self._by_request[sample.request_id] = handle
        try:
            if handle.ref is not None and not handle.done:
                outcome = await self._await_outcome(handle)
                if not handle.cancelled:
                    self._collect(handle, outcome)
        finally:
            self._by_request.pop(sample.request_id, None)
        return handle.sample

    async def _score_with_judge(self, sample: Sample) -> Sample:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        handle = RewardHandle(sample, -1)
        self._by_request[sample.request_id] = handle
        sample.timings["reward_submitted"] = start = time.monotonic()
        try:
            text = self._tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            result = await self._judge.judge(sample.prompt.text, sample.prompt.answer, text)
            outcome = make_outcome(result, "judge", len(sample.response_ids), self._max_new_tokens, self._algo,
                                   time.monotonic() - start)
            if not handle.cancelled:
                self._collect(handle, outcome)
        finally:
            self._by_request.pop(sample.request_id, None)
        return sample

    def cancel_samples(self, samples: list[Sample]) -> None:
        """Cancel pending reward work of these samples (those being scored via :meth:`score`)."""
        self.cancel([self._by_request[s.request_id] for s in samples if s.request_id in self._by_request])

    def _collect(self, handle: RewardHandle, outcome: RewardOutcome) -> None:
        handle.outcome = outcome
        apply_outcome(handle.sample, outcome)
        self.status_counts[outcome.status] = self.status_counts.get(outcome.status, 0) + 1
        timings = handle.sample.timings
        if "reward_submitted" in timings and outcome.source != "judge":
            # Round trip minus the worker's own time: queueing (plus transfer) before it ran.
            self.stats.record(timings["reward_done"] - timings["reward_submitted"] - outcome.elapsed_s,
                              outcome.elapsed_s, outcome.status)
        if outcome.source == "code" and outcome.status == "ok":
            self.timeouts.observe(handle.sample.prompt.prompt_id, outcome.run_s, outcome.correct)
        if handle.ref is not None and handle.worker in self._in_flight:
            self._in_flight[handle.worker].discard(handle.ref)
            self._rescale(allow_shrink=True)

    def _failure(self, exc: Exception, handle: RewardHandle) -> RewardOutcome:
        """Outcome for a task whose worker failed (and retries, if any, are spent): the
        configured failure reward."""
        if not handle.cancelled:
            logger.warning("reward of %s (request %s) failed on worker #%d after %.1f s and %d attempt(s); "
                           "scored timeout_reward=%s: %s", response_label(handle.sample), handle.sample.request_id,
                           handle.worker, self._since_submit(handle), handle.attempts, self._cfg.timeout_reward,
                           exc)
        reward = self._cfg.timeout_reward
        return RewardOutcome(reward, reward, False, "", "error", f"worker failed: {exc}", 0.0)

    def poll(self, handles: list[RewardHandle], timeout_s: float = 0.0
             ) -> tuple[list[RewardHandle], list[RewardHandle]]:
        """Collect whatever finishes within ``timeout_s``: returns (done, pending).

        Done handles have their sample filled in. Cancelled handles are in neither list.
        """
        live = [h for h in handles if not h.cancelled]
        pending = [h for h in live if not h.done]
        if pending and self._use_ray:
            import ray

            by_ref = {h.ref: h for h in pending}
            ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=timeout_s)
            for ref in ready:
                handle = by_ref[ref]
                try:
                    outcome = ray.get(ref, timeout=timeout_s + 60.0)
                except ray.exceptions.RayActorError as exc:
                    if self._retry(handle, exc):
                        continue  # pending again, on its new task
                    outcome = self._failure(exc, handle)
                except (ray.exceptions.RayError, TimeoutError) as exc:
                    outcome = self._failure(exc, handle)
                self._collect(handle, outcome)
        return [h for h in live if h.done], [h for h in live if not h.done]

    def wait(self, handles: list[RewardHandle], timeout_s: float | None = None) -> list[Sample]:
        """Block until every (not cancelled) handle is scored; returns their samples in order.

        Raises TimeoutError naming how many are still pending after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = self.poll(handles, timeout_s=60.0 if remaining is None else remaining)
            if not pending:
                return [h.sample for h in done]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{len(pending)} of {len(done) + len(pending)} rewards still pending after "
                    f"{timeout_s} s (first: {pending[0].sample.prompt.prompt_id}"
                    f"#{pending[0].sample.response_index})"
                )

    def cancel(self, handles: list[RewardHandle]) -> None:
        """Drop these responses: their results are never applied, and their workers stop the work.

        Each owning worker gets one ``skip`` call (fire-and-forget) listing its tasks among
        these; it runs in the actor's control concurrency group, beside the scoring thread. A
        task still queued then returns a 'cancelled' outcome as soon as its turn comes, without
        scoring; a code-sandbox run in progress is killed (a math reward in progress, bounded by
        ``reward.timeout_s``, runs to its end). Until a task returns it counts as its worker's
        load. Cancelled responses are counted in ``reward/cancelled``, not as errors.

        The tasks are deliberately not ``ray.cancel``-ed: a reward worker is an ordered
        (sequential) actor, and cancelling a task its caller has not pushed to the actor yet
        (tail batching cancels responses it accepted moments before) leaves a hole in the
        actor's sequence numbers. The actor then waits 30 s for the missing task and fails
        every task queued behind it, which scored a whole step with ``timeout_reward``.
        """
        by_worker: dict[int, list[int]] = {}
        for handle in handles:
            if handle.done or handle.cancelled:
                continue
            handle.cancelled = True
            self.stats.cancelled += 1
            if handle.ref is not None and handle.task_id is not None and handle.worker in self._workers:
                by_worker.setdefault(handle.worker, []).append(handle.task_id)
        for wid, task_ids in by_worker.items():
            try:
                self._workers[wid].skip.options(concurrency_group=CONTROL_GROUP).remote(task_ids)
            except Exception as exc:  # noqa: BLE001 - a dead worker: its tasks fail (and are dropped) anyway
                logger.debug("reward worker #%d: skip of %d tasks not sent: %s", wid, len(task_ids), exc)

    def step_metrics(self, samples: list[Sample] | None = None) -> dict[str, float]:
        """Reward-scheduler metrics since the last call; with the step's samples also how much
        reward time was hidden under rollout (``reward/hidden_fraction``, ``reward/tail_s``)."""
        metrics = self.stats.drain(self.num_workers)
        metrics["reward/adaptive_anchors"] = float(len(self.timeouts))
        if metrics["reward/timeouts"] or metrics["reward/errors"]:
            logger.warning("reward: %d timeouts and %d errors among %d responses scored since the last step "
                           "(they scored timeout_reward=%s; %d retries)", metrics["reward/timeouts"],
                           metrics["reward/errors"], metrics["reward/scored"], self._cfg.timeout_reward,
                           metrics["reward/retries"])
        if samples:
            metrics.update(reward_overlap(samples))
        return metrics

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every worker (and its grading process) and the judge engine."""
        if self._use_ray:
            import ray

            try:
                ray.get([w.close.remote() for w in self._workers.values()], timeout=timeout_s)
            except ray.exceptions.RayError as exc:
                logger.warning("reward worker close failed: %s", exc)
            for worker in self._workers.values():
                ray.kill(worker)
        else:
            for worker in self._workers.values():
                worker.close()
        self._workers = {}
        self._in_flight = {}
        if self._judge is not None:
            _run_coroutine(self._judge.close())
            self._judge = None


def _run_coroutine(coro) -> None:
    """Run ``coro`` to completion from sync code (a task when a loop is already running)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
    else:
        loop.create_task(coro)
