"""The clipped policy-gradient loss (PPO / GRPO / DAPO / Dr.GRPO) for one microbatch.

Per response token t (A is the response's advantage, r the ratio pi / pi_old)::

    r      = exp(clamp(logp - old_logp, -log_ratio_clamp, log_ratio_clamp))
    pg     = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))       (DAPO's clip-higher)
    pg     = min(pg, -A * clip_ratio_c)   for A < 0                         (dual-clip PPO)
    pg    *= w,  w = min(exp(old_logp - engine_logp), tis_cap), detached   (only if tis_cap > 0)
    kl     = logp - ref_logp                                   (kl_type 'k1')
           | exp(ref_logp - logp) - (ref_logp - logp) - 1       (kl_type 'k3', >= 0)
    loss_t = pg + kl_coef * kl                                 (kl only if kl_coef > 0)

Aggregation (``cfg.loss_agg``); the totals count the *whole* batch of one optimizer step, so the
sum of the returned losses over all its microbatches equals the full-batch loss, whatever the
split. That is what makes microbatching and streaming gradients exact.

* ``token_mean`` (DAPO): ``sum_{seq, t} loss_t / num_tokens_total``; ``num_tokens_total`` is the
  number of response tokens (mask == 1) in the batch.
* ``seq_mean_token_mean`` (GRPO): ``sum_seq mean_t(loss_t) / num_seqs_total``.
* ``seq_mean_token_sum`` (Dr.GRPO): ``sum_seq sum_t(loss_t) / num_seqs_total``. The normaliser is
  the constant number of sequences, never a length, so long and short responses weigh each token
  alike. (Dr.GRPO's reference code divides each sequence's token sum by the constant
  generation budget instead; that differs from this definition by the constant factor
  ``max_new_tokens``, i.e. only by a learning-rate rescale.)

Both sequence aggregations need ``seq_ids`` and every sequence whole inside one microbatch.

Metrics are floats already divided by the batch totals, so the caller combines microbatches (and
data-parallel ranks, with an all-reduce SUM) by adding them:

* token metrics (``clip_frac_low``, ``clip_frac_high``, ``clip_frac_dual``, ``approx_kl_old``, ``kl_ref``,
  ``tis_weight_mean``, ``tis_weight_abs_dev``, ``entropy_proxy``, ``ratio_mean``): sum over this microbatch's response
  tokens / ``num_tokens_total`` -> the batch token mean after summing;
* ``pg_loss`` and ``kl_loss``: the two parts of ``loss``, aggregated exactly like it;
* ``num_tokens``, ``num_seqs``: this microbatch's counts (sums give the totals);
* with ``staleness`` and TIS on: ``tis_stale_weight_sum`` and ``tis_stale_tokens`` (raw sums over
  the tokens an older policy generated: their ratio is those tokens' mean weight) and
  ``tis_stale_weight_max``.

Off-policy tokens (a scheduler with a staleness bound > 0, see ``megatron_rl.loop.off_policy``) need
nothing else: ``engine_logp`` is then the behaviour policy's logprob and ``old_logp`` the current
policy's, so ``w`` is the truncated importance weight between the two, whichever way the old
logprobs come (a scoring pass or the training forward).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.config.schema import AlgorithmConfig

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_TYPES = ("k1", "k3")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_type: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token logprobs ('k1' or 'k3')."""
    log_ratio = ref_logprobs - logprobs
    if kl_type == "k1":
        return -log_ratio
    if kl_type == "k3":
        # Schulman's k3: unbiased and non-negative; the clamp only guards exp overflow on
        # tokens whose policy logprob collapsed (20 nats is already an enormous KL).
        log_ratio = log_ratio.clamp(max=20.0)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"algorithm.kl_type={kl_type!r}: expected one of {KL_TYPES}")


def _aggregate(
    token_values: Tensor,
    mask: Tensor,
    seq_index: Tensor | None,
    num_seqs: int,
    loss_agg: str,
    num_tokens_total: int,
    num_seqs_total: int,
) -> Tensor:
    """Reduce masked per-token values to this microbatch's share of the batch loss."""
    masked = token_values * mask
    if loss_agg == "token_mean":
        return masked.sum() / num_tokens_total
    seq_sum = masked.new_zeros(num_seqs).index_add(0, seq_index, masked)
    if loss_agg == "seq_mean_token_sum":
        return seq_sum.sum() / num_seqs_total
    seq_count = mask.new_zeros(num_seqs).index_add(0, seq_index, mask)
    # A sequence without response tokens in this microbatch contributes 0, not 0/0.
    seq_mean = seq_sum / seq_count.clamp(min=1.0)
    return seq_mean.sum() / num_seqs_total


