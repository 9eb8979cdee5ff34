"""Partial rollout (slime's APRIL, arXiv 2509.18521) as a rollout scheduler: a peer tail batching
is measured against.

Every step keeps ceil(over_provision x P0) groups in flight: the groups carried over from earlier steps
first, then fresh prompts (R0 responses each, one engine request per response). Once P0 groups
are complete (all R0 responses finished and scored), every request still running is aborted and
nothing is thrown away: each unfinished group is carried to the next step with its finished
responses and, for every aborted response, the tokens generated so far. The next step continues
each such response from where it stopped (prompt + partial response as the prefix, what is left
of the token budget: ``megatron_rl.loop.requests.submit_continuation``) under the newer weights, so a
response can hold tokens of several policy versions (``Sample.token_versions``). Groups that
complete beyond P0 in the same instant are carried whole.

The staleness bound: a group is carried at most ``peers.partial.max_continuations`` times. A
group carried that often is *due*: its step waits for it and it takes a place in the batch before
any other group, so no token is ever older than that bound, which is what the scheduler declares
(:meth:`PartialRolloutScheduler.max_staleness`) and the loop enforces. (With over_provision <= 2 the due
groups always fit in one batch: at most ceil(over_provision x P0) - P0 <= P0 groups are carried.)

Checkpoints keep the carried groups (tokens, logprobs, versions, rewards, first requests). With
``peers.partial.drop_on_resume`` a resumed run drops their responses instead, counted
(``rollout/partial/dropped_*`` and ``rollout/wasted_tokens``), and generates those prompts again
from scratch: no prompt is lost either way, and none is trained twice.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from megatron_rl.config.schema import RunConfig
from megatron_rl.config.values import ConfigError
from megatron_rl.loop.hooks import RolloutBatch, RolloutContext, RolloutScheduler
from megatron_rl.loop.requests import (
    Aborted,
    Finished,
    GroupScored,
    InFlight,
    RoundWaiter,
    launch,
    submit_continuation,
    submit_prompt,
)
from megatron_rl.rollout.engine import GenerationRequest
from megatron_rl.sample import Prompt, Sample
from rollpacker.peers.config import PeersConfig

ROUND_TYPE = "partial"
"""Round type of every step (metrics, and speculative decoding's ``rollout.speculative.rounds``)."""


def validate_partial(cfg: RunConfig) -> None:
    """``peers.partial.*``: the over-provisioning factor and the staleness bound."""
    pc = cfg.section(PeersConfig).partial
    if not 1.0 <= pc.over_provision <= 2.0:
        raise ConfigError(f"peers.partial.over_provision: must be in [1, 2] (the groups carried must fit in one "
                          f"batch), got {pc.over_provision}")
    if pc.max_continuations < 1:
        raise ConfigError(f"peers.partial.max_continuations: must be >= 1, got {pc.max_continuations}")


@dataclass
class _Group:
    """One prompt's group while it is generated, possibly over several steps."""

    prompt: Prompt
    key: str
    """'<prompt id>@<launch step>': a prompt can be in flight twice (drawn again in a later epoch)."""
    carries: int = 0
    """Steps this group has been carried over so far (0: launched in this step)."""
    finished: list[Sample] = field(default_factory=list)
    """Finished responses (scored by the end of the step they finished in)."""
    partial: list[Sample] = field(default_factory=list)
    """Aborted responses, holding every token generated so far: continued next step."""
    originals: dict[int, GenerationRequest] = field(default_factory=dict)
    """response index -> the response's first request (continuations are built from it)."""

    def tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.finished + self.partial)

    def state(self) -> dict:
        return {"prompt": self.prompt, "key": self.key, "carries": self.carries, "finished": self.finished,
                "partial": self.partial, "originals": self.originals}

    @classmethod
    def from_state(cls, state: dict) -> "_Group":
        return cls(state["prompt"], state["key"], int(state["carries"]), list(state["finished"]),
                   list(state["partial"]), dict(state["originals"]))


@dataclass
class _Round:
    """One step's bookkeeping, turned into metrics."""

    flight: InFlight = field(default_factory=InFlight)
    owner: dict[str, _Group] = field(default_factory=dict)
    """request id -> its group."""
    fresh_prompts: int = 0
    fresh_responses: int = 0
    continued: int = 0
    generated_tokens: int = 0
    dropped_responses: int = 0
    dropped_tokens: int = 0
    due: int = 0


