"""Trainer checkpoints through Megatron's dist_checkpointing on real Megatron-Core over gloo:
a step saved at one layout resumes at another (TP, PP, DP and world size changed) with the
weights and Adam moments carried over exactly and the next step equal to an uninterrupted run
at the new layout; a save killed half-way leaves the previous step loadable; legacy per-rank
checkpoints still resume at their own layout; the distributed optimizer's state reshards too.

Four sets of spawned ranks run in turn (the module fixture); the tests check slices of it:
  world 2, TP2        save step_000001 (policy + reference), a legacy copy, then a killed save
  world 4             save untied TP2xPP2 and a distributed-optimizer TP2xDP2 checkpoint;
                      resume tied at TP2xDP2 (same TP/PP) and TP1xPP2xDP2
  world 2             resume tied at PP2 and at DP2, untied TP2xPP2 -> DP2, legacy at TP2,
                      distributed optimizer at DP2 and PP2; refusals
  world 1             resume tied and the distributed optimizer at TP1 (world 2 / 4 -> 1)
"""
from __future__ import annotations

import pickle
import re

import pytest
import torch

from megatron_rl.tools import convert_checkpoint as cc
from tests.helpers.checkpoint_cases import KILLED, device_check_on_cpu, run_cases, save_then_die
from tests.helpers.megatron_cases import make_samples, run_spmd

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

TIED_SAVED = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
              "data_parallel_size": 1, "world_size": 2}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tiny_untied_model_dir, tmp_path_factory):
    from megatron_rl.checkpoint.store import latest
    from megatron_rl.model.tiny import build_tiny_qwen2

    root = tmp_path_factory.mktemp("distckpt")
    other = str(build_tiny_qwen2(root / "other", seed=7))  # same shapes, other weights
    other_untied = str(build_tiny_qwen2(root / "other_untied", seed=8, num_layers=4, tie_word_embeddings=False))
    tied, untied = str(tiny_model_dir), str(tiny_untied_model_dir)
    probe = make_samples(4, 5)
    run_dir, legacy = root / "run", root / "legacy"
    legacy.mkdir()
    (root / "s2").mkdir()
    with pytest.raises(RuntimeError, match=re.escape(f"exit codes {{0: {KILLED}, 1: {KILLED}}}")):
        run_spmd(save_then_die, 2, (tied, probe, str(run_dir), str(legacy), str(root / "s2"), (2, 1)),
                 root / "s2", timeout_s=400, fresh=True)  # its ranks exit: not the pooled ones
    saved = {r: pickle.loads((root / "s2" / f"saved{r}.pkl").read_bytes()) for r in range(2)}
    step1 = run_dir / "checkpoints" / "step_000001"
    interrupted = sorted((run_dir / "checkpoints").glob("step_000002.tmp-*"))
    after_kill = {"latest": latest(run_dir), "interrupted": interrupted,
                  "interrupted_files": sorted(p.name for p in interrupted[0].rglob("*") if p.is_file())}

    tied_case = {"hf": tied, "other_hf": other, "reference": True, "checkpoint": str(step1)}
    untied_ckpt, distopt_ckpt = root / "untied_tp2pp2", root / "distopt_tp2dp2"
    untied_case = {"hf": untied, "other_hf": other_untied, "reference": False, "checkpoint": str(untied_ckpt)}
    distopt_case = {"hf": tied, "other_hf": other, "reference": False, "checkpoint": str(distopt_ckpt),
                    "distributed_optimizer": True}
    cases4 = [
        {"kind": "save", "label": "untied tp2pp2", "tp": 2, "pp": 2, **untied_case},
        {"kind": "save", "label": "distopt tp2dp2", "tp": 2, "pp": 1, **distopt_case},
        {"kind": "resume", "label": "tp2 -> tp2dp2", "tp": 2, "pp": 1, **tied_case},
        {"kind": "resume", "label": "tp2 -> tp1pp2dp2", "tp": 1, "pp": 2, **tied_case},
    ]
    cases2 = [
        {"kind": "resume", "label": "tp2 -> pp2", "tp": 1, "pp": 2, **tied_case},
        {"kind": "resume", "label": "tp2 -> dp2", "tp": 1, "pp": 1, **tied_case},
        {"kind": "resume", "label": "untied tp2pp2 -> dp2", "tp": 1, "pp": 1, **untied_case},
        {"kind": "resume", "label": "legacy tp2", "tp": 2, "pp": 1, **tied_case, "checkpoint": str(legacy)},
        {"kind": "resume", "label": "distopt tp2dp2 -> dp2", "tp": 1, "pp": 1, **distopt_case},
        {"kind": "resume", "label": "distopt tp2dp2 -> pp2", "tp": 1, "pp": 2, **distopt_case},
        {"kind": "refused", "label": "legacy at pp2", "tp": 1, "pp": 2, **tied_case, "checkpoint": str(legacy)},
        {"kind": "refused", "label": "interrupted", "tp": 2, "pp": 1, **tied_case, "checkpoint": str(interrupted[0])},
    ]
    cases1 = [
        {"kind": "resume", "label": "tp2 -> tp1", "tp": 1, "pp": 1, **tied_case},
        {"kind": "resume", "label": "distopt tp2dp2 -> tp1", "tp": 1, "pp": 1, **distopt_case},
    ]
    results: dict[str, list[dict]] = {}
    for world, cases in ((4, cases4), (2, cases2), (1, cases1)):
        out = root / f"w{world}"
        out.mkdir()
        per_rank = run_spmd(run_cases, world, (cases, probe), out, timeout_s=900)
        for index, case in enumerate(cases):
            results[case["label"]] = [per_rank[r][index] for r in range(world)]
    return {"saved": saved, "after_kill": after_kill, "results": results, "step1": step1, "run_dir": run_dir}