def _check_inputs(
    logprobs: Tensor,
    others: dict[str, Tensor | None],
    cfg: AlgorithmConfig,
    seq_ids: Tensor | None,
    num_tokens_total: int,
    num_seqs_total: int,
) -> None:
    if cfg.loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"algorithm.loss_agg={cfg.loss_agg!r}: expected one of {LOSS_AGGREGATIONS}")
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs {tuple(logprobs.shape)}")
    if cfg.kl_coef > 0 and others["ref_logprobs"] is None:
        raise ValueError("algorithm.kl_coef > 0 needs ref_logprobs (enable model.use_reference_model)")
    if cfg.tis_cap > 0 and others["engine_logprobs"] is None:
        raise ValueError("algorithm.tis_cap > 0 needs engine_logprobs (the rollout engine's logprobs)")
    if cfg.loss_agg != "token_mean":
        if seq_ids is None:
            raise ValueError(f"algorithm.loss_agg={cfg.loss_agg!r} needs seq_ids (each token's sequence)")
        if seq_ids.shape != logprobs.shape:
            raise ValueError(f"seq_ids has shape {tuple(seq_ids.shape)}, logprobs {tuple(logprobs.shape)}")
    if num_tokens_total <= 0 or num_seqs_total <= 0:
        raise ValueError(
            f"num_tokens_total={num_tokens_total} and num_seqs_total={num_seqs_total} must be > 0"
        )


def compute_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cfg: AlgorithmConfig,
    ref_logprobs: Tensor | None = None,
    engine_logprobs: Tensor | None = None,
    seq_ids: Tensor | None = None,
    staleness: Tensor | None = None,
    num_tokens_total: int,
    num_seqs_total: int,
) -> tuple[Tensor, dict[str, float]]:
    """This microbatch's share of the batch policy loss, plus additive metrics.

    Args:
        logprobs: current policy logprobs of the sampled tokens (requires grad), 1-D or any
            shape; every other per-token tensor has the same shape.
        old_logprobs: logprobs under the policy that generated the batch (no grad).
        advantages: per-token advantages (the response's scalar repeated over its tokens).
        mask: 1 for response tokens that count, 0 for prompt/padding (bool or float). Values
            at masked-out positions may be anything, even inf/nan: they are never used.
        cfg: ``clip_low``, ``clip_high``, ``clip_ratio_c``, ``log_ratio_clamp``, ``loss_agg``,
            ``kl_coef``, ``kl_type``, ``tis_cap``.
        ref_logprobs: reference-model logprobs; required when ``cfg.kl_coef > 0``.
        engine_logprobs: rollout-engine logprobs; required when ``cfg.tis_cap > 0``.
        seq_ids: each token's sequence index (any integers, equal within a sequence);
            required by the sequence aggregations.
        staleness: per token, the versions between the policy that generated it and the one
            being trained (> 0: off-policy); only read for the stale tokens' TIS metrics.
        num_tokens_total: response tokens in the whole batch of this optimizer step.
        num_seqs_total: sequences in the whole batch of this optimizer step.

    Returns:
        ``(loss, metrics)``: a scalar tensor and floats; see the module docstring for how
        both sum across microbatches.
    """
    _check_inputs(
        logprobs,
        {"old_logprobs": old_logprobs, "advantages": advantages, "mask": mask,
         "ref_logprobs": ref_logprobs, "engine_logprobs": engine_logprobs, "staleness": staleness},
        cfg, seq_ids, num_tokens_total, num_seqs_total,
    )
    valid = mask.bool()
    maskf = valid.to(logprobs.dtype)
    zero = torch.zeros_like(logprobs)
    # Masked-out positions are replaced by neutral values before exp(): a garbage logprob at a
    # padding token would otherwise turn the whole sum (and its gradient) into nan.
    logp = torch.where(valid, logprobs, zero)
    old = torch.where(valid, old_logprobs.detach().to(logprobs.dtype), zero)
    adv = torch.where(valid, advantages.detach().to(logprobs.dtype), zero)

    log_ratio = logp - old
    if cfg.log_ratio_clamp > 0:  # exp() of a huge log-ratio is inf: one token would own the step
        log_ratio = log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * clipped_ratio
    pg = torch.maximum(pg_unclipped, pg_clipped)
    dual_clipped = None
    if cfg.clip_ratio_c > 0:
        # For A < 0 the max above grows with r without bound; the dual clip caps it at -A * c
        # (zero gradient there), as in veRL's compute_policy_loss.
        dual_bound = -adv * cfg.clip_ratio_c
        dual_clipped = (adv < 0) & (pg > dual_bound)
        pg = torch.where(dual_clipped, dual_bound, pg)

    tis_weight = None
    if cfg.tis_cap > 0:
        engine = torch.where(valid, engine_logprobs.detach().to(logprobs.dtype), zero)
        tis_weight = torch.exp(old - engine).clamp(max=cfg.tis_cap)
        pg = pg * tis_weight

    seq_index, num_seqs = None, 0
    if cfg.loss_agg != "token_mean":
        # Compact arbitrary sequence ids to 0..S-1 for index_add.
        uniq, seq_index = torch.unique(seq_ids.reshape(-1), return_inverse=True)
        seq_index = seq_index.to(logprobs.device)
        num_seqs = int(uniq.numel())
    flat_mask = maskf.reshape(-1)

    def agg(values: Tensor) -> Tensor:
        return _aggregate(values.reshape(-1), flat_mask, seq_index, num_seqs, cfg.loss_agg,
                          num_tokens_total, num_seqs_total)

    pg_loss = agg(pg)
    loss = pg_loss
    kl = None
    kl_loss = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if ref_logprobs is not None:
        ref = torch.where(valid, ref_logprobs.detach().to(logprobs.dtype), zero)
        kl = kl_penalty(logp, ref, cfg.kl_type)
        if cfg.kl_coef > 0:
            kl_loss = cfg.kl_coef * agg(kl)
            loss = loss + kl_loss

    metrics = _metrics(
        ratio.detach(), log_ratio.detach(), adv, logp.detach(), maskf, cfg,
        kl.detach() if kl is not None else None, tis_weight, num_tokens_total,
    )
    if tis_weight is not None and staleness is not None:
        metrics.update(_stale_tis_metrics(tis_weight, valid & (staleness > 0)))
    if dual_clipped is not None:
        metrics["clip_frac_dual"] = float((dual_clipped.to(maskf.dtype) * maskf).sum()) / num_tokens_total
    metrics["pg_loss"] = float(pg_loss.detach())
    metrics["kl_loss"] = float(kl_loss.detach())
    if seq_index is not None:
        metrics["num_seqs"] = float(torch.unique(seq_index[flat_mask.bool()]).numel())
    return loss, metrics