class PartialRolloutScheduler(RolloutScheduler):
    """Over-provisioned rounds that abort at P0 complete groups and continue the rest next step."""

    name = "partial_rollout"

    def __init__(self) -> None:
        self.carried: list[_Group] = []
        """Groups launched in earlier steps and not trained yet (training state), oldest first."""
        self._resumed = False

    def max_staleness(self, cfg: RunConfig) -> int:
        return cfg.section(PeersConfig).partial.max_continuations

    def next_round_type(self, cfg: RunConfig) -> str:
        return ROUND_TYPE

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        return {"carried": [g.state() for g in self.carried]}

    def load_state_dict(self, state: dict) -> None:
        self.carried = [_Group.from_state(g) for g in state.get("carried", [])]
        self._resumed = True

    # ------------------------------------------------------------------ one step
    async def next_batch(self, ctx: RolloutContext) -> RolloutBatch:
        cfg = ctx.cfg
        p0, r0 = cfg.data.prompts_per_step, cfg.data.responses_per_prompt
        pc = cfg.section(PeersConfig).partial
        start = time.monotonic()
        rnd = _Round()
        restart = self._drop_carried(rnd) if self._resumed and pc.drop_on_resume else []
        self._resumed = False
        ctx.on_round_start(ROUND_TYPE, p0)
        carried, self.carried = self.carried, []
        in_flight = math.ceil(pc.over_provision * p0)
        # Restarted prompts (drop_on_resume) first: they were carried, so they fit in the round.
        prompts = restart + ctx.next_prompts(max(0, in_flight - len(carried) - len(restart)))
        fresh = []
        async with launch(ctx, rnd.flight):  # continuations and fresh prompts reach the engines at once
            for group in carried:
                await self._continue(ctx, rnd, group)
            for prompt in prompts:
                group = _Group(prompt, f"{prompt.prompt_id}@{ctx.step}")
                for rid in await submit_prompt(ctx, rnd.flight, prompt, r0, ROUND_TYPE):
                    rnd.owner[rid] = group
                    group.originals[rnd.flight.samples[rid].response_index] = rnd.flight.sent[rid]
                fresh.append(group)
        rnd.fresh_prompts, rnd.fresh_responses = len(prompts), len(prompts) * r0
        groups = carried + fresh
        due = [g for g in carried if g.carries >= pc.max_continuations]
        rnd.due = len(due)
        batch = await self._collect(ctx, rnd, groups, {g.key for g in due}, p0, r0)
        await self._await_rewards(rnd)
        in_batch = {id(g) for g in batch}
        for group in groups:
            if id(group) not in in_batch:
                group.carries += 1
                self.carried.append(group)
        end = time.monotonic()
        out = [sorted(g.finished, key=lambda s: s.response_index) for g in batch]
        for sample in (s for g in out for s in g):
            sample.round_type = ROUND_TYPE
        return RolloutBatch(groups=out, round_type=ROUND_TYPE, metrics=self._metrics(rnd),
                            requests=rnd.flight.requests, rollout_window=(start, end))

    def _drop_carried(self, rnd: _Round) -> list[Prompt]:
        """drop_on_resume: forget the carried groups' responses (counted); their prompts restart."""
        for group in self.carried:
            rnd.dropped_responses += len(group.finished) + len(group.partial)
            rnd.dropped_tokens += group.tokens()
        prompts = [g.prompt for g in self.carried]
        self.carried = []
        return prompts

    async def _continue(self, ctx: RolloutContext, rnd: _Round, group: _Group) -> None:
        """Send one continuation per aborted response of a carried group (new weights, the rest of
        the budget); a response whose budget is already used up finishes as it is."""
        partial, group.partial = group.partial, []
        for sample in partial:
            original = group.originals[sample.response_index]
            rid = f"{original.request_id}-c{ctx.step}"
            rnd.owner[rid] = group
            rnd.continued += 1
            if not await submit_continuation(ctx, rnd.flight, sample, original, rid):
                group.finished.append(sample)  # finished ('length') and scoring without a request

    async def _collect(self, ctx: RolloutContext, rnd: _Round, groups: list[_Group], due: set[str], p0: int,
                       r0: int) -> list[_Group]:
        """Consume completions until the batch holds P0 groups: every due group, and the first
        others to complete (all R0 finished and scored) in the places left. Stops early only
        when nothing is left to wait for (the data ran out); then aborts what still runs."""
        batch: list[_Group] = []
        others_room = p0 - len(due)
        with RoundWaiter(ctx, rnd.flight) as waiter:
            for group in groups:
                if len(group.finished) == r0:  # carried whole, or every continuation already finished
                    waiter.watch(group, group.finished)
            while len(batch) < p0 and waiter.busy:
                for event in await waiter.next():
                    if isinstance(event, GroupScored):
                        group = event.key
                        if group.key in due or others_room > 0:
                            others_room -= group.key not in due
                            batch.append(group)
                            ctx.on_group_complete(event.group)
                        continue
                    group = self._on_event(rnd, event)
                    if isinstance(event, Finished) and len(group.finished) == r0:
                        waiter.watch(group, group.finished)
            # Abort every request still running, keeping what each generated.
            for event in await waiter.abort_rest():
                self._on_event(rnd, event)
        return batch

    def _on_event(self, rnd: _Round, event: Finished | Aborted) -> _Group:
        """Record one completion with its group: a finished response (scoring started) or an
        aborted one (its tokens kept for the next step). Returns the group."""
        group = rnd.owner[event.completion.request_id]
        rnd.generated_tokens += len(event.completion.token_ids)
        (group.finished if isinstance(event, Finished) else group.partial).append(event.sample)
        return group

    async def _await_rewards(self, rnd: _Round) -> None:
        """Wait for the rewards of every finished response (they are trained later, with those rewards)."""
        pending = [t for t in rnd.flight.scoring.values() if not t.done()]
        if pending:
            await asyncio.gather(*pending)

    # ------------------------------------------------------------------ metrics
    def _metrics(self, rnd: _Round) -> dict[str, float]:
        flight = rnd.flight
        return {
            "rollout/prompts_launched": float(rnd.fresh_prompts),
            "rollout/responses_launched": float(rnd.fresh_responses),
            "rollout/responses_continued": float(rnd.continued),
            "rollout/responses_aborted": float(flight.num_aborted),
            # Tokens of requests that were then aborted: kept (continued next step), not wasted.
            "rollout/aborted_tokens": float(flight.aborted_tokens),
            "rollout/wasted_tokens": float(rnd.dropped_tokens),
            "rollout/partial/generated_tokens": float(rnd.generated_tokens),
            "rollout/partial/due_groups": float(rnd.due),
            "rollout/partial/carried_groups": float(len(self.carried)),
            "rollout/partial/carried_responses": float(sum(len(g.partial) for g in self.carried)),
            "rollout/partial/carried_tokens": float(sum(g.tokens() for g in self.carried)),
            "rollout/partial/dropped_responses": float(rnd.dropped_responses),
            "rollout/partial/dropped_tokens": float(rnd.dropped_tokens),
        }
