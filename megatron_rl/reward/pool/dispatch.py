"""One response's trip to a reward worker and back: dispatch, retries, and collecting the outcome.

Contract of :class:`Dispatcher`:

* **what is sent**: the response's token ids, the prompt's answer and metadata, a label naming
  it in warnings ('prompt_id#index') and, for code responses, the timeout: the problem's
  adaptive timeout (``reward.adaptive_timeout``, from
  :class:`~megatron_rl.reward.pool.adaptive_timeout.AdaptiveTimeouts`) or ``reward.code_timeout_max_s``.
  Math responses use the worker's fixed ``reward.timeout_s``. Judge responses are never sent
  (ValueError: the judge scores on the driver). Every task carries an increasing task id, so a
  worker runs its tasks in submission order and can be told to skip some.
* **in-process workers** score inside :meth:`submit`; their exceptions propagate to the caller.
* **Ray workers**: a task lost with its actor (``RayActorError``: the actor died or dropped its
  queue; scoring is pure, so running it twice is harmless) is resubmitted, to the worker dispatch
  picks then, up to :data:`MAX_RETRIES` times; once they are spent the pool is dying (Ray
  restarts a worker once), and :class:`RewardPoolExhausted` is raised out of ``score`` / ``poll``
  / ``wait`` instead of scoring: a run must stop, not train on failure rewards. Any other Ray
  error (an exception raised by the scoring itself, not retried) gives the failure outcome:
  reward and raw reward ``reward.timeout_reward``, not correct, status 'error', logged with the
  response's label.
* **collecting** (:meth:`collect`) writes reward, raw_reward, correct and the reward timings
  into the sample, counts the status, records queue wait and worker time in the pool's stats
  (not for judge outcomes, which have no queue), feeds correct code runs to the adaptive
  timeouts, and releases the task from its worker's load. Cancelled handles are never
  collected (callers check ``handle.cancelled``; :meth:`poll` and :meth:`wait` skip them).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from megatron_rl.config.schema import RewardConfig
from megatron_rl.reward.pool.adaptive_timeout import AdaptiveTimeouts
from megatron_rl.reward.pool.handles import RewardHandle, apply_outcome, response_label
from megatron_rl.reward.pool.metrics import RewardStats
from megatron_rl.reward.pool.worker import RewardOutcome, route_for
from megatron_rl.reward.pool.worker_set import WorkerSet
from megatron_rl.sample import Sample

logger = logging.getLogger(__name__)

MAX_RETRIES = 2
"""Resubmissions of one response whose task was lost with its actor (RayActorError)."""


class RewardPoolExhausted(RuntimeError):
    """A response's task was lost with its worker more than :data:`MAX_RETRIES` times: the reward
    workers keep dying faster than Ray restarts them, and nothing is left to score with."""


class Dispatcher:
    """Sends responses to the workers of a :class:`WorkerSet` and collects their outcomes."""

    def __init__(self, reward_cfg: RewardConfig, workers: WorkerSet, stats: RewardStats,
                 timeouts: AdaptiveTimeouts) -> None:
        self._cfg = reward_cfg
        self._workers = workers
        self._stats = stats
        self._timeouts = timeouts
        self._task_ids = itertools.count()  # increasing: a worker runs its tasks in this order
        self.status_counts: dict[str, int] = {}
        """How many collected outcomes had each status ('ok', 'timeout', ...)."""

    # ------------------------------------------------------------------ sending
    def _timeout_for(self, sample: Sample, route: str) -> float | None:
        if route != "code":
            return None  # the math reward's fixed reward.timeout_s
        if not self._cfg.adaptive_timeout:
            return self._cfg.code_timeout_max_s
        return self._timeouts.timeout_s(sample.prompt.prompt_id, sample.prompt.metadata)

    def _score_args(self, sample: Sample) -> tuple:
        route = route_for(self._cfg.kind, sample.prompt.metadata)
        if route == "judge":
            raise ValueError(f"{sample.request_id}: judge rewards are scored on the driver; await score()")
        return (sample.response_ids, sample.prompt.answer, response_label(sample), sample.prompt.metadata,
                self._timeout_for(sample, route))

    def _send(self, args: tuple, avoid: int | None = None) -> tuple[int, Any, int]:
        """Send a scoring task to a Ray worker (not ``avoid`` while another exists): (worker
        index, ObjectRef, task id)."""
        index = self._workers.pick(avoid)
        task_id = next(self._task_ids)
        ref = self._workers.actors[index].score.remote(*args, task_id=task_id)
        self._workers.track(index, ref)
        self._workers.rescale(allow_shrink=False)
        return index, ref, task_id

    def submit(self, sample: Sample) -> RewardHandle:
        """Send one finished response to a worker now; returns its handle (already done with
        in-process workers)."""
        args = self._score_args(sample)
        sample.timings["reward_submitted"] = time.monotonic()
        if not self._workers.remote:
            index = self._workers.pick()
            handle = RewardHandle(sample, index)
            self.collect(handle, self._workers.actors[index].score(*args))
            return handle
        index, ref, task_id = self._send(args)
        return RewardHandle(sample, index, ref=ref, task_id=task_id)

    def _retry(self, handle: RewardHandle, exc: Exception) -> bool:
        """Resubmit a task its actor lost; False once ``MAX_RETRIES`` resubmissions are spent."""
        if handle.cancelled or handle.attempts > MAX_RETRIES:
            return False
        lost_on = handle.worker
        self._workers.release(lost_on, handle.ref)
        # Not back to the worker that lost it: Ray restarts it, and tasks sent meanwhile are lost too.
        handle.worker, handle.ref, handle.task_id = self._send(self._score_args(handle.sample), avoid=lost_on)
        handle.attempts += 1
        self._stats.retries += 1
        logger.warning("reward of %s (request %s) lost on worker #%d after %.1f s, resubmitted to worker #%d "
                       "(attempt %d of %d): %s", response_label(handle.sample), handle.sample.request_id, lost_on,
                       _since_submit(handle), handle.worker, handle.attempts, MAX_RETRIES + 1, exc)
        return True

    # ------------------------------------------------------------------ outcomes
    async def await_outcome(self, handle: RewardHandle) -> RewardOutcome:
        """The outcome of a Ray task, retrying tasks lost with their actor. Raises
        ``asyncio.CancelledError`` when Ray cancelled the task."""
        import ray

        while True:
            try:
                return await handle.ref
            except ray.exceptions.TaskCancelledError:
                raise asyncio.CancelledError(f"reward of {handle.sample.request_id} cancelled") from None
            except ray.exceptions.RayActorError as exc:
                if not self._retry(handle, exc):
                    return self._lost(exc, handle)
            except ray.exceptions.RayError as exc:
                return self._failure(exc, handle)

    def collect(self, handle: RewardHandle, outcome: RewardOutcome) -> None:
        """Apply ``outcome`` to the handle's sample and account for it (module docstring)."""
        handle.outcome = outcome
        apply_outcome(handle.sample, outcome)
        self.status_counts[outcome.status] = self.status_counts.get(outcome.status, 0) + 1
        timings = handle.sample.timings
        if "reward_submitted" in timings and outcome.source != "judge":
            # Round trip minus the worker's own time: queueing (plus transfer) before it ran.
            self._stats.record(timings["reward_done"] - timings["reward_submitted"] - outcome.elapsed_s,
                               outcome.elapsed_s, outcome.status)
        if outcome.source == "code" and outcome.status == "ok":
            self._timeouts.observe(handle.sample.prompt.prompt_id, outcome.run_s, outcome.correct)
        if handle.ref is not None and self._workers.release(handle.worker, handle.ref):
            self._workers.rescale(allow_shrink=True)

    def _lost(self, exc: Exception, handle: RewardHandle) -> RewardOutcome:
        """A task lost with its actor once more after its resubmissions: the pool is exhausted
        (a cancelled response just gets the failure outcome, which nobody reads)."""
        if handle.cancelled:
            return self._failure(exc, handle)
        from megatron_rl.distributed.errors import one_line

        raise RewardPoolExhausted(
            f"the reward pool is exhausted: the reward of {response_label(handle.sample)} (request "
            f"{handle.sample.request_id}) was lost with its worker {handle.attempts + 1} times ({handle.attempts} "
            f"resubmissions, the last to worker #{handle.worker}); {len(self._workers)} worker(s) in the pool, "
            f"each restarted by Ray at most once; last error: {one_line(exc)}") from exc

    def _failure(self, exc: Exception, handle: RewardHandle) -> RewardOutcome:
        """Outcome for a task whose worker failed (and retries, if any, are spent): the
        configured failure reward."""
        if not handle.cancelled:
            logger.warning("reward of %s (request %s) failed on worker #%d after %.1f s and %d attempt(s); "
                           "scored timeout_reward=%s: %s", response_label(handle.sample), handle.sample.request_id,
                           handle.worker, _since_submit(handle), handle.attempts, self._cfg.timeout_reward, exc)
        reward = self._cfg.timeout_reward
        return RewardOutcome(reward, reward, False, "", "error", f"worker failed: {exc}", 0.0)

    # ------------------------------------------------------------------ blocking API
    def poll(self, handles: list[RewardHandle], timeout_s: float = 0.0
             ) -> tuple[list[RewardHandle], list[RewardHandle]]:
        """Collect whatever finishes within ``timeout_s``: returns (done, pending).

        Done handles have their sample filled in. Cancelled handles are in neither list.
        """
        live = [h for h in handles if not h.cancelled]
        pending = [h for h in live if not h.done]
        if pending and self._workers.remote:
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
                    outcome = self._lost(exc, handle)
                except (ray.exceptions.RayError, TimeoutError) as exc:
                    outcome = self._failure(exc, handle)
                self.collect(handle, outcome)
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


def _since_submit(handle: RewardHandle) -> float:
    submitted = handle.sample.timings.get("reward_submitted")
    return 0.0 if submitted is None else time.monotonic() - submitted