def _metrics(
    ratio: Tensor,
    log_ratio: Tensor,
    adv: Tensor,
    logp: Tensor,
    maskf: Tensor,
    cfg: AlgorithmConfig,
    kl: Tensor | None,
    tis_weight: Tensor | None,
    num_tokens_total: int,
) -> dict[str, float]:
    """Token metrics as sums over this microbatch divided by the batch token count."""

    def token_sum(values: Tensor) -> float:
        return float((values * maskf).sum()) / num_tokens_total

    # The clipped branch is the active one (zero gradient) exactly on these tokens.
    clipped_low = ((ratio < 1.0 - cfg.clip_low) & (adv < 0)).to(maskf.dtype)
    clipped_high = ((ratio > 1.0 + cfg.clip_high) & (adv > 0)).to(maskf.dtype)
    # k3 estimate of KL(pi_old || pi): how far the policy moved from the sampler (>= 0).
    approx_kl = torch.exp(log_ratio) - log_ratio - 1.0
    metrics = {
        "clip_frac_low": token_sum(clipped_low),
        "clip_frac_high": token_sum(clipped_high),
        "approx_kl_old": token_sum(approx_kl),
        "ratio_mean": token_sum(ratio),
        # -log pi(sampled token) is a one-sample estimate of the policy's entropy: free here.
        "entropy_proxy": token_sum(-logp),
        "num_tokens": float(maskf.sum()),
    }
    if kl is not None:
        metrics["kl_ref"] = token_sum(kl)
    if tis_weight is not None:
        metrics["tis_weight_mean"] = token_sum(tis_weight)
        metrics["tis_clip_frac"] = token_sum((tis_weight >= cfg.tis_cap).to(maskf.dtype))
        # How far the correction moves tokens from weight 1 (quantized rollout: its size).
        metrics["tis_weight_abs_dev"] = token_sum((tis_weight - 1.0).abs())
    return metrics


def _stale_tis_metrics(tis_weight: Tensor, stale: Tensor) -> dict[str, float]:
    """Raw sums over the tokens an older policy generated (they add up over microbatches and
    ranks; the loop divides): their truncated importance weights and how many there are."""
    weights = tis_weight.detach()[stale]
    metrics = {"tis_stale_weight_sum": float(weights.sum()), "tis_stale_tokens": float(weights.numel())}
    if weights.numel():
        metrics["tis_stale_weight_max"] = float(weights.max())
    return metrics