RESUMED_DIST = ["tp2 -> tp2dp2", "tp2 -> tp1pp2dp2", "tp2 -> pp2", "tp2 -> dp2", "tp2 -> tp1"]


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def test_killed_save_leaves_no_step_and_the_previous_one_loads(runs, tmp_path):
    from megatron_rl.checkpoint.store import CheckpointError, CheckpointManager, latest, load_driver_state
    from megatron_rl.resharding.checkpoint_format import find_dist_checkpoint

    kill = runs["after_kill"]
    assert kill["latest"] == runs["step1"]
    # Killed after the tensor files were written: shards there, no metadata, no manifest.
    assert any(name.endswith(".distcp") for name in kill["interrupted_files"])
    assert "metadata.json" not in kill["interrupted_files"] and "manifest.json" not in kill["interrupted_files"]
    with pytest.raises(CheckpointError, match="interrupted"):
        find_dist_checkpoint(kill["interrupted"][0])
    refused = runs["results"]["interrupted"][0]["error"]
    assert refused.startswith("CheckpointError") and "interrupted" in refused
    manager = CheckpointManager(runs["run_dir"], keep=2)  # a restarted driver cleans up
    assert manager.removed_stale == [kill["interrupted"][0].name]
    assert latest(runs["run_dir"]) == runs["step1"] and load_driver_state(runs["step1"]) == {"next_step": 1}
    # ... and step 1 resumed everywhere below (test_weights_and_moments_carry_over_exactly).


def test_weights_and_moments_carry_over_exactly(runs):
    saved = runs["saved"][0]
    for label in RESUMED_DIST + ["legacy tp2"]:
        r = runs["results"][label][0]
        assert r["info"]["steps_done"] == 1, label
        assert all(torch.equal(r["weights"][k], v) for k, v in saved["weights"].items()), label
        for key in ("exp_avg", "exp_avg_sq"):
            assert r["adam"][key].keys() == saved["adam"][key].keys()
            assert all(torch.equal(r["adam"][key][k], v) for k, v in saved["adam"][key].items()), (label, key)
        assert all(rank["adam"]["steps"] == {1.0} for rank in runs["results"][label]), label
        if label != "legacy tp2":
            assert r["info"]["saved_layout"] == TIED_SAVED, label


