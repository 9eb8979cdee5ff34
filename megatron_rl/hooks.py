"""Hook points of the training loop: what a rollout policy (e.g. RollPacker) plugs into.

Two kinds of hook:

* :class:`RolloutScheduler` decides which prompts are generated, how many responses each gets,
  when to stop and what to abort. It returns one training batch (P0 complete groups) per step.
  The baseline (veRL-style: submit P0 x R0, wait for all) lives in ``megatron_rl.baseline``.
* :class:`StepHook` observers: called when a group completes during rollout (a stream trainer can
  start on it), after the batch is assembled, and at the end of each step (metrics, plots).

Schedulers get everything they may touch through :class:`RolloutContext`; they never see the
trainer's Megatron workers, so scheduling logic stays testable with a fake engine.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from megatron_rl.config import RunConfig
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.sample import Prompt, Sample


@dataclass
class RolloutContext:
    """What a scheduler may use during one step."""

    cfg: RunConfig
    """The run's configuration (P0 = data.prompts_per_step, R0 = data.responses_per_prompt)."""
    engine: RolloutEngine
    """Where requests go (one request per response)."""
    score: Callable[[Sample], Awaitable[Sample]]
    """Scores one finished response asynchronously (reward workers); returns the same sample."""
    cancel_scores: Callable[[list[Sample]], None]
    """Cancels pending reward work of samples that will not be used (after an abort)."""
    next_prompts: Callable[[int], list[Prompt]]
    """Takes the next n prompts from the data cursor (exactly-once over an epoch)."""
    policy_version: int
    """Version of the weights now loaded in the engine; every trained sample must carry it."""
    step: int
    """Training step being assembled."""
    on_round_start: Callable[[str, int], None] = lambda round_type, num_groups: None
    """Call once per step before the first request, with the round type and the number of groups
    the batch will hold (forwarded to StepHooks; the stream trainer decides here whether to stream)."""
    on_group_complete: Callable[[list[Sample]], None] = lambda group: None
    """Call with each group the moment it is complete and scored (forwarded to StepHooks)."""


@dataclass
class RolloutBatch:
    """One step's training input: complete groups of R0 scored samples each."""

    groups: list[list[Sample]]
    """P0 groups (fewer only when the data ran out); every sample scored."""
    round_type: str = "baseline"
    """Scheduler's name for this round (baseline / short / long)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Scheduler metrics (requests launched, aborted, wasted tokens, queue length...)."""
    requests: list[tuple[float, float, str]] = field(default_factory=list)
    """(submit, finish, finish_reason) of every request of the round, aborted ones included
    (engine occupancy and the rollout timeline plot)."""
    rollout_window: tuple[float, float] = (0.0, 0.0)
    """Start and end of the rollout phase (time.monotonic())."""
    filtered_prompt_ids: list[str] = field(default_factory=list)
    """Prompts deliberately dropped this step (DAPO zero-variance groups): neither trained nor queued."""

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]


class RolloutScheduler(abc.ABC):
    """Produces one batch per step. Holds state that must survive a restart (e.g. queues)."""

    name: str = "scheduler"

    @abc.abstractmethod
    async def next_batch(self, ctx: RolloutContext) -> RolloutBatch:
        """Generate, score and return the step's groups. Must leave no request running."""

    def next_round_type(self, cfg: RunConfig) -> str:
        """The round type the next :meth:`next_batch` will run (the elastic planner picks the
        engines' TP for it before the round starts). Default: the scheduler's name."""
        return self.name

    def state_dict(self) -> dict:
        """Scheduler state to checkpoint (queues, counters). Default: stateless."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict returned."""


class StepHook:
    """Observer of the loop. Override what you need; every method is optional."""

    def on_round_start(self, step: int, round_type: str, num_groups: int) -> None:
        """The step's rollout is about to start: its round type and how many groups it will yield."""

    def on_group_complete(self, step: int, group: list[Sample]) -> None:
        """A group finished generation and scoring during rollout (stream-trainer entry point)."""

    def on_batch_ready(self, step: int, batch: RolloutBatch) -> None:
        """The step's batch is assembled, before advantages and training."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """The step (train + weight sync) is done; metrics are final."""
