"""RollPacker's tail batching as a rollout scheduler (arXiv 2509.21009, section 4).

Short round (speculative execution): launch ceil(eta_P x P0) prompts with ceil(eta_R x R0)
responses each, one engine request per response. Per prompt the first R0 responses that finish
are kept; the first P0 prompts to complete form the batch; everything still running is aborted
at once and pending reward work of discarded responses is cancelled. Prompts that did not
complete go whole into the long-prompt queue (their partial responses are thrown away).

Long round: when the queue holds >= P0 prompts, the step takes P0 of them with exactly R0
responses each and waits for all: no over-provisioning, the same token budget.

DAPO mode (``algorithm.filter_zero_variance``): a complete group whose R0 rewards are all equal
is filtered (it never enters the queue) and the round launches more prompts, at most
``tail_batching.max_refills`` times, until P0 valid groups are in.

Rollout history (``rollpacker.history``): every finished response of a prompt is remembered
(bounded) and sent with its next requests as draft references for speculative decoding; each
short round records which prompts it completed and which it queued. With
``tail_batching.history_routing`` a prompt queued in an earlier epoch goes straight to the queue
when drawn again (not launched, aborted and queued once more); the prediction is scored either
way (rollout/history/*). The history is part of the checkpointed state.

Strictly on-policy: every response is generated from scratch by the current weights within the
step; only the order in which prompts are trained changes. The queue is checkpointed.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from megatron_rl.algorithms.filters import is_zero_variance
from megatron_rl.config.schema import RunConfig
from megatron_rl.loop.hooks import RolloutBatch, RolloutContext, RolloutScheduler
from megatron_rl.loop.requests import (
    Finished,
    GroupScored,
    InFlight,
    RoundWaiter,
    cancel_scoring,
    launch,
    submit_prompt,
)
from megatron_rl.sample import Prompt, Sample
from rollpacker.config import TailBatchingConfig
from rollpacker.history import Confusion, RolloutHistory


class RefillLimitError(RuntimeError):
    """DAPO mode could not fill the batch with valid groups within tail_batching.max_refills."""


@dataclass
class _PromptState:
    prompt: Prompt
    finished: list[Sample] = field(default_factory=list)
    """Finished responses in finish order (the first R0 are the kept ones)."""
    predicted_long: bool | None = None
    """Short rounds: the history's prediction at launch (None: no earlier-epoch outcome)."""


@dataclass
class _RoundLog:
    """Counters of one step, turned into metrics."""

    prompts_launched: int = 0
    responses_launched: int = 0
    refills: int = 0
    filtered: list[str] = field(default_factory=list)
    queued: int = 0
    extra_tokens: int = 0
    """Tokens of finished responses that were not kept (extra responses, queued prompts)."""
    finished_lengths: dict[str, list[int]] = field(default_factory=dict)
    """prompt id -> lengths of every finished response (kept or not): the length-bias monitor."""
    confusion: Confusion = field(default_factory=Confusion)
    """The history's long-prompt predictions against this round's outcomes."""