def test_a_save_leaves_no_helper_process_behind(runs):
    # megatron-core's writer would start a multiprocessing Manager per rank on its first save
    # (megatron_rl.training.dist_checkpoint._in_process_write_results); its forked writers are joined.
    for label in ("untied tp2pp2", "distopt tp2dp2"):
        assert [r["helpers_after_save"] for r in runs["results"][label]] == [[]] * 4, label


def test_untied_tp2pp2_resumes_at_dp2(runs):
    save, r = runs["results"]["untied tp2pp2"][0], runs["results"]["untied tp2pp2 -> dp2"][0]
    assert r["info"]["saved_layout"]["pipeline_model_parallel_size"] == 2 and "lm_head.weight" in r["weights"]
    assert all(torch.equal(r["weights"][k], v) for k, v in save["weights"].items())
    for key in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(r["adam"][key][k], v) for k, v in save["adam"][key].items()), key


def _assert_same_step(r: dict, label: str, first_moments: dict) -> None:
    """The resumed step equals the uninterrupted run's at the same layout to fp32 rounding (the
    two histories differ only in the layout of the first step)."""
    base, got = r["base_metrics"], r["metrics"]
    assert got["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-6), label
    assert got["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5), label
    assert got["tokens"] == base["tokens"], label
    # Weights after two Adam steps (lr 1e-3). Where the first gradient is near zero, Adam's
    # update ~ g/(sqrt(v)+eps) turns rounding into up to a step's worth of difference (a few
    # elements of the 1.2M); everywhere the gradient is well defined they agree closely.
    worst_defined, loose, total = 0.0, 0, 0
    for name, want in r["base_weights"].items():
        diff = (r["weights_after"][name] - want).abs()
        loose, total = loose + int((diff > 1e-5).sum()), total + diff.numel()
        assert float(diff.max()) < 1e-3, (label, name)  # never a whole step (a wrong step counter or moment)
        if name in first_moments:
            defined = first_moments[name].sqrt() > 1e-5
            if defined.any():
                worst_defined = max(worst_defined, float(diff[defined].max()))
    assert worst_defined < 1e-5 and loose < 1e-4 * total, (label, worst_defined, loose)


def test_next_step_equals_uninterrupted_run_at_the_new_layout(runs):
    tied_v = runs["saved"][0]["adam"]["exp_avg_sq"]
    untied_v = runs["results"]["untied tp2pp2"][0]["adam"]["exp_avg_sq"]
    for label in RESUMED_DIST + ["legacy tp2"]:
        _assert_same_step(runs["results"][label][0], label, tied_v)
    _assert_same_step(runs["results"]["untied tp2pp2 -> dp2"][0], "untied tp2pp2 -> dp2", untied_v)
    # Same layout as saved: identical computation, identical result.
    same = runs["results"]["legacy tp2"][0]
    assert same["metrics"]["loss"] == same["base_metrics"]["loss"]
    assert all(torch.equal(same["weights_after"][k], v) for k, v in same["base_weights"].items())


def test_moments_match_an_uninterrupted_first_step_at_the_new_layout(runs):
    saved = runs["saved"][0]["adam"]
    for label in RESUMED_DIST:
        base = runs["results"][label][0]["base_adam"]
        for key in ("exp_avg", "exp_avg_sq"):
            for name, value in saved[key].items():
                torch.testing.assert_close(base[key][name], value, rtol=1e-4, atol=1e-6 * float(value.abs().max()),
                                           msg=f"{label} {key} {name}")


def test_reference_model_comes_from_the_checkpoint(runs):
    want = runs["saved"][0]["reference_logprobs"]  # the frozen reference = the HF model it started from
    for label in RESUMED_DIST:
        got = runs["results"][label][0]["reference_logprobs"]  # built from another model, then loaded
        assert max(float((torch.tensor(a) - torch.tensor(b)).abs().max()) for a, b in zip(got, want)) < 1e-5, label


def test_rng_restored_when_tp_and_pp_are_unchanged_else_freshly_seeded(runs):
    saved = {s["coords"][:2]: s["rng"] for s in runs["saved"].values()}
    for label in RESUMED_DIST:
        for rank in runs["results"][label]:
            restored = rank["info"]["rng_restored"]
            assert restored == (label == "tp2 -> tp2dp2"), label
            want = saved[rank["coords"][:2]] if restored else rank["fresh_rng"]
            assert torch.equal(rank["rng"]["torch_cpu"], want["torch_cpu"]), label
            assert rank["rng"]["tracker"].keys() == want["tracker"].keys()
            assert all(torch.equal(rank["rng"]["tracker"][k], v) for k, v in want["tracker"].items()), label
            if restored:  # the saved states were advanced: restoring is visible
                assert not torch.equal(rank["fresh_rng"]["torch_cpu"], want["torch_cpu"])


def test_legacy_checkpoint_at_another_layout_is_refused_with_the_way_forward(runs):
    error = runs["results"]["legacy at pp2"][0]["error"]
    assert error.startswith("CheckpointError") and "only resumes at its own layout" in error
    assert "on 2 ranks" in error and "save" in error


def test_distributed_optimizer_state_reshards(runs):
    for label in ("distopt tp2dp2 -> dp2", "distopt tp2dp2 -> pp2", "distopt tp2dp2 -> tp1"):
        r = runs["results"][label][0]
        save = runs["results"]["distopt tp2dp2"][0]
        assert r["info"]["saved_layout"]["data_parallel_size"] == 2
        assert all(torch.equal(r["weights"][k], v) for k, v in save["weights"].items()), label
        _assert_same_step(r, label, runs["saved"][0]["adam"]["exp_avg_sq"])


def test_step_directory_exports_to_hf(runs, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    out = cc.megatron_to_hf(str(runs["step1"]), str(tmp_path / "hf"), hf_config=str(tiny_model_dir))
    exported = load_file(str(out / "model.safetensors"))
    saved = runs["saved"][0]["weights"]
    assert exported.keys() == saved.keys() - {"lm_head.weight"}  # tied: no lm_head, as Qwen ships it
    assert all(torch.equal(exported[k], saved[k]) for k in exported)


def test_device_check_of_the_distributed_optimizer_passes_on_cpu(tmp_path):
    """The GPU check script's function (tests/gpu/dist_optimizer_check.py), here on CPU."""
    result = run_spmd(device_check_on_cpu, 1, (str(tmp_path / "work"),), tmp_path, timeout_s=400,
                      fresh=True)[0]  # it stands in for CUDA by patching: keep that out of the pool
    assert result["device"] == "cpu" and result["steps_done"] == 1
    assert result["optimizer_tensors"] >= 3 * 10 and result["optimizer_max_diff"] == 0.0
    assert result["weights_max_diff_after_step"] <= 1e-5


def test_benchmark_tool_prints_both_formats(tiny_model_dir, tmp_path, capsys):
    from megatron_rl.benchmarks import benchmark_checkpoint as bench

    assert bench.main(["--model", str(tiny_model_dir), "--repeats", "1", "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split(" (")[0]: line.split() for line in lines if line.startswith(("legacy", "dist_checkpointing"))}
    assert rows.keys() == {"legacy", "dist_checkpointing"}
    legacy_mb, dist_mb = float(rows["legacy"][-1]), float(rows["dist_checkpointing"][-1])
    assert 0.9 < dist_mb / legacy_mb < 1.2  # TP2, no replicas: the same bytes in either format
    assert not list((tmp_path / "out").iterdir())  # every checkpoint it wrote was removed
