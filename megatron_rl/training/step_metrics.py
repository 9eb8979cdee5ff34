"""How a training step's per-microbatch metrics add up, and the trainer/engine logprob parity
measured inside the training forward.

Every metric a loss callback returns is additive over microbatches, chunks and ranks (sums,
normalised once at the end), except the keys ending in ``_max``, which combine by max.
"""
from __future__ import annotations

import torch

LOSS_METRICS = frozenset({"loss", "pg_loss", "kl_loss"})
"""Divided by the loss normaliser N (tokens or sequences, see algorithm.loss_agg) at the end."""
TOKEN_METRICS = frozenset({"clip_frac_low", "clip_frac_high", "approx_kl_old", "ratio_mean", "entropy_proxy",
                           "kl_ref", "tis_weight_mean", "tis_clip_frac", "tis_weight_abs_dev"})
"""Divided by the batch's response tokens at the end."""


def combine(into: dict[str, float], key: str, value: float, scale: float = 1.0) -> None:
    """Add ``value * scale`` to ``into[key]``; for a ``*_max`` key keep the larger value."""
    if key.endswith("_max"):
        into[key] = max(into.get(key, value), value)
    else:
        into[key] = into.get(key, 0.0) + value * scale


def combine_over_ranks(local: dict[str, float]) -> dict[str, float]:
    """Key-wise :func:`combine` of every rank's dict. Collective: every rank calls it, even with {}."""
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    combined: dict[str, float] = {}
    for part in gathered:
        for key, value in part.items():
            combine(combined, key, value)
    return combined


def parity_metrics(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """|trainer - engine| logprob of this microbatch's tokens where ``mask`` is set (the response
    tokens the current weights generated: an off-policy token's engine logprob is an older
    policy's), as the ``_max``, the ``_sum`` and the token count ``_tokens`` (the caller divides):
    the on-policy check when the training forward itself scores the batch
    (algorithm.recompute_old_logprobs=false)."""
    diff = (logprobs.detach() - engine_logprobs.to(logprobs.dtype)).abs()[mask.bool()]
    if diff.numel() == 0:
        return {"logprob_abs_diff_sum": 0.0, "logprob_abs_diff_tokens": 0.0}
    return {"logprob_abs_diff_max": float(diff.max()), "logprob_abs_diff_sum": float(diff.sum()),
            "logprob_abs_diff_tokens": float(diff.numel())}
