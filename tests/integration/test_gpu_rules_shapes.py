"""GPU rule, checked on CPU: sequence parallelism needs every microbatch width to divide by TP.

Megatron's sequence-parallel scatter / reduce-scatter assert ``S % TP == 0``
(megatron/core/tensor_parallel/mappings.py). The project's MegatronWorker at TP 2 and TP 4 with
``parallel.sequence_parallel`` on, fed packed microbatches whose natural widths are odd, must
give the same loss, per-token logprobs and gradients (gathered to full HF shape) as an unsplit
TP-1 run without SP on the same tiny Qwen2.5-architecture model (fp32), i.e. the padding is
masked out and the SP norms' gradients are all-reduced over TP. Runs real Megatron-Core on gloo
through the CPU shim (its SP-tagged RMSNorm stands in for Megatron's torch norm, which refuses SP).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.megatron_cases import run_spmd
from tests.helpers.sequence_parallel_cases import odd_width_samples, sp_scenario

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

# (prompt, response) lengths: every sequence is odd, so no natural width divides by 2 or 4.
LENGTHS = [(4, 9), (3, 8), (5, 4), (6, 11), (2, 5), (7, 8), (3, 2), (4, 7)]
BUDGET = 36  # tokens per microbatch: several microbatches per rank, some with several rows
# (TP, PP, SP) on 4 ranks: TP2 x DP2, TP4, and TP2 x PP2 (the pipeline sends SP-split activations).
SP_LAYOUTS = [(2, 1, True), (4, 1, True), (2, 2, True)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_rl.model.tiny import build_tiny_qwen2

    # 4 KV groups so TP 4 divides them; untied lm_head like the 7B-32B recipes' models; 2 layers for PP 2.
    model = str(build_tiny_qwen2(tmp_path_factory.mktemp("sp_model"), seed=5, num_kv_heads=4,
                                 tie_word_embeddings=False))
    samples = odd_width_samples(LENGTHS, seed=11)
    ref_dir, sp_dir = tmp_path_factory.mktemp("sp_ref"), tmp_path_factory.mktemp("sp_runs")
    ref = run_spmd(sp_scenario, 1, (model, [(1, 1, False)], samples, BUDGET), ref_dir, timeout_s=300)[0][0]
    split = run_spmd(sp_scenario, 4, (model, SP_LAYOUTS, samples, BUDGET), sp_dir, timeout_s=540)[0]
    return ref, {r["layout"]: r for r in split}


def test_sp_runs_get_odd_natural_widths_padded_to_a_multiple_of_tp(runs):
    _, split = runs
    for (tp, _, _), r in split.items():
        assert r["model_sp"] and r["norms_tagged"], (tp, "the model must run with sequence parallelism")
        natural = [n for n, _, _ in r["widths"]]
        assert natural and all(n % 2 for n in natural), natural  # the case the rule is about
        for n, width, padded_tokens in r["widths"]:
            assert width % tp == 0 and n <= width < n + tp, (tp, n, width)
            # The token budget counts the padded width (several-row microbatches stay within it).
            assert padded_tokens <= BUDGET or padded_tokens == width, (tp, padded_tokens)


def test_sp_loss_and_logprobs_match_the_unsplit_reference(runs):
    ref, split = runs
    for layout, r in split.items():
        assert [len(x) for x in r["logprobs"]] == [n_r for _, n_r in LENGTHS], layout
        for got, want in zip(r["logprobs"], ref["logprobs"]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=2e-6, msg=str(layout))
        assert r["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-6, abs=1e-7), layout
        assert r["metrics"]["mask_tokens"] == ref["metrics"]["mask_tokens"] == sum(n for _, n in LENGTHS)


def test_sp_gradients_match_the_unsplit_reference(runs):
    ref, split = runs
    assert any("layernorm" in name or "norm" in name for name in ref["grads"])
    for layout, r in split.items():
        assert sorted(r["grads"]) == sorted(ref["grads"]), layout
        for name, want in ref["grads"].items():
            assert float(want.abs().max()) > 0, name  # every tensor gets a gradient in this batch
            scale = float(want.abs().max())
            diff = float((r["grads"][name] - want).abs().max())
            assert diff <= 1e-5 * scale, (layout, name, diff / scale)
