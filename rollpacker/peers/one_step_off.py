"""One-step-off-policy asynchronous rollout (veRL's ``one_step_off``) as a rollout scheduler: a
peer tail batching is measured against.

The rollout of step t+1 runs while step t trains. Each generation is the baseline's (P0 prompts
x R0 responses, wait for all: ``megatron_rl.baseline``), started as soon as step t's batch is
handed to the loop, on the weights of version t still in the engine; it must end before the
weights change, so the loop's ``before_weight_sync`` waits for it (the wait is the rollout time
training did not hide, ``time/rollout_wait``). Step t+1 then trains that batch with the policy
at version t+1: every token is exactly one version old (the staleness bound this scheduler
declares), except step 0's batch, generated on the spot, on-policy.

A checkpoint saved after step t holds the prefetched batch of step t+1 (generated and scored;
its prompts already left the data cursor), so a resumed run trains it next: nothing is lost or
generated twice. The last step of a run (``trainer.steps``) starts no generation ahead.

On a colocated GPU the engines must stay awake while the trainer works (``rollout.sleep_during_train``
is refused); on the CPU box the engine and the trainer share the cores, so the overlap is real
but cannot be free.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

from megatron_rl.baseline import BaselineScheduler
from megatron_rl.config import RunConfig
from megatron_rl.config_io import ConfigError
from megatron_rl.hooks import RolloutBatch, RolloutContext, RolloutScheduler
from megatron_rl.plugins import scheduler_path

ROUND_TYPE = "one_step_off"


def validate_one_step_off(cfg: RunConfig) -> None:
    """One-step-off needs awake engines while the trainer trains (the next rollout runs then)."""
    if scheduler_path(cfg.scheduler.name) != f"{__name__}:OneStepOffScheduler":
        return
    if cfg.rollout.sleep_during_train:
        raise ConfigError("rollout.sleep_during_train cannot be used with scheduler.name=one_step_off: the next "
                          "step's rollout runs while the trainer trains")


def _quiet(ctx: RolloutContext, step: int) -> RolloutContext:
    """The context of a generation for ``step`` running inside step ``ctx.step``: plug-ins hear of
    its round and groups when its batch is handed over, not while the previous step trains."""
    return dataclasses.replace(ctx, step=step, on_round_start=lambda round_type, num_groups: None,
                               on_group_complete=lambda group: None)


class OneStepOffScheduler(RolloutScheduler):
    """The baseline's rollout, run one step ahead of training."""

    name = "one_step_off"

    def __init__(self) -> None:
        self._generator = BaselineScheduler()
        self._ahead: asyncio.Task | None = None
        """The next step's generation while it runs (between next_batch and before_weight_sync)."""
        self.ready: RolloutBatch | None = None
        """The next step's batch once generated (training state: saved in checkpoints)."""
        self._ready_for = -1
        """The step ``ready`` was generated for."""

    def max_staleness(self, cfg: RunConfig) -> int:
        return 1

    def next_round_type(self, cfg: RunConfig) -> str:
        return ROUND_TYPE

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        if self._ahead is not None:  # the loop saves between steps, after before_weight_sync
            raise RuntimeError("one_step_off: state_dict while the next step's rollout still runs")
        return {"ready": self.ready, "ready_for": self._ready_for}

    def load_state_dict(self, state: dict) -> None:
        self.ready, self._ready_for = state.get("ready"), int(state.get("ready_for", -1))

    # ------------------------------------------------------------------ one step
    async def next_batch(self, ctx: RolloutContext) -> RolloutBatch:
        if self._ahead is not None:
            raise RuntimeError(f"one_step_off: step {ctx.step} started while the rollout started for it still runs "
                               "(the loop must call before_weight_sync after every step)")
        if self.ready is not None and self._ready_for != ctx.step:
            raise RuntimeError(f"one_step_off: the prefetched batch is for step {self._ready_for}, not {ctx.step}")
        if self.ready is None:  # the first step (or a resume that saved none): generate now, on-policy
            batch, prefetched = await self._generate(_quiet(ctx, ctx.step)), False
        else:
            batch, prefetched, self.ready = self.ready, True, None
        ctx.on_round_start(ROUND_TYPE, len(batch.groups))
        for group in batch.groups:
            ctx.on_group_complete(group)
        if ctx.step + 1 < ctx.cfg.trainer.steps:
            self._ahead = asyncio.ensure_future(self._generate(_quiet(ctx, ctx.step + 1)))
        batch.metrics["rollout/prefetched"] = float(prefetched)
        return batch

    async def _generate(self, ctx: RolloutContext) -> RolloutBatch:
        batch = await self._generator.next_batch(ctx)
        batch.round_type = ROUND_TYPE
        for sample in batch.samples:
            sample.round_type = ROUND_TYPE
        start, end = batch.rollout_window
        batch.metrics["rollout/generation_s"] = end - start
        return batch

    async def before_weight_sync(self, step: int) -> dict[str, float]:
        """The generation for step + 1 ends on the weights that produced it (version ``step``)."""
        if self._ahead is None:
            return {}
        start = time.monotonic()
        ahead, self._ahead = self._ahead, None
        self.ready, self._ready_for = await ahead, step + 1
        return {"time/rollout_wait": time.monotonic() - start}
