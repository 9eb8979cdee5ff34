"""Speculative decoding in the simulator's engine model (issue #15).

A decode iteration with ``k`` draft tokens per sequence verifies ``k + 1`` tokens of every
sequence in one forward: the weights are read once (``step_s``, the memory-bound part, unchanged),
the per-sequence compute grows ``k + 1``-fold, and each sequence advances by the expected number
of tokens a step produces, ``E = (1 - a^(k+1)) / (1 - a)`` for a per-draft-token acceptance rate
``a`` (drafts accepted left to right until the first rejection, then one token sampled). Drafts
from text (n-gram / suffix) cost nothing to propose. Assumptions, stated: acceptance independent
of position and batch; the verification forward's attention over the ``k`` extra positions is
charged like ``k`` extra sequences' compute; every sequence carries drafts (long rounds, where
``rollout.speculative.rounds`` turns them on).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rollpacker.simulator.engine_model import EngineModel


def expected_tokens_per_step(acceptance: float, draft_tokens: int) -> float:
    """Tokens one decode step produces per sequence with ``draft_tokens`` drafts accepted at rate
    ``acceptance`` each (until the first rejection) plus the token sampled after them."""
    if not 0.0 <= acceptance < 1.0:
        raise ValueError(f"acceptance must be in [0, 1), got {acceptance}")
    if draft_tokens < 0:
        raise ValueError(f"draft_tokens must be >= 0, got {draft_tokens}")
    return (1.0 - acceptance ** (draft_tokens + 1)) / (1.0 - acceptance)


@dataclass(frozen=True)
class SpeculativeEngine(EngineModel):
    """An :class:`EngineModel` whose decode iterations verify drafts (see the module docstring).
    ``decode_time(batch, ctx, iterations)`` stays the time for every sequence to gain
    ``iterations`` tokens, so the engine simulation runs unchanged."""

    acceptance: float = 0.0
    draft_tokens: int = 0

    @classmethod
    def wrap(cls, base: EngineModel, acceptance: float, draft_tokens: int) -> "SpeculativeEngine":
        expected_tokens_per_step(acceptance, draft_tokens)  # validates
        return cls(**base.to_dict(), acceptance=acceptance, draft_tokens=draft_tokens)

    @property
    def tokens_per_step(self) -> float:
        return expected_tokens_per_step(self.acceptance, self.draft_tokens)

    def decode_time(self, batch: int, ctx_tokens: int, iterations: int = 1) -> float:
        e = self.tokens_per_step
        steps = iterations / e
        per_step = self.step_s + self.per_seq_s * batch * (self.draft_tokens + 1)
        # Context grows by batch x E tokens per step: the same arithmetic series as without drafts.
        ctx = self.per_ctx_token_s * (ctx_tokens * steps + batch * e * steps * (steps - 1) / 2)
        return math.fsum((steps * per_step, ctx))
