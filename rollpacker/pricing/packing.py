"""The packing limit: the fewest decode iterations, and the least priced time, in which a run's
engines could have produced one step's trained responses.

A response of ``L`` tokens needs ``L`` decode iterations (one token each; with speculation,
``ceil(L / E)`` where ``E`` is the step's measured tokens per sequence and iteration, 1 plus
accepted drafts). The engines offer ``engines x max_num_seqs`` slots per iteration. The fewest
iterations is McNaughton's bound ``max(longest, ceil(sum / slots))``, reached by giving every
iteration's slots to the responses with the most tokens left (longest first; a response may
wait an iteration with its KV kept). ``lpt_iterations`` is the packing without that (each
response holds one slot from first to last token, longest first into the least loaded slot).

Priced time of that ideal schedule under a linear iteration cost (fixed + per decode token +
per context token + per prefill token): the context every token reads and the prefill work do
not depend on the schedule, so the time is ``iterations x fixed + work / engines`` with the work
spread evenly over the engines, plus the model's per-round part.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Speculation:
    """One step's measured speculation: tokens per sequence-iteration and drafts verified per it."""

    tokens_per_iteration: float = 1.0
    drafts_per_iteration: float = 0.0


def measured_speculation(blocks) -> Speculation:
    """From traced rows: decoding sequence-iterations = decode_tokens - drafted; each produced
    1 + its accepted drafts."""
    seq_iters = sum(sum(b.rows["decode_tokens"]) - sum(b.rows["drafted"]) for b in blocks)
    if seq_iters <= 0:
        return Speculation()
    accepted = sum(sum(b.rows["accepted"]) for b in blocks)
    drafted = sum(sum(b.rows["drafted"]) for b in blocks)
    return Speculation((seq_iters + accepted) / seq_iters, drafted / seq_iters)


def iterations_needed(response_tokens: list[int], spec: Speculation = Speculation()) -> list[int]:
    return [math.ceil(n / spec.tokens_per_iteration - 1e-9) for n in response_tokens]


def fewest_iterations(response_tokens: list[int], slots: int, spec: Speculation = Speculation()) -> int:
    """McNaughton's bound on ``slots`` slots (longest-remaining-first reaches it)."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    need = iterations_needed(response_tokens, spec)
    return max(max(need, default=0), math.ceil(sum(need) / slots))


def lpt_iterations(response_tokens: list[int], slots: int, spec: Speculation = Speculation()) -> int:
    """Makespan of longest-first packing with each response pinned to one slot."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    loads = [0] * min(slots, max(1, len(response_tokens)))
    for n in sorted(iterations_needed(response_tokens, spec), reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + n)
    return max(loads)


@dataclass(frozen=True)
class PackingLimit:
    """One step's limit and the actual schedule it is compared with."""

    iterations: int
    lpt_iterations: int
    time_s: float
    actual_iterations: int
    actual_time_s: float
    tokens_per_iteration: float

    @property
    def iteration_fraction(self) -> float:
        return self.iterations / self.actual_iterations if self.actual_iterations else float("nan")

    @property
    def time_fraction(self) -> float:
        return self.time_s / self.actual_time_s if self.actual_time_s > 0 else float("nan")


Cost = Callable[[float, float, float], float]
"""Linear iteration cost of one engine: (decode tokens, context tokens, prefill tokens) -> s."""


def packing_limit(prompt_tokens: list[int], response_tokens: list[int], engines: int, max_num_seqs: int, cost: Cost,
                  round_fixed_s: float = 0.0, spec: Speculation = Speculation(), actual_iterations: int = 0,
                  actual_time_s: float = 0.0) -> PackingLimit:
    """The limit of one step's trained samples on ``engines`` engines of ``max_num_seqs`` slots."""
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    if len(prompt_tokens) != len(response_tokens):
        raise ValueError(f"{len(prompt_tokens)} prompt lengths vs {len(response_tokens)} response lengths")
    slots = engines * max_num_seqs
    iters = fewest_iterations(response_tokens, slots, spec)
    need = iterations_needed(response_tokens, spec)
    e = spec.tokens_per_iteration
    decode = sum(need) * (1.0 + spec.drafts_per_iteration)
    # Context read by a response's k-th iteration: its prompt plus the tokens produced before it.
    context = sum(n * p + e * n * (n - 1) / 2 for n, p in zip(need, prompt_tokens))
    fixed = cost(0.0, 0.0, 0.0)
    work = cost(decode, context, float(sum(prompt_tokens))) - fixed
    time_s = round_fixed_s + iters * fixed + work / engines if response_tokens else 0.0
    return PackingLimit(iters, lpt_iterations(response_tokens, slots, spec), time_s, actual_iterations, actual_time_s, e)
