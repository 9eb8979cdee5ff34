"""One-step-off-policy asynchronous rollout (veRL's ``one_step_off``) as a rollout scheduler: a
peer tail batching is measured against.

The rollout of step t+1 runs while step t trains. Each generation is the baseline's (P0 prompts
x R0 responses, wait for all: ``megatron_rl.loop.baseline``), started as soon as step t's batch is
handed to the loop, on the weights of version t still in the engine; it must end before the
weights change, so the loop's ``before_weight_sync`` waits for it (the wait is the rollout time
training did not hide, ``time/rollout_wait``). Step t+1 then trains that batch with the policy
at version t+1: every token is exactly one version old (the staleness bound this scheduler
declares), except step 0's batch, generated on the spot, on-policy.

``peers.one_step_off.max_staleness`` = k > 1 runs the rollout k steps ahead (the bounded
staleness of veRL's fully asynchronous trainer, at the granularity of whole generations): during
step t the engine generates the batch of step t+k, so each batch trains k versions after the
weights that produced it. Filling the pipeline, step 0 generates the batches of steps 1..k one
after another on version 0 (staleness 1..k); from then on one generation per step.

A checkpoint saved after step t holds the prefetched batches (generated and scored; their
prompts already left the data cursor), so a resumed run trains them next: nothing is lost or
generated twice. The last k steps of a run (``trainer.steps``) start no generation past its end.

On a colocated GPU the engines must stay awake while the trainer works (``rollout.sleep_during_train``
is refused); on the CPU box the engine and the trainer share the cores, so the overlap is real
but cannot be free.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

from megatron_rl.config.plugins import scheduler_path
from megatron_rl.config.schema import RunConfig
from megatron_rl.config.values import ConfigError
from megatron_rl.loop.baseline import BaselineScheduler
from megatron_rl.loop.hooks import RolloutBatch, RolloutContext, RolloutScheduler
from rollpacker.peers.config import PeersConfig

ROUND_TYPE = "one_step_off"


def validate_one_step_off(cfg: RunConfig) -> None:
    """One-step-off needs awake engines while the trainer trains (the next rollout runs then) and
    a staleness bound of at least one step."""
    ahead = cfg.section(PeersConfig).one_step_off.max_staleness
    if ahead < 1:
        raise ConfigError(f"peers.one_step_off.max_staleness: must be >= 1 (steps the rollout runs ahead), "
                          f"got {ahead}")
    if scheduler_path(cfg.scheduler.name) != f"{__name__}:OneStepOffScheduler":
        return
    if cfg.rollout.sleep_during_train:
        raise ConfigError("rollout.sleep_during_train cannot be used with scheduler.name=one_step_off: the next "
                          "step's rollout runs while the trainer trains")


def _quiet(ctx: RolloutContext, step: int) -> RolloutContext:
    """The context of a generation for ``step`` running inside step ``ctx.step``: plug-ins hear of
    its round and groups when its batch is handed over, not while an earlier step trains."""
    return dataclasses.replace(ctx, step=step, on_round_start=lambda round_type, num_groups: None,
                               on_group_complete=lambda group: None)


class OneStepOffScheduler(RolloutScheduler):
    """The baseline's rollout, run ``peers.one_step_off.max_staleness`` steps ahead of training."""

    name = "one_step_off"

    def __init__(self) -> None:
        self._generator = BaselineScheduler()
        self._ahead: asyncio.Task | None = None
        """The generations started in this step while they run (between next_batch and before_weight_sync)."""
        self.ready: dict[int, RolloutBatch] = {}
        """Generated batches by the step that trains them (training state: saved in checkpoints)."""

    def max_staleness(self, cfg: RunConfig) -> int:
        return cfg.section(PeersConfig).one_step_off.max_staleness

    def next_round_type(self, cfg: RunConfig) -> str:
        return ROUND_TYPE

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        if self._ahead is not None:  # the loop saves between steps, after before_weight_sync
            raise RuntimeError("one_step_off: state_dict while a later step's rollout still runs")
        return {"ready_by_step": dict(self.ready)}

    def load_state_dict(self, state: dict) -> None:
        if "ready_by_step" in state:
            self.ready = dict(state["ready_by_step"])
        else:  # a checkpoint of the one-batch format (max_staleness 1 only)
            ready = state.get("ready")
            self.ready = {int(state["ready_for"]): ready} if ready is not None else {}

    # ------------------------------------------------------------------ one step
    async def next_batch(self, ctx: RolloutContext) -> RolloutBatch:
        if self._ahead is not None:
            raise RuntimeError(f"one_step_off: step {ctx.step} started while a rollout started for a later step "
                               "still runs (the loop must call before_weight_sync after every step)")
        stray = sorted(s for s in self.ready if s < ctx.step)
        if stray:
            raise RuntimeError(f"one_step_off: prefetched batches for steps {stray} were never trained (now at step "
                               f"{ctx.step})")
        if ctx.step in self.ready:
            batch, prefetched = self.ready.pop(ctx.step), True
        else:  # the first step (or a resume that saved none): generate now, on-policy
            batch, prefetched = await self._generate(_quiet(ctx, ctx.step)), False
        ctx.on_round_start(ROUND_TYPE, len(batch.groups))
        for group in batch.groups:
            ctx.on_group_complete(group)
        last = min(ctx.step + ctx.cfg.section(PeersConfig).one_step_off.max_staleness, ctx.cfg.trainer.steps - 1)
        ahead = [s for s in range(ctx.step + 1, last + 1) if s not in self.ready]
        if ahead:
            self._ahead = asyncio.ensure_future(self._generate_ahead(ctx, ahead))
        batch.metrics["rollout/prefetched"] = float(prefetched)
        batch.metrics["rollout/batches_ahead"] = float(len(self.ready) + len(ahead))
        return batch

    async def _generate_ahead(self, ctx: RolloutContext, steps: list[int]) -> None:
        """The batches of ``steps``, one generation after another, in cursor order."""
        for step in steps:
            self.ready[step] = await self._generate(_quiet(ctx, step))

    async def _generate(self, ctx: RolloutContext) -> RolloutBatch:
        batch = await self._generator.next_batch(ctx)
        batch.round_type = ROUND_TYPE
        for sample in batch.samples:
            sample.round_type = ROUND_TYPE
        start, end = batch.rollout_window
        batch.metrics["rollout/generation_s"] = end - start
        return batch

    async def before_weight_sync(self, step: int) -> dict[str, float]:
        """The generations started in ``step`` end on the weights that produced them (version ``step``)."""
        if self._ahead is None:
            return {}
        start = time.monotonic()
        ahead, self._ahead = self._ahead, None
        await ahead
        return {"time/rollout_wait": time.monotonic() - start}
