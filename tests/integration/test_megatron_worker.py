"""MegatronWorker on real Megatron-Core over gloo: HF parity, TP/PP/DP/microbatch invariance of
logprobs and gradients, weight export, checkpoint round trip.

One set of 4 spawned ranks runs every layout in turn (sharing the torch.distributed world);
the tests below check slices of its results against transformers computed here.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.megatron_cases import hf_reference, make_samples, parity_scenarios, run_spmd

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

BIG, SMALL = 4096, 24  # token budgets: one microbatch per rank vs many microbatches
LAYOUTS = [
    ("tied", 1, 1, BIG),     # TP1 PP1 DP4 (checkpoint round trip runs here)
    ("tied", 1, 1, SMALL),   # same, many microbatches
    ("tied", 2, 1, SMALL),   # TP2 DP2
    ("tied", 1, 2, SMALL),   # PP2 DP2 with tied embeddings split over stages
    ("untied", 1, 1, BIG),   # 4-layer untied, DP4
    ("untied", 2, 2, SMALL),  # TP2 x PP2
]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tiny_untied_model_dir, tmp_path_factory):
    dirs = {"tied": str(tiny_model_dir), "untied": str(tiny_untied_model_dir)}
    samples, refs = {}, {}
    for key, seed in (("tied", 0), ("untied", 1)):
        batch = make_samples(10, seed)
        logprobs, _, _ = hf_reference(dirs[key], batch)
        g = torch.Generator().manual_seed(seed + 7)
        for s, lp in zip(batch, logprobs):  # old != current so the quadratic term has a gradient
            s.old_logprobs = (torch.tensor(lp) + 0.1 * torch.randn(len(lp), generator=g)).tolist()
        refs[key] = hf_reference(dirs[key], batch)
        samples[key] = batch
    out = tmp_path_factory.mktemp("spmd")
    results = run_spmd(parity_scenarios, 4, (dirs, LAYOUTS, samples, str(out / "ckpt")), out, timeout_s=540)[0]
    return {r["layout"]: r for r in results}, refs, samples


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b) if x)


def _assert_same_adam_step(r: dict, ref: dict, label: str) -> None:
    """Updated weights agree wherever the gradient is well above Adam's eps (1e-8). Near-zero
    gradients make the first Adam step ~ g/(|g|+eps), which amplifies fp32 noise arbitrarily."""
    checked = total = 0
    for name, g in ref["grads"].items():
        well_conditioned = g.abs() > 1e-6
        checked, total = checked + int(well_conditioned.sum()), total + g.numel()
        torch.testing.assert_close(r["weights"][name][well_conditioned], ref["weights"][name][well_conditioned],
                                   rtol=1e-5, atol=1e-6, msg=f"{label} {name}")
    assert checked > total // 2  # (embedding rows of unused tokens have no gradient at all)


def test_logprobs_match_transformers_fp32(runs):
    results, refs, samples = runs
    for layout, r in results.items():
        ref_logprobs = refs[layout[0]][0]
        assert [len(x) for x in r["logprobs"]] == [len(s.response_ids) for s in samples[layout[0]]]
        assert _max_diff(r["logprobs"], ref_logprobs) < 1e-5, layout


def test_gradients_match_transformers_for_every_layout(runs):
    results, refs, _ = runs
    for layout, r in results.items():
        ref_grads = refs[layout[0]][2]
        assert sorted(r["grads"]) == sorted(ref_grads), layout
        for name, g in ref_grads.items():
            scale = float(g.abs().max()) + 1e-12
            assert float((r["grads"][name] - g).abs().max()) / scale < 1e-4, (layout, name)


def test_microbatching_does_not_change_the_step(runs):
    results, refs, samples = runs
    big, small = results[("tied", 1, 1, BIG)], results[("tied", 1, 1, SMALL)]
    for name, g in big["grads"].items():
        torch.testing.assert_close(small["grads"][name], g, rtol=1e-5, atol=1e-7)
    _assert_same_adam_step(small, big, "microbatched")
    # Loss is the full-batch loss (summed over microbatches and DP ranks, not averaged).
    assert big["metrics"]["loss"] == pytest.approx(refs["tied"][1], rel=1e-5)
    assert small["metrics"]["loss"] == pytest.approx(refs["tied"][1], rel=1e-5)
    total = sum(len(s.response_ids) for s in samples["tied"])
    assert big["metrics"]["mask_tokens"] == total and small["metrics"]["mask_tokens"] == total
    assert big["metrics"]["tokens"] == total and big["metrics"]["grad_norm"] > 0


def test_tp_pp_match_single_rank_layout(runs):
    results, _, _ = runs
    for base, others in ((("tied", 1, 1, BIG), [("tied", 2, 1, SMALL), ("tied", 1, 2, SMALL)]),
                         (("untied", 1, 1, BIG), [("untied", 2, 2, SMALL)])):
        ref = results[base]
        for layout in others:
            r = results[layout]
            assert r["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5)
            assert r["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-4)
            assert _max_diff(r["logprobs"], ref["logprobs"]) < 1e-5
            _assert_same_adam_step(r, ref, str(layout))


def test_export_has_hf_names_and_tied_lm_head(runs, tiny_model_dir):
    from safetensors.torch import load_file

    results, _, _ = runs
    r = results[("tied", 1, 2, SMALL)]
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(r["weights"]) == set(original) | {"lm_head.weight"}
    assert torch.equal(r["weights"]["lm_head.weight"], r["weights"]["model.embed_tokens.weight"])
    # One Adam step at lr 1e-3 moved the weights by about lr.
    delta = (r["weights"]["model.layers.0.mlp.up_proj.weight"] - original["model.layers.0.mlp.up_proj.weight"]).abs()
    assert 1e-4 < float(delta.max()) < 3e-3


def test_checkpoint_round_trip_restores_params_and_optimizer(runs):
    results, _, _ = runs
    ck = results[("tied", 1, 1, BIG)]["checkpoint"]
    assert ck["changed_by_step"] and ck["restored_equal"]
    assert ck["optimizer_equal_all_ranks"] and ck["has_adam_state"]


def test_reference_model_stays_frozen(runs):
    results, _, _ = runs
    r = results[("tied", 1, 1, BIG)]
    assert r["reference_after_step"] == r["logprobs"]  # bit-identical to the pre-step policy
    assert _max_diff(r["policy_after_step"], r["logprobs"]) > 1e-4  # while the policy moved
