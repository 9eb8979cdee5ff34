"""The extension seam of the training loop: what a rollout policy (e.g. RollPacker) plugs into.

Three kinds of extension, all named in the config and assembled by ``megatron_rl.train``:

* :class:`RolloutScheduler` (``scheduler.name``) decides which prompts are generated, how many
  responses each gets, when to stop and what to abort. It returns one training batch (P0
  complete groups) per step. The baseline (veRL-style: submit P0 x R0, wait for all) lives in
  ``megatron_rl.loop.baseline``; RollPacker's tail batching in ``rollpacker.tail_batching``; the
  peers it is measured against (partial rollout, one-step-off async) in ``rollpacker.peers``.
  A scheduler declares how stale its data may be (:meth:`RolloutScheduler.max_staleness`, 0:
  strictly on-policy); the loop holds every trained token to that bound
  (``megatron_rl.loop.off_policy``) and trains older tokens with truncated importance weights.
* :class:`TrainerPlugin` (built by plug-in factories, see ``megatron_rl.config.plugins``) gets named
  points of every step, in this order::

      before_rollout(step, round_type)   e.g. rebuild the engines at another TP (elastic TP)
        on_round_start / on_group_complete   during the rollout (e.g. start streaming gradients)
      after_rollout(step, batch)         e.g. feed the round's preemptions to a planner
        on_batch_ready(step, batch)
      takes_over_training(step) -> train(step, batch, samples)   at most one plug-in per step
      on_step_end(step, metrics)

  A plug-in's ``state_dict()`` goes into every checkpoint under its ``name``.
* :class:`StepHook` is the observer subset of a plug-in (the group/batch/step callbacks).

Plug-ins reach the loop only through :class:`LoopServices` (given to :meth:`TrainerPlugin.attach`):
the engine, the owner of device memory (``colocation``), the owner of weight sync, and the
trainer's own preparation and gradient steps. Schedulers get what they may touch through
:class:`RolloutContext`. Neither ever sees a Megatron worker, so scheduling logic stays
testable with a fake engine.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

from megatron_rl.config.schema import RunConfig
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.sample import Prompt, Sample

if TYPE_CHECKING:  # types only: schedulers import this module and need neither
    from megatron_rl.rollout.weight_sync.sync import WeightSync
    from megatron_rl.training.colocation import Colocation


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
    """Version of the weights now loaded in the engine: requests submitted now generate with it
    (the loop trains a sample only if every token is within the scheduler's staleness bound of
    the trainer's version)."""
    step: int
    """Training step being assembled."""
    on_round_start: Callable[[str, int], None] = lambda round_type, num_groups: None
    """Call once per step before the first request, with the round type and the number of groups
    the batch will hold (forwarded to plug-ins; the stream trainer decides here whether to stream)."""
    on_group_complete: Callable[[list[Sample]], None] = lambda group: None
    """Call with each group the moment it is complete and scored (forwarded to plug-ins)."""
    epoch: Callable[[], int] = lambda: 0
    """The data cursor's epoch now (of the prompts ``next_prompts`` just returned; a rollout
    history tells earlier epochs from this one by it)."""


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
        """Generate, score and return the step's groups. Requests it starts must be finished or
        aborted by the time :meth:`before_weight_sync` returns (no request runs across a weight
        change); a synchronous scheduler leaves none running when it returns."""

    def max_staleness(self, cfg: RunConfig) -> int:
        """The most policy versions any token of a batch may lag behind the policy that trains
        it. 0 (the default; the baseline and tail batching): strictly on-policy, the loop refuses
        any older token. More: the loop trains tokens up to that old with the engine's logprobs
        as the behaviour policy and truncated importance weights (``algorithm.tis_cap``;
        ``algorithm.off_policy_tis_cap`` turns it on), and refuses anything older."""
        return 0

    async def before_weight_sync(self, step: int) -> dict[str, float]:
        """Step ``step`` has trained; the new weights go to the engines next. A scheduler whose
        generation overlaps training (one-step-off async) finishes it here: what runs now runs on
        the old weights. Returns metrics (``time/*`` keys become the step's phases). Default:
        nothing runs past :meth:`next_batch`."""
        return {}

    def next_round_type(self, cfg: RunConfig) -> str:
        """The round type the next :meth:`next_batch` will run (plug-ins get it in
        ``before_rollout``, e.g. the elastic planner picks the engines' TP for it). Default: the
        scheduler's name."""
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


@dataclass
class TrainResult:
    """What a plug-in that took over a step's training hands back."""

    train_metrics: dict
    """The optimizer step's metrics, as the policy's ``train_step`` reports them."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The plug-in's own metrics for the step (e.g. stream/*)."""
    trained: list[Sample] = field(default_factory=list)
    """Every sample whose gradient went into the step; the plug-in has checked that these are
    exactly the prepared samples it was given, each once."""


class LoopServices(Protocol):
    """What the trainer offers its plug-ins (``megatron_rl.loop.trainer.Trainer`` implements it)."""

    cfg: RunConfig
    engine: RolloutEngine
    """The engines the loop generates with (after every plug-in factory had its say)."""
    colocation: "Colocation"
    """The one owner of device memory: engine sleep / trainer offload order, engine lending."""
    weight_sync: "WeightSync"
    """The one owner of weight movement into the engines (per step, and for new engines)."""
    version: int
    """Policy version now in the engines (the number of optimizer steps taken)."""

    async def train_groups(self, groups: list[list[Sample]], replicas: list[int] | None = None) -> list[Sample]:
        """The loop's preparation of complete groups (zero-variance filter, advantages, on-policy
        check, old/ref logprobs) followed by forward/backward with gradients accumulated and no
        optimizer step, on every trainer rank or (``replicas``) on those DP replicas' ranks only;
        returns the samples trained (filtered groups are skipped)."""
        ...

    async def apply_gradients(self, trained: list[Sample]) -> dict:
        """The single optimizer step over everything :meth:`train_groups` accumulated,
        normalised by ``trained``'s token and sequence counts; returns its metrics."""
        ...


class TrainerPlugin(StepHook):
    """A policy that plugs into the loop (see the module docstring for the order of calls).

    Every method has a do-nothing default, so a plug-in overrides only what it needs. Async
    methods run on the loop's event loop (reward tasks keep running meanwhile); metrics they
    return are merged into the step's record."""

    name: str = "plugin"
    """Key of the plug-in's state in checkpoints and prefix of its log lines; unique per run."""

    def attach(self, loop: LoopServices) -> None:
        """Called once by the trainer before the first step, with the services above."""

    async def before_rollout(self, step: int, round_type: str) -> dict[str, float]:
        """Before the step's rollout of ``round_type`` starts (no request in flight)."""
        return {}

    async def after_rollout(self, step: int, batch: RolloutBatch) -> dict[str, float]:
        """The rollout is done (no request in flight), before the engines make room for training."""
        return {}

    def takes_over_training(self, step: int) -> bool:
        """Whether :meth:`train` trains this step instead of the loop's logprob + train step."""
        return False

    async def train(self, step: int, batch: RolloutBatch, samples: list[Sample]) -> TrainResult:
        """Train the step's prepared ``samples`` (advantages set, on-policy checked); only called
        when :meth:`takes_over_training` said so. Must take exactly one optimizer step over exactly
        ``samples`` and check that itself."""
        raise RuntimeError(f"plug-in {self.name} did not take over training of step {step}")

    def state_dict(self) -> dict:
        """State to checkpoint under :attr:`name` (planner decisions...). Default: none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (an empty dict when the checkpoint has none)."""


@dataclass
class PluginSetup:
    """What a plug-in factory gets at assembly time (``megatron_rl.train``), before the loop exists."""

    cfg: RunConfig
    device: str
    """'cpu' or 'cuda'."""
    engine: RolloutEngine
    """The engines built from ``rollout.*``."""
    engine_factory: Callable[[int, str], Awaitable[RolloutEngine]]
    """``engine_factory(tp, weights_dir)``: engines at rollout TP ``tp`` on the same rollout
    devices (``devices // tp`` of them), started from the weights in ``weights_dir``."""


@dataclass
class PluginSet:
    """What a plug-in factory returns: the engine the loop should use (the given one, or a
    wrapper around it) and its plug-ins."""

    engine: RolloutEngine
    plugins: list[TrainerPlugin] = field(default_factory=list)


PluginFactory = Callable[[PluginSetup], PluginSet]
"""Builds a package's plug-ins from the config (``rollpacker.plugins.build`` for RollPacker)."""
