"""The baseline rollout scheduler (what veRL does): P0 prompts x R0 responses, wait for all.

It runs through the same engine, reward and training code as RollPacker's tail batching, so a
benchmark of the two compares only the scheduling policy.
"""
from __future__ import annotations

import time

from megatron_rl.loop.hooks import RolloutBatch, RolloutContext, RolloutScheduler
from megatron_rl.loop.requests import Aborted, Finished, InFlight, RoundWaiter, launch, submit_prompt
from megatron_rl.sample import Sample


class BaselineScheduler(RolloutScheduler):
    """Synchronous rollout: every response of every prompt runs to completion."""

    name = "baseline"

    async def next_batch(self, ctx: RolloutContext) -> RolloutBatch:
        p0 = ctx.cfg.data.prompts_per_step
        r0 = ctx.cfg.data.responses_per_prompt
        start = time.monotonic()
        prompts = ctx.next_prompts(p0)
        ctx.on_round_start(self.name, len(prompts))
        flight = InFlight()
        groups: dict[str, list[Sample]] = {p.prompt_id: [] for p in prompts}
        async with launch(ctx, flight):  # the round reaches the engines at once
            for prompt in prompts:
                await submit_prompt(ctx, flight, prompt, r0, round_type=self.name)
        with RoundWaiter(ctx, flight) as waiter:
            while waiter.busy:
                for event in await waiter.next():
                    if isinstance(event, Aborted):
                        raise RuntimeError("baseline rollout saw an aborted request; nothing should abort here")
                    if isinstance(event, Finished):
                        group = groups[event.sample.prompt.prompt_id]
                        group.append(event.sample)
                        if len(group) == r0:
                            waiter.watch(event.sample.prompt.prompt_id, group)
                    else:  # every response of the group finished and is scored
                        groups[event.key] = event.group
                        ctx.on_group_complete(event.group)
        end = time.monotonic()
        ordered = [groups[p.prompt_id] for p in prompts]
        metrics = {
            "rollout/prompts_launched": float(len(prompts)),
            "rollout/responses_launched": float(len(prompts) * r0),
            "rollout/responses_aborted": 0.0,
            "rollout/aborted_tokens": 0.0,
        }
        return RolloutBatch(groups=ordered, round_type=self.name, metrics=metrics,
                            requests=flight.requests, rollout_window=(start, end))
