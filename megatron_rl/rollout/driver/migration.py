"""Recompute-style request migration: continue a partially generated response on another engine.

When the rollout side shrinks mid-round (``EnginePool.release_engines``), the requests running on
a released engine are aborted; each abort yields the tokens generated so far. The request then
continues elsewhere as a *new* engine request whose prompt is the original prompt plus those
tokens (the target engine re-prefills them; nothing is regenerated) and whose budget is what is
left of the original one. The consumer must still see one Completion under the original id, so
the parts are merged back together here. Pure logic: no Ray or vLLM.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

from megatron_rl.rollout.engine import Completion, GenerationRequest

_SEED_MODULUS = 2**31 - 1  # keep derived seeds in the positive int32 range every backend accepts


def continuation_seed(seed: int, num_generated: int) -> int:
    """Sampling seed for the continuation of a request that already generated ``num_generated``.

    vLLM seeds a fresh per-request generator when a request starts. Resubmitting with the
    original seed would restart that RNG stream, so token k+i would be drawn with the random
    numbers that already drew token i: the continuation would be correlated with its own prefix.
    A seed derived from (seed, tokens done) starts an independent stream, yet stays
    deterministic, so a rollout migrated at the same point reproduces. With nothing generated
    the original seed is kept: the request then samples exactly as if it had never moved.
    """
    if num_generated == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_MODULUS


def continuation_request(
    original: GenerationRequest, generated_token_ids: list[int], new_request_id: str
) -> GenerationRequest | None:
    """The request that continues ``original`` after it generated ``generated_token_ids``.

    ``generated_token_ids`` are *all* tokens generated so far (every earlier part of a request
    migrated more than once). Returns None when they already use up the budget: the caller
    then finishes the request with finish_reason 'length' instead of resubmitting it.
    """
    remaining = original.max_tokens - len(generated_token_ids)
    if remaining < 0:
        raise ValueError(
            f"request {original.request_id!r}: {len(generated_token_ids)} generated tokens exceed "
            f"its budget of {original.max_tokens}"
        )
    if remaining == 0:
        return None
    # Everything else (sampling settings, speculation and its draft group and references) carries
    # over unchanged.
    return dataclasses.replace(
        original,
        request_id=new_request_id,
        prompt_ids=list(original.prompt_ids) + list(generated_token_ids),
        max_tokens=remaining,
        seed=continuation_seed(original.seed, len(generated_token_ids)),
    )


def merge_completions(request_id: str, parts: list[Completion], finish_reason: str | None = None) -> Completion:
    """Join the parts of a migrated request into one Completion under ``request_id``.

    Tokens and logprobs are concatenated in order; submit_time is the first part's (the original
    submission), finish_reason / finish_time / weight_version the last part's (``finish_reason``
    overrides the reason). Parts generated under different weight versions raise ValueError:
    the joined response would be off-policy for any single version.
    """
    if not parts:
        raise ValueError(f"request {request_id!r}: no parts to merge")
    versions = {p.weight_version for p in parts}
    if len(versions) > 1:
        raise ValueError(
            f"request {request_id!r}: parts were generated under weight versions {sorted(versions)}; "
            "a response mixing versions is off-policy"
        )
    last = parts[-1]
    return Completion(
        request_id=request_id,
        token_ids=[t for p in parts for t in p.token_ids],
        logprobs=[x for p in parts for x in p.logprobs],
        finish_reason=finish_reason or last.finish_reason,
        weight_version=last.weight_version,
        submit_time=parts[0].submit_time,
        finish_time=last.finish_time,
    )


@dataclass
class MigrationRecord:
    """One original request and the parts it finished on engines it was migrated away from."""

    original: GenerationRequest
    parts: list[Completion] = field(default_factory=list)
    """Completed (aborted-for-migration) parts, oldest first."""

    @property
    def generated_token_ids(self) -> list[int]:
        """All tokens generated so far, across parts."""
        return [t for p in self.parts for t in p.token_ids]

    @property
    def migrations(self) -> int:
        """How many times the request moved (one part per move)."""
        return len(self.parts)

    def continuation(self, new_request_id: str) -> GenerationRequest | None:
        """The next part's request (None when the budget is used up); see continuation_request."""
        return continuation_request(self.original, self.generated_token_ids, new_request_id)

    def merged(self, final: Completion | None = None, finish_reason: str | None = None) -> Completion:
        """The consumer's Completion: every part, plus ``final`` when given, under the original id."""
        parts = self.parts + ([final] if final is not None else [])
        return merge_completions(self.original.request_id, parts, finish_reason)