class TailBatchingScheduler(RolloutScheduler):
    """Short rounds with speculative over-provisioning, a long-prompt queue and long rounds."""

    name = "tail_batching"

    def __init__(self) -> None:
        self.queue: deque[Prompt] = deque()
        """Long-prompt queue: prompts whose short round did not complete (training state)."""
        self.history = RolloutHistory()
        """Per-prompt outcomes and recent responses (training state; bounds from the config)."""
        self.short_length = 0
        """Longest response kept by the latest short round: a long-round prompt whose responses all
        fit in it would have completed in a short round (its history outcome goes back to 'short')."""

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        return {"queue": list(self.queue), "history": self.history.state_dict(), "short_length": self.short_length}

    def load_state_dict(self, state: dict) -> None:
        self.queue = deque(state.get("queue", []))
        self.history.load_state_dict(state.get("history", {}))
        self.short_length = int(state.get("short_length", 0))

    def _configure_history(self, cfg: RunConfig) -> None:
        tb = cfg.section(TailBatchingConfig)
        self.history.max_prompts, self.history.max_responses = tb.history_prompts, tb.history_responses
        self.history.max_tokens = tb.history_response_tokens

    def next_round_type(self, cfg: RunConfig) -> str:
        return "long" if len(self.queue) >= cfg.data.prompts_per_step else "short"

    # ------------------------------------------------------------------ one step
    async def next_batch(self, ctx: RolloutContext) -> RolloutBatch:
        p0 = ctx.cfg.data.prompts_per_step
        self._configure_history(ctx.cfg)
        start = time.monotonic()
        if self.next_round_type(ctx.cfg) == "long":
            ctx.on_round_start("long", p0)
            batch_groups, log, flight = await self._long_round(ctx)
            round_type = "long"
        else:
            ctx.on_round_start("short", p0)
            batch_groups, log, flight = await self._short_round(ctx)
            round_type = "short"
        end = time.monotonic()
        for group in batch_groups:
            for sample in group:
                sample.round_type = round_type
        return RolloutBatch(groups=batch_groups, round_type=round_type,
                            metrics=self._metrics(round_type, batch_groups, log, flight),
                            requests=flight.requests, rollout_window=(start, end),
                            filtered_prompt_ids=log.filtered)

    async def _short_round(self, ctx: RolloutContext):
        cfg = ctx.cfg
        p0, r0 = cfg.data.prompts_per_step, cfg.data.responses_per_prompt
        tb = cfg.section(TailBatchingConfig)
        n_responses = math.ceil(tb.eta_responses * r0)
        flight, log = InFlight(), _RoundLog()
        states: dict[str, _PromptState] = {}

        async def send(num_prompts: int) -> None:
            async with launch(ctx, flight):  # the launch (or refill) reaches the engines at once
                for prompt, predicted in self._draw_short(ctx, num_prompts, states, log):
                    states[prompt.prompt_id] = _PromptState(prompt, predicted_long=predicted)
                    await submit_prompt(ctx, flight, prompt, n_responses, "short", attempt=log.refills,
                                        references=self.history.references(prompt.prompt_id))
                    log.prompts_launched += 1
                    log.responses_launched += n_responses

        await send(math.ceil(tb.eta_prompts * p0))
        batch = await self._collect(ctx, flight, states, log, p0, r0,
                                    refill=lambda missing: send(math.ceil(tb.eta_prompts * missing)))
        self._requeue_incomplete(states, batch, log, r0, front=False)
        self._record_short_outcomes(ctx, states, batch, log)
        return batch, log, flight

    def _draw_short(self, ctx: RolloutContext, num_prompts: int, states: dict, log: _RoundLog):
        """``num_prompts`` fresh prompts to launch, each with the history's prediction (None: no
        earlier-epoch outcome); with history routing, predicted-long prompts drawn on the way go
        to the long-prompt queue instead (at most 4x ``num_prompts`` draws, then no more routing,
        so a data set of long prompts cannot stall the round)."""
        routing = ctx.cfg.section(TailBatchingConfig).history_routing
        out, draws = [], 0
        while len(out) < num_prompts:
            drawn = ctx.next_prompts(num_prompts - len(out))
            if not drawn:
                break
            for prompt in drawn:
                draws += 1
                pid, epoch = prompt.prompt_id, ctx.epoch()
                entry = self.history.get(pid)
                informed = entry is not None and entry.outcome and entry.outcome_epoch < epoch
                predicted = self.history.predicts_long(pid, epoch) if informed else None
                self.history.seen(pid, epoch)
                queued = {p.prompt_id for p in self.queue}
                if (routing and predicted and draws <= 4 * num_prompts and pid not in queued) or pid in states:
                    # A prompt drawn twice in one round (an epoch ended mid-round) also waits in the queue.
                    if pid not in queued:
                        self.queue.append(prompt)
                        log.confusion.routed += 1
                    continue
                out.append((prompt, predicted))
        return out

    def _record_short_outcomes(self, ctx: RolloutContext, states: dict[str, _PromptState], batch: list[list[Sample]],
                               log: _RoundLog) -> None:
        """Completed prompts (in the batch or filtered) are 'short', queued ones 'long'; score the
        predictions made at launch."""
        epoch = ctx.epoch()
        done = {g[0].prompt.prompt_id for g in batch} | set(log.filtered)
        kept = [len(s.response_ids) for g in batch for s in g]
        if kept:
            self.short_length = max(kept)
        c = log.confusion
        for pid, state in states.items():
            outcome = "short" if pid in done else "long"
            self.history.set_outcome(pid, epoch, outcome)
            if state.predicted_long is None:
                continue
            if state.predicted_long:
                c.true_long += outcome == "long"
                c.false_long += outcome == "short"
            else:
                c.true_short += outcome == "short"
                c.false_short += outcome == "long"

    async def _long_round(self, ctx: RolloutContext):
        p0, r0 = ctx.cfg.data.prompts_per_step, ctx.cfg.data.responses_per_prompt
        flight, log = InFlight(), _RoundLog()
        states: dict[str, _PromptState] = {}

        async def send(num_prompts: int) -> None:
            # Long rounds take queued prompts first, then fresh ones (DAPO refills).
            async with launch(ctx, flight):
                for prompt in self._draw_long(ctx, num_prompts, states):
                    states[prompt.prompt_id] = _PromptState(prompt)
                    self.history.seen(prompt.prompt_id, ctx.epoch())
                    await submit_prompt(ctx, flight, prompt, r0, "long", attempt=log.refills,
                                        references=self.history.references(prompt.prompt_id))
                    log.prompts_launched += 1
                    log.responses_launched += r0

        await send(p0)
        batch = await self._collect(ctx, flight, states, log, p0, r0, refill=send)
        self._requeue_incomplete(states, batch, log, r0, front=True)
        for group in batch:
            # Responses that all fit in a short round: the prompt no longer counts as long.
            if self.short_length and max(len(s.response_ids) for s in group) <= self.short_length:
                self.history.set_outcome(group[0].prompt.prompt_id, ctx.epoch(), "short")
        return batch, log, flight

    def _draw_long(self, ctx: RolloutContext, num_prompts: int, states: dict) -> list[Prompt]:
        """Queued prompts first, then fresh ones, never one prompt twice in a round: with a small
        data set a prompt can wait in the queue while the cursor hands it out again in the next
        epoch (both are trained, in different rounds). A repeat waits in the queue for a later
        long round."""
        taken, take, deferred = set(states), [], []
        while self.queue and len(take) < num_prompts:
            prompt = self.queue.popleft()
            (deferred if prompt.prompt_id in taken else take).append(prompt)
            taken.add(prompt.prompt_id)
        self.queue.extendleft(reversed(deferred))
        for _ in range(4):  # a few draws: a repeat from the cursor goes to the queue, draw again
            if len(take) >= num_prompts:
                break
            for prompt in ctx.next_prompts(num_prompts - len(take)):
                if prompt.prompt_id in taken:
                    self.queue.append(prompt)
                else:
                    take.append(prompt)
                    taken.add(prompt.prompt_id)
        return take

    def _requeue_incomplete(self, states: dict[str, _PromptState], batch: list[list[Sample]], log: _RoundLog,
                            r0: int, front: bool) -> None:
        """Queue every launched prompt that is neither in the batch nor filtered (whole prompt:
        its finished responses are discarded and it is regenerated later); count discarded tokens."""
        in_batch = {g[0].prompt.prompt_id for g in batch}
        filtered = set(log.filtered)
        leftovers = []
        for pid, state in states.items():
            if pid in in_batch or pid in filtered:
                log.extra_tokens += sum(len(s.response_ids) for s in state.finished[r0:])
            else:
                log.extra_tokens += sum(len(s.response_ids) for s in state.finished)
                leftovers.append(state.prompt)
        if front:
            self.queue.extendleft(reversed(leftovers))
        else:
            self.queue.extend(leftovers)
        log.queued += len(leftovers)

    async def _collect(self, ctx: RolloutContext, flight: InFlight, states: dict[str, _PromptState],
                       log: _RoundLog, p0: int, r0: int, refill) -> list[list[Sample]]:
        """Consume completions until P0 valid groups are in; then abort the rest."""
        dapo = ctx.cfg.algorithm.filter_zero_variance
        max_refills = ctx.cfg.section(TailBatchingConfig).max_refills
        batch: list[list[Sample]] = []
        with RoundWaiter(ctx, flight) as waiter:
            while len(batch) < p0:
                if not waiter.busy:
                    # Out of work: only DAPO filtering can leave the batch short of P0.
                    if log.refills >= max_refills:
                        raise RefillLimitError(
                            f"step {ctx.step}: only {len(batch)} of {p0} groups have reward variance after "
                            f"{log.refills} refills ({len(log.filtered)} groups filtered); raise "
                            f"tail_batching.max_refills or turn off algorithm.filter_zero_variance")
                    log.refills += 1
                    await refill(p0 - len(batch))
                    continue
                for event in await waiter.next():
                    if isinstance(event, Finished):
                        self._on_finished(ctx, flight, waiter, states[event.sample.prompt.prompt_id], event.sample,
                                          r0, log)
                    elif isinstance(event, GroupScored):
                        group = event.group
                        if dapo and is_zero_variance(group):
                            log.filtered.append(group[0].prompt.prompt_id)
                        elif len(batch) < p0:
                            batch.append(group)
                            ctx.on_group_complete(group)
                        # else: completed in the same instant the batch filled; it is queued below.
            # The batch is full: abort every request still running and drop unfinished groups.
            waiter.cancel_groups()
            await waiter.abort_rest()
        used = {s.request_id for g in batch for s in g}
        cancel_scoring(ctx, flight, [rid for rid in flight.scoring if rid not in used])
        return batch

    def _on_finished(self, ctx: RolloutContext, flight: InFlight, waiter: RoundWaiter, state: _PromptState,
                     sample: Sample, r0: int, log: _RoundLog) -> None:
        state.finished.append(sample)
        self.history.add_response(state.prompt.prompt_id, sample.response_ids)
        log.finished_lengths.setdefault(state.prompt.prompt_id, []).append(len(sample.response_ids))
        if len(state.finished) == r0:
            waiter.watch(state.prompt.prompt_id, list(state.finished))
        elif len(state.finished) > r0:
            # An extra response of an already complete prompt: not needed, stop scoring it.
            cancel_scoring(ctx, flight, [sample.request_id])

    # ------------------------------------------------------------------ metrics
    def _metrics(self, round_type: str, batch: list[list[Sample]], log: _RoundLog, flight: InFlight) -> dict:
        kept = [len(s.response_ids) for g in batch for s in g]
        same_prompts = [n for g in batch for n in log.finished_lengths.get(g[0].prompt.prompt_id, [])]
        metrics = {
            "rollout/is_long_round": float(round_type == "long"),
            "rollout/queue_length": float(len(self.queue)),
            "rollout/prompts_launched": float(log.prompts_launched),
            "rollout/responses_launched": float(log.responses_launched),
            "rollout/responses_aborted": float(flight.num_aborted),
            "rollout/aborted_tokens": float(flight.aborted_tokens),
            "rollout/discarded_finished_tokens": float(log.extra_tokens),
            "rollout/wasted_tokens": float(flight.aborted_tokens + log.extra_tokens),
            "rollout/prompts_queued": float(log.queued),
            "rollout/refills": float(log.refills),
            "rollout/groups_filtered": float(len(log.filtered)),
            "rollout/history/prompts": float(len(self.history)),
            "rollout/history/tokens": float(self.history.num_tokens()),
            **log.confusion.metrics(),
        }
        if kept and same_prompts:
            # Keeping the first R0 of eta_R x R0 favours short answers: compare with all finished ones.
            metrics["rollout/length_bias/trained_mean"] = sum(kept) / len(kept)
            metrics["rollout/length_bias/finished_mean"] = sum(same_prompts) / len(same_prompts)
            metrics["rollout/length_bias/ratio"] = metrics["rollout/length_bias/trained_mean"] / max(
                1e-9, metrics["rollout/length_bias/finished_mean"])
        return metrics
