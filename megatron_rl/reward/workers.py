"""Reward workers and the driver-side pool that feeds them one response at a time.

Scoring runs in the workers, never in the trainer: :class:`RewardWorker` decodes the response
tokens, grades them with the math rule (:class:`~megatron_rl.reward.math_reward.MathReward`,
itself time-limited in a killable child process) and applies DAPO's overlong shaping. On a
cluster each worker is a Ray actor with a fractional ``num_cpus`` (light actors must not block
placement groups of the trainer and engines); in unit tests the same class runs in-process.

:class:`RewardPool` lives on the driver. A scheduler calls ``submit(sample)`` the moment a
response finishes, so rewards overlap with generation of the rest of the batch, then
``poll``/``wait`` for results, which are written into the ``Sample`` in place.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from megatron_rl.algorithms.shaping import shaped_reward
from megatron_rl.config import AlgorithmConfig, RewardConfig, RunConfig
from megatron_rl.reward.math_reward import MathReward
from megatron_rl.sample import Sample

logger = logging.getLogger(__name__)

REWARD_KINDS = ("math",)
DISPATCH_POLICIES = ("least_loaded", "round_robin")


@dataclass
class RewardOutcome:
    """What a worker reports for one response."""

    raw_reward: float
    """Rule reward before shaping (``timeout_reward`` on timeout/failure)."""
    reward: float
    """Reward after overlong shaping: what advantages use."""
    correct: bool
    """Whether the answer matched the ground truth."""
    extracted: str
    """The answer found in the response ('' if none)."""
    status: str
    """'ok', 'no_answer', 'timeout' or 'error' (see ``RewardResult.status``)."""
    detail: str
    """Why a non-'ok' status happened."""
    elapsed_s: float
    """Seconds the worker spent scoring (decode + grade)."""


class RewardWorker:
    """Scores responses: decode tokens, grade the answer, shape by length.

    Plain class; :class:`RewardPool` wraps it as a Ray actor or uses it in-process.
    """

    def __init__(self, reward_cfg: RewardConfig, tokenizer_path: str, max_new_tokens: int,
                 algorithm_cfg: AlgorithmConfig | None = None, eager_start: bool = True) -> None:
        """``eager_start`` starts the grading process now rather than on the first response."""
        if reward_cfg.kind not in REWARD_KINDS:
            raise ValueError(f"reward.kind={reward_cfg.kind!r}: expected one of {REWARD_KINDS}")
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"reward worker cannot load the tokenizer from {tokenizer_path!r}: {exc}") from exc
        self._cfg = reward_cfg
        self._algo = algorithm_cfg or AlgorithmConfig()
        self._max_new_tokens = max_new_tokens
        # Surface a bad shaping config at start-up, not on the first response.
        shaped_reward(0.0, 0, max_new_tokens, self._algo.overlong_buffer_tokens, self._algo.overlong_penalty)
        self._reward = MathReward(reward_cfg.timeout_s, reward_cfg.timeout_reward)
        if eager_start:
            self._reward.start()

    def score(self, response_ids: list[int], ground_truth: str, label: str = "") -> RewardOutcome:
        """Score one response given its generated token ids and the prompt's ground truth.

        ``label`` (e.g. 'prompt_id#index') only names the response in warnings.
        """
        start = time.monotonic()
        text = self._tokenizer.decode(response_ids, skip_special_tokens=True)
        result = self._reward(text, ground_truth)
        if result.status in ("timeout", "error"):
            logger.warning("reward %s for %s: %s", result.status, label or "a response", result.detail)
        reward = shaped_reward(result.reward, len(response_ids), self._max_new_tokens,
                               self._algo.overlong_buffer_tokens, self._algo.overlong_penalty)
        return RewardOutcome(result.reward, reward, result.correct, result.extracted,
                             result.status, result.detail, time.monotonic() - start)

    def ping(self) -> bool:
        """Liveness check (returns True once the worker is constructed)."""
        return True

    def close(self) -> None:
        """Stop the grading process."""
        self._reward.close()


class RewardHandle:
    """One submitted response: the sample, where it went, and its outcome once known."""

    def __init__(self, sample: Sample, worker: int, ref: Any = None,
                 outcome: RewardOutcome | None = None) -> None:
        self.sample = sample
        """The sample being scored; filled in place when the outcome is collected."""
        self.worker = worker
        """Index of the worker it was dispatched to."""
        self.ref = ref
        """Ray ObjectRef of the pending result (None in-process)."""
        self.outcome = outcome
        """The worker's outcome, once collected."""
        self.cancelled = False
        """Set by :meth:`RewardPool.cancel`; a cancelled handle never gets an outcome."""

    @property
    def done(self) -> bool:
        """Whether the outcome has been collected (and applied to the sample)."""
        return self.outcome is not None


