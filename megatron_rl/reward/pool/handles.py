"""One response's trip through the reward pool: its handle, and how an outcome lands on the sample."""
from __future__ import annotations

import time
from typing import Any

from megatron_rl.reward.pool.worker import RewardOutcome
from megatron_rl.sample import Sample


def response_label(sample: Sample) -> str:
    """How warnings name a response: 'prompt_id#index'."""
    return f"{sample.prompt.prompt_id}#{sample.response_index}"


class RewardHandle:
    """One submitted response: the sample, where it went, and its outcome once known."""

    def __init__(self, sample: Sample, worker: int, ref: Any = None,
                 outcome: RewardOutcome | None = None, task_id: int | None = None) -> None:
        self.sample = sample
        """The sample being scored; filled in place when the outcome is collected."""
        self.worker = worker
        """Index of the worker it was dispatched to."""
        self.ref = ref
        """Ray ObjectRef of the pending result (None in-process)."""
        self.task_id = task_id
        """The pool's number for the current task (what :meth:`RewardWorker.skip` takes)."""
        self.outcome = outcome
        """The worker's outcome, once collected."""
        self.cancelled = False
        """Set by :meth:`RewardPool.cancel`; a cancelled handle never gets an outcome."""
        self.attempts = 1
        """Tasks submitted for this response (more than one after a lost task was retried)."""

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
