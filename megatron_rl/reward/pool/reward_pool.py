"""The driver-side reward scheduler: a pool of reward workers fed one response at a time.

Scoring runs in the workers (:class:`~megatron_rl.reward.pool.worker.RewardWorker`), never in the
trainer. A scheduler awaits ``score(sample)`` (or calls ``submit(sample)``) the moment a response
finishes, so rewards overlap with generation of the rest of the batch; results are written into
the ``Sample`` in place, and a step waits only for its last reward.

:class:`RewardPool` is a thin facade over one module per concern:

* :mod:`~megatron_rl.reward.pool.worker_set`: the workers (Ray actors with fractional ``num_cpus``, or
  in-process), their placement, load, dispatch policy and autoscaling
  (:mod:`~megatron_rl.reward.pool.autoscale` decides);
* :mod:`~megatron_rl.reward.pool.dispatch`: one response's task, its retries when the actor lost it,
  and collecting the outcome into the sample; the blocking ``poll``/``wait``;
* :mod:`~megatron_rl.reward.pool.cancellation`: dropping results and telling workers to skip;
* :mod:`~megatron_rl.reward.pool.judge_scoring`: the optional LLM judge, awaited on the driver;
* :mod:`~megatron_rl.reward.pool.metrics`: the per-step ``reward/*`` metrics;
* :mod:`~megatron_rl.reward.pool.adaptive_timeout`: per-problem code timeouts (pool state, checkpointed).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from megatron_rl.config.schema import AlgorithmConfig, RewardConfig, RunConfig
from megatron_rl.reward.pool import cancellation
from megatron_rl.reward.pool.adaptive_timeout import AdaptiveTimeouts, TimeoutPolicy
from megatron_rl.reward.pool.dispatch import Dispatcher
from megatron_rl.reward.pool.handles import RewardHandle
from megatron_rl.reward.pool.judge_scoring import JudgeScorer
from megatron_rl.reward.pool.metrics import RewardStats, step_metrics
from megatron_rl.reward.pool.worker import route_for
from megatron_rl.reward.pool.worker_set import DISPATCH_POLICIES, WorkerSet
from megatron_rl.sample import Sample


class RewardPool:
    """Driver-side dispatcher over reward workers (``reward.num_workers`` at start).

    ``use_ray=True`` (needs ``ray.init`` first) runs each worker as a Ray actor with
    ``num_cpus=reward_cfg.worker_num_cpus`` and autoscales within ``reward.min_workers`` ..
    ``reward.max_workers``; ``use_ray=False`` keeps a fixed set of workers in this process and
    scores synchronously inside ``submit`` (unit tests, debugging). Dispatch is 'least_loaded'
    (fewest responses in flight, ties in round-robin order) or 'round_robin'. ``judge`` (an
    :class:`~megatron_rl.reward.graders.llm_judge.LLMJudge`) scores responses routed to 'judge'.

    Public contract (what the trainer, the schedulers, evaluation and tools may call):

    * ``await score(sample)``: scores one finished response without blocking the event loop and
      returns the same sample. Unless cancelled, the sample comes back with ``reward`` (shaped by
      length), ``raw_reward`` and ``correct`` set and ``timings['reward_submitted' /
      'reward_done' / 'reward_s']`` stamped. Routing by ``reward.kind`` (and, for 'mixed', the
      prompt's ``metadata['format']``): math and code go to a worker, judge to the judge.
    * **timeouts and failures never raise out of** ``score``/``wait``: a response whose grading
      timed out scores ``raw_reward = reward.timeout_reward`` (then length-shaped), status
      'timeout'; one whose worker failed scores ``reward = raw_reward = reward.timeout_reward``,
      status 'error'; neither is correct, and both are counted in ``reward/timeouts`` /
      ``reward/errors`` (and logged with the response's 'prompt_id#index'). Exceptions: with
      in-process workers (``use_ray=False``) a worker's exception propagates from ``submit`` and
      ``score``; a judge engine failure propagates from ``score``; a judge reply slower than
      ``LLMJudge.timeout_s`` (120 s) scores ``timeout_reward`` with status 'timeout' and counts
      in ``status_counts``, but not in the ``reward/*`` queue metrics (``reward/scored``,
      ``reward/timeouts``), which cover worker-scored responses only. A task lost with its actor is
      resubmitted up to ``MAX_RETRIES`` times; once those are spent ``score`` / ``wait`` raise
      ``RewardPoolExhausted`` (the workers keep dying: the run stops cleanly instead).
    * ``cancel_samples(samples)`` (samples being scored through ``score``) and ``cancel(handles)``:
      cancelled samples are never scored: their reward fields stay as they were, their ``score``
      call returns the unscored sample, they count in ``reward/cancelled`` only (not in
      ``status_counts``, not as errors), and their workers skip or stop the work
      (:mod:`~megatron_rl.reward.pool.cancellation`; never ``ray.cancel``). Unknown or finished
      samples are ignored.
    * sync API: ``submit(sample) -> RewardHandle`` (not for judge responses: ValueError),
      ``poll(handles, timeout_s)`` -> (done, pending), ``wait(handles, timeout_s)`` -> samples in
      order (TimeoutError naming how many are pending). Cancelled handles are in neither list.
    * ``step_metrics(samples=None)``: the ``reward/*`` metrics since the last call (the counts
      are per step), with the step's samples also ``reward/hidden_fraction`` and ``reward/tail_s``.
    * ``timeouts``: the adaptive code timeouts; the trainer checkpoints ``timeouts.state_dict()``
      and restores it with ``timeouts.load_state_dict``.
    * ``ready(timeout_s)`` blocks until every worker is up; ``maintain()`` re-evaluates
      autoscaling now (it also runs on each submit and result); ``shutdown(timeout_s)`` stops the
      workers and the judge engine. ``num_workers``, ``num_starting``, ``loads()`` and
      ``status_counts`` report the pool's state.

    A worker runs its tasks one at a time in submission order. The pool is not thread-safe: call
    it from one thread (the event loop's, or one thread running the sync API).
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
        self._by_request: dict[str, RewardHandle] = {}
        self.timeouts = AdaptiveTimeouts(TimeoutPolicy(reward_cfg.code_timeout_scale, reward_cfg.code_timeout_min_s,
                                                       reward_cfg.code_timeout_max_s))
        """Per-problem code timeouts (online anchors)."""
        self.stats = RewardStats()
        """Queue waits, busy workers and scaling events since the last ``step_metrics``."""
        self._workers = WorkerSet(reward_cfg, tokenizer_path, max_new_tokens, algorithm_cfg, self.stats,
                                  remote=use_ray, dispatch=dispatch)
        self.scale_policy = self._workers.policy
        """Autoscaling bounds and triggers (in-process pools never scale)."""
        self._dispatch = Dispatcher(reward_cfg, self._workers, self.stats, self.timeouts)
        self._judge = JudgeScorer(judge, tokenizer_path, max_new_tokens, algorithm_cfg or AlgorithmConfig(),
                                  self._dispatch.collect)

    @classmethod
    def from_run_config(cls, cfg: RunConfig, *, use_ray: bool = True) -> "RewardPool":
        """A pool for a run: tokenizer from ``model.hf_path``, budget ``rollout.max_new_tokens``,
        and for ``reward.kind='judge'`` a judge engine on ``reward.judge_model``."""
        judge = None
        if cfg.reward.kind == "judge":
            from megatron_rl.reward.graders.llm_judge import create_judge

            judge = create_judge(cfg.reward, cfg.rollout, cfg.trainer.seed, use_ray=use_ray)
        return cls(cfg.reward, cfg.model.hf_path, cfg.rollout.max_new_tokens, cfg.algorithm,
                   use_ray=use_ray, judge=judge)

    # ------------------------------------------------------------------ state
    @property
    def num_workers(self) -> int:
        """Number of workers in the pool now."""
        return len(self._workers)

    @property
    def num_starting(self) -> int:
        """Autoscaled workers still starting (not yet given work)."""
        return len(self._workers.starting)

    @property
    def status_counts(self) -> dict[str, int]:
        """How many collected outcomes had each status ('ok', 'timeout', ...)."""
        return self._dispatch.status_counts

    def loads(self) -> list[int]:
        """Responses in flight per worker, in worker order (finished ones are pruned first)."""
        return list(self._workers.loads().values())

    def ready(self, timeout_s: float = 120.0) -> None:
        """Block until every worker is constructed (tokenizer loaded, grading process warm)."""
        self._workers.ready(timeout_s)

    def maintain(self) -> None:
        """Re-evaluate autoscaling now (it otherwise runs on each submit and result)."""
        self._workers.rescale(allow_shrink=True)

    # ------------------------------------------------------------------ async API
    async def score(self, sample: Sample) -> Sample:
        """Score one finished response without blocking the event loop (the rollout path).

        Returns the same sample with reward/correct filled in. Awaiting tasks can be cancelled
        through :meth:`cancel_samples` (e.g. after an abort).
        """
        if route_for(self._cfg.kind, sample.prompt.metadata) == "judge":
            with self._registered(RewardHandle(sample, -1)) as handle:
                await self._judge.score(handle)
            return sample
        handle = self._dispatch.submit(sample)
        with self._registered(handle):
            if handle.ref is not None and not handle.done:
                outcome = await self._dispatch.await_outcome(handle)
                if not handle.cancelled:
                    self._dispatch.collect(handle, outcome)
        return handle.sample

    @contextlib.contextmanager
    def _registered(self, handle: RewardHandle) -> Iterator[RewardHandle]:
        """Make ``handle`` cancellable by its sample while it is being scored."""
        self._by_request[handle.sample.request_id] = handle
        try:
            yield handle
        finally:
            self._by_request.pop(handle.sample.request_id, None)

    def cancel_samples(self, samples: list[Sample]) -> None:
        """Cancel pending reward work of these samples (those being scored via :meth:`score`)."""
        self.cancel([self._by_request[s.request_id] for s in samples if s.request_id in self._by_request])

    # ------------------------------------------------------------------ sync API
    def submit(self, sample: Sample) -> RewardHandle:
        """Send one finished response to a worker now; returns its handle."""
        return self._dispatch.submit(sample)

    def poll(self, handles: list[RewardHandle], timeout_s: float = 0.0
             ) -> tuple[list[RewardHandle], list[RewardHandle]]:
        """Collect whatever finishes within ``timeout_s``: returns (done, pending).

        Done handles have their sample filled in. Cancelled handles are in neither list.
        """
        return self._dispatch.poll(handles, timeout_s)

    def wait(self, handles: list[RewardHandle], timeout_s: float | None = None) -> list[Sample]:
        """Block until every (not cancelled) handle is scored; returns their samples in order.

        Raises TimeoutError naming how many are still pending after ``timeout_s``.
        """
        return self._dispatch.wait(handles, timeout_s)

    def cancel(self, handles: list[RewardHandle]) -> None:
        """Drop these responses: their results are never applied, and their workers stop the work
        (see :mod:`~megatron_rl.reward.pool.cancellation` for how, and why not ``ray.cancel``)."""
        cancellation.cancel(handles, self._workers, self.stats)

    # ------------------------------------------------------------------ metrics, shutdown
    def step_metrics(self, samples: list[Sample] | None = None) -> dict[str, float]:
        """Reward-scheduler metrics since the last call; with the step's samples also how much
        reward time was hidden under rollout (``reward/hidden_fraction``, ``reward/tail_s``)."""
        return step_metrics(self.stats, self.num_workers, len(self.timeouts), self._cfg.timeout_reward, samples)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every worker (and its grading process) and the judge engine."""
        self._workers.close(timeout_s)
        self._judge.close()