def apply_outcome(sample: Sample, outcome: RewardOutcome) -> None:
    """Write a worker's outcome into ``sample`` (reward, raw_reward, correct, timings)."""
    sample.raw_reward = outcome.raw_reward
    sample.reward = outcome.reward
    sample.correct = outcome.correct
    sample.timings["reward_done"] = time.monotonic()
    sample.timings["reward_s"] = outcome.elapsed_s


class RewardPool:
    """Driver-side dispatcher over ``reward_cfg.num_workers`` reward workers.

    ``use_ray=True`` (needs ``ray.init`` first) runs each worker as a Ray actor with
    ``num_cpus=reward_cfg.worker_num_cpus``; ``use_ray=False`` keeps the workers in this process
    and scores synchronously inside ``submit`` (unit tests, debugging). Dispatch is
    'least_loaded' (fewest responses in flight, ties in round-robin order) or 'round_robin'.
    """

    def __init__(self, reward_cfg: RewardConfig, tokenizer_path: str, max_new_tokens: int,
                 algorithm_cfg: AlgorithmConfig | None = None, *, use_ray: bool = True,
                 dispatch: str = "least_loaded") -> None:
        if reward_cfg.num_workers < 1:
            raise ValueError(f"reward.num_workers={reward_cfg.num_workers} must be >= 1")
        if dispatch not in DISPATCH_POLICIES:
            raise ValueError(f"dispatch={dispatch!r}: expected one of {DISPATCH_POLICIES}")
        self._cfg = reward_cfg
        self._use_ray = use_ray
        self._dispatch = dispatch
        self._cursor = itertools.count()
        self._in_flight: list[set] = [set() for _ in range(reward_cfg.num_workers)]
        self._by_request: dict[str, RewardHandle] = {}
        self.status_counts: dict[str, int] = {}
        """How many collected outcomes had each status ('ok', 'timeout', ...)."""
        args = (reward_cfg, tokenizer_path, max_new_tokens, algorithm_cfg)
        if use_ray:
            import ray

            actor_cls = ray.remote(num_cpus=reward_cfg.worker_num_cpus, num_gpus=0,
                                   max_restarts=1)(RewardWorker)
            self._workers = [actor_cls.remote(*args) for _ in range(reward_cfg.num_workers)]
        else:
            # Lazy start: in-process grading children start on the first response.
            self._workers = [RewardWorker(*args, eager_start=False)
                             for _ in range(reward_cfg.num_workers)]

    @classmethod
    def from_run_config(cls, cfg: RunConfig, *, use_ray: bool = True) -> "RewardPool":
        """A pool for a run: tokenizer from ``model.hf_path``, budget ``rollout.max_new_tokens``."""
        return cls(cfg.reward, cfg.model.hf_path, cfg.rollout.max_new_tokens, cfg.algorithm,
                   use_ray=use_ray)

    @property
    def num_workers(self) -> int:
        """Number of workers in the pool."""
        return len(self._workers)

    def ready(self, timeout_s: float = 120.0) -> None:
        """Block until every worker is constructed (tokenizer loaded, grading process warm)."""
        if self._use_ray:
            import ray

            ray.get([w.ping.remote() for w in self._workers], timeout=timeout_s)

    def loads(self) -> list[int]:
        """Responses in flight per worker (finished ones are pruned first)."""
        if self._use_ray:
            import ray

            for refs in self._in_flight:
                if refs:
                    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                    refs.difference_update(done)
        return [len(refs) for refs in self._in_flight]

    def _pick_worker(self) -> int:
        start = next(self._cursor) % self.num_workers
        if self._dispatch == "round_robin":
            return start
        loads = self.loads()
        order = [(start + k) % self.num_workers for k in range(self.num_workers)]
        return min(order, key=lambda i: loads[i])  # min keeps the first (round-robin) on ties

    def submit(self, sample: Sample) -> RewardHandle:
        """Send one finished response to a worker now; returns its handle."""
        index = self._pick_worker()
        sample.timings["reward_submitted"] = time.monotonic()
        args = (sample.response_ids, sample.prompt.answer,
                f"{sample.prompt.prompt_id}#{sample.response_index}")
        if not self._use_ray:
            handle = RewardHandle(sample, index)
            self._collect(handle, self._workers[index].score(*args))
            return handle
        ref = self._workers[index].score.remote(*args)
        self._in_flight[index].add(ref)
        return RewardHandle(sample, index, ref=ref)

    async def score(self, sample: Sample) -> Sample:
        """Score one finished response without blocking the event loop (the rollout path).

        Returns the same sample with reward/correct filled in. Awaiting tasks can be cancelled
        through :meth:`cancel_samples` (e.g. after an abort).
        """
        handle = self.submit(sample)
        self._by_request[sample.request_id] = handle
        try:
            if handle.ref is not None and not handle.done:
                import ray

                try:
                    outcome = await handle.ref
                except ray.exceptions.TaskCancelledError:
                    raise asyncio.CancelledError(f"reward of {sample.request_id} cancelled") from None
                except ray.exceptions.RayError as exc:
                    outcome = self._failure(exc)
                if not handle.cancelled:
                    self._collect(handle, outcome)
        finally:
            self._by_request.pop(sample.request_id, None)
        return handle.sample

    def cancel_samples(self, samples: list[Sample]) -> None:
        """Cancel pending reward work of these samples (those being scored via :meth:`score`)."""
        self.cancel([self._by_request[s.request_id] for s in samples if s.request_id in self._by_request])

    def _collect(self, handle: RewardHandle, outcome: RewardOutcome) -> None:
        handle.outcome = outcome
        apply_outcome(handle.sample, outcome)
        self.status_counts[outcome.status] = self.status_counts.get(outcome.status, 0) + 1
        if handle.ref is not None:
            self._in_flight[handle.worker].discard(handle.ref)

    def _failure(self, exc: Exception) -> RewardOutcome:
        """Outcome for a task whose worker crashed: the configured failure reward."""
        logger.warning("reward worker task failed: %s", exc)
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
                try:
                    outcome = ray.get(ref, timeout=timeout_s + 60.0)
                except (ray.exceptions.RayError, TimeoutError) as exc:
                    outcome = self._failure(exc)
                self._collect(by_ref[ref], outcome)
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
        """Drop these responses: queued tasks are cancelled, results never applied.

        A task already running finishes in its worker (it is time-limited anyway) and its
        result is discarded.
        """
        for handle in handles:
            if handle.done or handle.cancelled:
                continue
            handle.cancelled = True
            if handle.ref is not None:
                import ray

                try:
                    ray.cancel(handle.ref)
                except (ray.exceptions.RayError, ValueError, TypeError) as exc:
                    logger.debug("ray.cancel failed for a reward task: %s", exc)
                self._in_flight[handle.worker].discard(handle.ref)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every worker (and its grading process)."""
        if self._use_ray:
            import ray

            try:
                ray.get([w.close.remote() for w in self._workers], timeout=timeout_s)
            except ray.exceptions.RayError as exc:
                logger.warning("reward worker close failed: %s", exc)
            for worker in self._workers:
                ray.kill(worker)
        else:
            for worker in self._workers:
                worker.close()
        self._workers = []
