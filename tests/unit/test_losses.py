"""The policy loss: hand-computed values, gradients on each clip side, microbatch additivity."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.losses import compute_policy_loss, kl_penalty
from megatron_rl.config.schema import AlgorithmConfig

# Ratios r and advantages A shared by several tests (clip_low 0.2, clip_high 0.28):
#   t0: r=1.0, A= 1: max(-1.0, -1.0)               = -1.0
#   t1: r=1.5, A= 1: max(-1.5, -clip(1.5)=-1.28)   = -1.28  (clipped high: zero grad)
#   t2: r=0.5, A=-1: max( 0.5,  clip(0.5)= 0.8)    =  0.8   (clipped low: zero grad)
#   t3: r=1.1, A=-2: max( 2.2,  2*1.1    = 2.2)    =  2.2
RATIOS = [1.0, 1.5, 0.5, 1.1]
ADVS = [1.0, 1.0, -1.0, -2.0]
TOKEN_LOSSES = [-1.0, -1.28, 0.8, 2.2]


def _cfg(**kw) -> AlgorithmConfig:
    base = {"clip_low": 0.2, "clip_high": 0.28}
    base.update(kw)
    return AlgorithmConfig(**base)


def _inputs(ratios=RATIOS, advs=ADVS):
    old = torch.zeros(len(ratios), dtype=torch.float64)
    logp = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor(advs, dtype=torch.float64)
    mask = torch.ones(len(ratios), dtype=torch.bool)
    return logp, old, adv, mask


def test_token_mean_value_metrics_and_gradients() -> None:
    logp, old, adv, mask = _inputs()
    loss, metrics = compute_policy_loss(logp, old, adv, mask, cfg=_cfg(),
                                        num_tokens_total=4, num_seqs_total=1)
    # sum(TOKEN_LOSSES) = 0.72 -> / 4 tokens = 0.18
    assert loss.item() == pytest.approx(0.18)
    assert metrics["pg_loss"] == pytest.approx(0.18)
    assert metrics["kl_loss"] == 0.0
    assert metrics["clip_frac_high"] == pytest.approx(0.25)   # t1
    assert metrics["clip_frac_low"] == pytest.approx(0.25)    # t2
    assert metrics["ratio_mean"] == pytest.approx(1.025)      # (1 + 1.5 + 0.5 + 1.1) / 4
    # k3(old||new) = r - log r - 1: 0, 0.094535, 0.193147, 0.004690 -> sum 0.292372 / 4
    assert metrics["approx_kl_old"] == pytest.approx(0.073093, abs=1e-6)
    # -mean(log r) = -(0 + 0.405465 - 0.693147 + 0.095310) / 4
    assert metrics["entropy_proxy"] == pytest.approx(0.048093, abs=1e-6)
    assert metrics["num_tokens"] == 4.0
    loss.backward()
    # d loss / d logp = -A * r / 4 on the unclipped branch, 0 on the clipped one:
    # t0: -1 * 1 / 4 = -0.25; t1: 0; t2: 0; t3: 2 * 1.1 / 4 = 0.55
    assert logp.grad.tolist() == pytest.approx([-0.25, 0.0, 0.0, 0.55])


def test_gradient_is_zero_only_on_the_clipped_side() -> None:
    # a: A>0, r=1.5 (> 1.28)  -> clipped, grad 0
    # b: A>0, r=0.5 (< 0.8)   -> unclipped (min picks r*A), grad -1 * 0.5 / 5 = -0.1
    # c: A<0, r=0.5 (< 0.8)   -> clipped, grad 0
    # d: A<0, r=1.5 (> 1.28)  -> unclipped, grad 1 * 1.5 / 5 = 0.3
    # e: A>0, r=1.1 (inside)  -> unclipped, grad -1 * 1.1 / 5 = -0.22
    logp, old, adv, mask = _inputs([1.5, 0.5, 0.5, 1.5, 1.1], [1.0, 1.0, -1.0, -1.0, 1.0])
    loss, metrics = compute_policy_loss(logp, old, adv, mask, cfg=_cfg(),
                                        num_tokens_total=5, num_seqs_total=1)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -0.1, 0.0, 0.3, -0.22])
    assert metrics["clip_frac_high"] == pytest.approx(0.2)
    assert metrics["clip_frac_low"] == pytest.approx(0.2)


def test_masked_tokens_are_ignored_even_when_nan() -> None:
    logp, old, adv, _ = _inputs(RATIOS + [1.0], ADVS + [5.0])
    with torch.no_grad():
        logp[4] = float("nan")
    old[4] = float("inf")
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.float64)
    loss, metrics = compute_policy_loss(logp, old, adv, mask, cfg=_cfg(),
                                        num_tokens_total=4, num_seqs_total=1)
    loss.backward()
    assert loss.item() == pytest.approx(0.18)
    assert logp.grad.tolist() == pytest.approx([-0.25, 0.0, 0.0, 0.55, 0.0])
    assert all(math.isfinite(v) for v in metrics.values())


def test_sequence_aggregations() -> None:
    # seq 7 = tokens t0..t2, seq 3 = token t3 (ids need not be contiguous or sorted)
    seq_ids = torch.tensor([7, 7, 7, 3])
    logp, old, adv, mask = _inputs()
    loss, metrics = compute_policy_loss(logp, old, adv, mask, cfg=_cfg(loss_agg="seq_mean_token_mean"),
                                        seq_ids=seq_ids, num_tokens_total=4, num_seqs_total=2)
    # means: (-1 - 1.28 + 0.8) / 3 = -0.493333 and 2.2 -> sum 1.706667 / 2 seqs
    assert loss.item() == pytest.approx(0.853333, abs=1e-6)
    assert metrics["num_seqs"] == 2.0
    loss.backward()
    # t0: -A*r / 3 / 2 = -1/6; t3: 2.2 / 1 / 2 = 1.1
    assert logp.grad.tolist() == pytest.approx([-1 / 6, 0.0, 0.0, 1.1])

    logp, old, adv, mask = _inputs()
    loss, _ = compute_policy_loss(logp, old, adv, mask, cfg=_cfg(loss_agg="seq_mean_token_sum"),
                                  seq_ids=seq_ids, num_tokens_total=4, num_seqs_total=2)
    # sums: -1.48 and 2.2 -> 0.72 / 2 seqs
    assert loss.item() == pytest.approx(0.36)


def test_kl_estimators_values_and_gradients() -> None:
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    # k1 = logp - ref = [0.5, -1.0]
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    # k3 = exp(ref - logp) - (ref - logp) - 1: exp(-0.5) + 0.5 - 1 = 0.106531, e - 1 - 1 = 0.718282
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx([0.106531, 0.718282], abs=1e-6)

    adv = torch.zeros(2, dtype=torch.float64)
    mask = torch.ones(2)
    cfg = _cfg(kl_coef=0.1, kl_type="k3")
    loss, metrics = compute_policy_loss(logp, logp.detach(), adv, mask, cfg=cfg, ref_logprobs=ref,
                                        num_tokens_total=2, num_seqs_total=1)
    # 0.1 * (0.106531 + 0.718282) / 2
    assert loss.item() == pytest.approx(0.041241, abs=1e-6)
    assert metrics["kl_loss"] == pytest.approx(0.041241, abs=1e-6)
    assert metrics["kl_ref"] == pytest.approx(0.412406, abs=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp): 0.393469, -1.718282; times 0.1 / 2
    assert logp.grad.tolist() == pytest.approx([0.0196735, -0.0859141], abs=1e-6)

    loss, _ = compute_policy_loss(logp, logp.detach(), adv, mask, cfg=_cfg(kl_coef=0.1, kl_type="k1"),
                                  ref_logprobs=ref, num_tokens_total=2, num_seqs_total=1)
    assert loss.item() == pytest.approx(0.1 * (0.5 - 1.0) / 2)


def test_truncated_importance_sampling() -> None:
    old = torch.tensor([-0.5, -2.0], dtype=torch.float64)
    logp = old.clone().requires_grad_(True)  # ratio 1
    engine = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    adv = torch.ones(2, dtype=torch.float64)
    # w = min(exp(old - engine), 1.5) = min(1.648721, 1.5), min(0.367879, 1.5) = 1.5, 0.367879
    loss, metrics = compute_policy_loss(logp, old, adv, torch.ones(2), cfg=_cfg(tis_cap=1.5),
                                        engine_logprobs=engine, num_tokens_total=2, num_seqs_total=1)
    # pg = -A * r * w = -1.5, -0.367879 -> mean -0.933940
    assert loss.item() == pytest.approx(-0.933940, abs=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx(0.933940, abs=1e-6)
    assert metrics["tis_clip_frac"] == pytest.approx(0.5)
    assert metrics["tis_weight_abs_dev"] == pytest.approx((0.5 + 0.632121) / 2, abs=1e-6)  # mean |w - 1|
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.75, -0.183940], abs=1e-6)


def _random_batch(seed: int, lengths: list[int]):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    old = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    logp = old + 0.4 * torch.randn(n, generator=gen, dtype=torch.float64)  # some tokens clip
    ref = old + 0.2 * torch.randn(n, generator=gen, dtype=torch.float64)
    engine = old + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)
    seq_ids = torch.cat([torch.full((length,), i) for i, length in enumerate(lengths)])
    adv = torch.randn(len(lengths), generator=gen, dtype=torch.float64)[seq_ids]
    mask = (torch.rand(n, generator=gen) > 0.2).to(torch.float64)  # some prompt/pad tokens
    return logp, old, adv, mask, ref, engine, seq_ids


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_microbatch_losses_sum_to_the_full_batch_loss(loss_agg: str) -> None:
    lengths = [3, 7, 2, 5, 4]
    logp, old, adv, mask, ref, engine, seq_ids = _random_batch(0, lengths)
    cfg = _cfg(loss_agg=loss_agg, kl_coef=0.05, tis_cap=2.0)
    totals = {"num_tokens_total": int(mask.sum()), "num_seqs_total": len(lengths)}

    full_logp = logp.clone().requires_grad_(True)
    full_loss, full_metrics = compute_policy_loss(full_logp, old, adv, mask, cfg=cfg, ref_logprobs=ref,
                                                  engine_logprobs=engine, seq_ids=seq_ids, **totals)
    full_loss.backward()

    split_logp = logp.clone().requires_grad_(True)
    summed_loss = 0.0
    summed_metrics: dict[str, float] = {}
    for lo, hi in [(0, 10), (10, 12), (12, 21)]:  # microbatch boundaries at sequence boundaries
        part, metrics = compute_policy_loss(split_logp[lo:hi], old[lo:hi], adv[lo:hi], mask[lo:hi],
                                            cfg=cfg, ref_logprobs=ref[lo:hi], engine_logprobs=engine[lo:hi],
                                            seq_ids=seq_ids[lo:hi], **totals)
        part.backward()
        summed_loss += part.item()
        for key, value in metrics.items():
            summed_metrics[key] = summed_metrics.get(key, 0.0) + value

    assert summed_loss == pytest.approx(full_loss.item(), rel=1e-12)
    assert torch.allclose(split_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-15)
    assert summed_metrics.keys() == full_metrics.keys()
    for key, value in full_metrics.items():
        assert summed_metrics[key] == pytest.approx(value, rel=1e-10, abs=1e-14), key
    assert full_metrics["clip_frac_low"] + full_metrics["clip_frac_high"] > 0  # clipping exercised


def test_clear_errors() -> None:
    logp, old, adv, mask = _inputs()
    common = {"num_tokens_total": 4, "num_seqs_total": 1}
    with pytest.raises(ValueError, match="loss_agg='mean'"):
        compute_policy_loss(logp, old, adv, mask, cfg=_cfg(loss_agg="mean"), **common)
    with pytest.raises(ValueError, match="needs seq_ids"):
        compute_policy_loss(logp, old, adv, mask, cfg=_cfg(loss_agg="seq_mean_token_mean"), **common)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        compute_policy_loss(logp, old, adv, mask, cfg=_cfg(kl_coef=0.1), **common)
    with pytest.raises(ValueError, match="needs engine_logprobs"):
        compute_policy_loss(logp, old, adv, mask, cfg=_cfg(tis_cap=2.0), **common)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        compute_policy_loss(logp, old[:3], adv, mask, cfg=_cfg(), **common)
    with pytest.raises(ValueError, match="num_tokens_total=0"):
        compute_policy_loss(logp, old, adv, mask, cfg=_cfg(), num_tokens_total=0, num_seqs_total=1)
    with pytest.raises(ValueError, match="kl_type='k2'"):
        kl_penalty(logp, old, "k2")


def test_dual_clip_caps_negative_advantage_tokens_with_a_huge_ratio() -> None:
    # clip_ratio_c = 3:
    # t0: A=-1, r=5   -> max(5, 1.28) = 5 > 3  -> dual-clipped to 3, grad 0
    # t1: A=-2, r=2   -> max(4, 2.56) = 4 < 6  -> unclipped, grad 2 * 2 / 4 = 1.0
    # t2: A= 1, r=5   -> max(-5, -1.28) = -1.28 (clip-high; the dual clip is for A < 0 only)
    # t3: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8   (clip-low)
    logp, old, adv, mask = _inputs([5.0, 2.0, 5.0, 0.5], [-1.0, -2.0, 1.0, -1.0])
    loss, metrics = compute_policy_loss(logp, old, adv, mask, cfg=_cfg(clip_ratio_c=3.0),
                                        num_tokens_total=4, num_seqs_total=1)
    assert loss.item() == pytest.approx((3.0 + 4.0 - 1.28 + 0.8) / 4)
    assert metrics["clip_frac_dual"] == pytest.approx(0.25)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0])
    # Without the dual clip t0 contributes its full 5 and a gradient of 1 * 5 / 4.
    logp, old, adv, mask = _inputs([5.0, 2.0, 5.0, 0.5], [-1.0, -2.0, 1.0, -1.0])
    loss, metrics = compute_policy_loss(logp, old, adv, mask, cfg=_cfg(clip_ratio_c=0.0),
                                        num_tokens_total=4, num_seqs_total=1)
    assert loss.item() == pytest.approx((5.0 + 4.0 - 1.28 + 0.8) / 4) and "clip_frac_dual" not in metrics
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([1.25, 1.0, 0.0, 0.0])


def test_log_ratio_clamp_keeps_a_huge_log_ratio_finite() -> None:
    """One token 1000 nats above its old logprob (possible with ppo_mini_batches > 1 after a big
    update, or a corrupted old logprob): without the clamp exp() is inf and the step is lost."""
    logp = torch.tensor([1000.0, 0.1], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(2, dtype=torch.bool)
    loss, metrics = compute_policy_loss(logp, old, adv, mask, cfg=_cfg(clip_ratio_c=0.0),
                                        num_tokens_total=2, num_seqs_total=1)
    assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in metrics.values())
    assert loss.item() == pytest.approx((math.exp(20.0) - math.exp(0.1)) / 2)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -math.exp(0.1) / 2])  # clamped side: no gradient
    logp = torch.tensor([1000.0, 0.1], dtype=torch.float64, requires_grad=True)
    loss, _ = compute_policy_loss(logp, old, adv, mask, cfg=_cfg(clip_ratio_c=0.0, log_ratio_clamp=0.0),
                                  num_tokens_total=2, num_seqs_total=1)
    assert math.isinf(loss.item())
    # Both together (the defaults): the token is capped at -A * c = 3.
    logp = torch.tensor([1000.0, 0.1], dtype=torch.float64, requires_grad=True)
    loss, _ = compute_policy_loss(logp, old, adv, mask, cfg=AlgorithmConfig(), num_tokens_total=2, num_seqs_total=1)
    assert loss.item() == pytest.approx((3.0 - math.exp(0.1)) / 2)
