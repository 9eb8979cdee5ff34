"""``algorithm.recompute_old_logprobs=false``: the training forward's own logprobs serve as the
old ones, and the step equals the one that recomputes them first.

Two spawned ranks build the worker per case (TP2 with TIS, PP2 with tied embeddings split over
the stages, DP2 with KL). The reference step scores the batch with ``compute_logprobs`` (the
separate forward this option skips) and trains on it; the same initial weights and a fresh
optimizer are then loaded and the same samples, without old logprobs, are trained with the option
off. Engine logprobs are the current ones plus seeded noise, so the parity metrics the fused step
reports have something to measure. Checks, fp32:

* the gradient agrees to 1e-6 relative (whole-model norm) and 5e-6 of each tensor's max: the two
  steps compute the same sums, the old logprobs coming from an eval-mode instead of a train-mode
  forward of the same weights;
* the loss metrics agree, and the ratio is exactly 1 in both;
* the fused step's ``logprob_abs_diff_max`` / ``_sum`` equal |old - engine| computed here from the
  reference's recomputed old logprobs;
* two mini-batches with the option off are refused.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.helpers.megatron_cases import make_samples, policy_loss_cfg, run_spmd

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

NUM_SAMPLES = 10
CASES = [
    # name, tp, pp, loss_agg, kl_coef, tis_cap (world 2: DP = 2 / (tp * pp))
    ("tp2-token_mean-tis", 2, 1, "token_mean", 0.0, 1.5),
    ("pp2-seq_mean_token_sum", 1, 2, "seq_mean_token_sum", 0.0, 0.0),
    ("dp2-seq_mean_token_mean-kl", 1, 1, "seq_mean_token_mean", 0.05, 0.0),
]


def scenarios(rank: int, world: int, port: int, model_dir: str, samples) -> list | None:
    from megatron_rl.algorithms.losses import compute_policy_loss
    from megatron_rl.training.megatron_worker import MegatronWorker

    results = []
    for index, (name, tp, pp, loss_agg, kl_coef, tis_cap) in enumerate(CASES):
        cfg = policy_loss_cfg(tp, pp, loss_agg, kl_coef, tis_cap)
        loss_fn = functools.partial(compute_policy_loss, cfg=cfg.algorithm)
        worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
        worker.load_hf(model_dir)
        batch = [dataclasses.replace(s) for s in samples]
        g = torch.Generator().manual_seed(200 + index)
        for s, lp in zip(batch, worker.compute_logprobs(batch)):
            s.engine_logprobs = (torch.tensor(lp) + 0.1 * torch.randn(len(lp), generator=g)).tolist()
        if kl_coef > 0:
            for s, lp in zip(batch, worker.compute_logprobs(batch, "reference")):
                s.ref_logprobs = (torch.tensor(lp) + 0.2 * torch.randn(len(lp), generator=g)).tolist()

        # Reference: the separate scoring forward, then the step.
        for s, lp in zip(batch, worker.compute_logprobs(batch)):
            s.old_logprobs = lp
        ref_metrics = worker.train_step(batch, loss_fn)
        ref = {"grads": worker.export_hf_grads(), "metrics": ref_metrics,
               "old": [list(s.old_logprobs) for s in batch]}

        worker.load_hf(model_dir)  # same initial weights, fresh Adam state
        fused_batch = [dataclasses.replace(s, old_logprobs=[]) for s in batch]
        worker.cfg.algorithm.recompute_old_logprobs = False
        fused_metrics = worker.train_step(fused_batch, loss_fn)
        fused = {"grads": worker.export_hf_grads(), "metrics": fused_metrics}
        refusal = "no error"
        worker.cfg.algorithm.ppo_mini_batches = 2
        try:
            worker.train_step(fused_batch, loss_fn)
        except ValueError as exc:
            refusal = str(exc)
        results.append({"name": name, "ref": ref, "fused": fused, "refusal": refusal,
                        "engine": [list(s.engine_logprobs) for s in batch]})
        worker.shutdown(destroy_world=index == len(CASES) - 1)
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    samples = make_samples(NUM_SAMPLES, seed=5)
    out = tmp_path_factory.mktemp("onpolicy_spmd")
    return {r["name"]: r for r in run_spmd(scenarios, 2, (str(tiny_model_dir), samples), out, timeout_s=300)[0]}


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_fused_step_equals_recomputed_step(runs, case):
    r = runs[case]
    ref_g, fused_g = r["ref"]["grads"], r["fused"]["grads"]
    assert ref_g.keys() == fused_g.keys()
    norm_ref = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_g.values()))
    norm_diff = torch.sqrt(sum(((fused_g[k].double() - g.double()) ** 2).sum() for k, g in ref_g.items()))
    assert norm_ref > 0
    assert norm_diff <= 1e-6 * norm_ref, (case, float(norm_diff / norm_ref))
    for k, g in ref_g.items():
        assert (fused_g[k] - g).abs().max() <= 5e-6 * g.abs().max() + 1e-12, k
    ref_m, fused_m = r["ref"]["metrics"], r["fused"]["metrics"]
    for key in ("loss", "pg_loss", "kl_loss", "entropy_proxy", "num_tokens"):
        assert fused_m[key] == pytest.approx(ref_m[key], rel=1e-5, abs=1e-7), key
    assert fused_m["ratio_mean"] == pytest.approx(1.0, abs=1e-12)  # exp(0) per token; sums round
    assert ref_m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_fused_step_reports_trainer_engine_parity(runs, case):
    r = runs[case]
    diffs = [abs(a - b) for old, eng in zip(r["ref"]["old"], r["engine"]) for a, b in zip(old, eng)]
    m = r["fused"]["metrics"]
    assert m["logprob_abs_diff_max"] == pytest.approx(max(diffs), rel=1e-4)
    assert m["logprob_abs_diff_sum"] == pytest.approx(sum(diffs), rel=1e-4)
    assert m["num_tokens"] == len(diffs)
    assert "logprob_abs_diff_max" not in r["ref"]["metrics"]  # the recomputing path measures it itself


def test_two_mini_batches_are_refused(runs):
    for r in runs.values():
        assert "algorithm.recompute_old_logprobs=false needs algorithm.ppo_mini_batches == 1" in r["refusal"]
