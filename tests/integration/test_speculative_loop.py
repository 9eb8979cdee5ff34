"""The loop with speculative decoding on (tail batching, 'suffix' drafts in every round type):
the step metrics carry rollout/spec/* from the engines' counters, drafts are proposed and some
accepted, and the engine/trainer logprob parity holds every step (<= 1e-4), so the accepted
tokens are the policy's own. Runs on the SFT'd tiny model (its responses repeat across a group,
so drafts get accepted; the random-init model's near-uniform output would reject nearly all).
The trainer runs at TP 1 (speculation is the engine's). The same counters in the long rounds of
the full system, beside the stream trainer and the planner: test_whole_system.py."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers.train_runs import overrides, read_jsonl, run_train

pytestmark = [pytest.mark.integration, pytest.mark.loop, pytest.mark.slow]


def test_loop_speculates_stays_on_policy_and_keeps_history_over_epochs(sft_model_dir: Path, tmp_path: Path):
    """One run checks both: speculation's metrics and parity every step, and the history over
    epochs (8 prompts, P0=4, 5 launched per short round: the data cursor wraps in the second
    round, so the rounds from there on see prompts of an earlier epoch; history routing and the
    drafter's references run on the real stack, the prediction is scored, and the final
    checkpoint holds the history)."""
    from megatron_rl.checkpoint.store import CheckpointManager

    run_dir, steps = tmp_path / "run", 4
    args = overrides(sft_model_dir, run_dir, steps, [
        "parallel.tensor_model_parallel_size=1", "scheduler.name=tail_batching", "data.eval_every=0",
        "rollout.max_new_tokens=64", "data.builtin_num_prompts=8", "tail_batching.history_routing=true",
        "rollout.speculative.method=suffix", "rollout.speculative.rounds=short,long",
        # A loaded box can keep the engine's health answer waiting past the 10 s default: not a death.
        "rollout.engine_health_timeout_s=300",
    ])
    proc = run_train(args, tmp_path / "log.txt")
    try:
        rc = proc.wait(timeout=1800)  # a hang: a loaded 2-core box stretches the run's minutes several times
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session (run_train)
    log = (tmp_path / "log.txt").read_text()
    assert rc == 0, log[-4000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == steps
    for r in rows:
        assert r["rollout/logprob_abs_diff_max"] <= 1e-4, r
        assert r["rollout/spec/decode_steps"] > 0
        assert r["rollout/spec/draft_tokens"] >= r["rollout/spec/accepted_tokens"] >= 0
        assert 0.0 <= r["rollout/spec/acceptance_rate"] <= 1.0
        rt = r["round_type"]
        assert r[f"round/{rt}/spec_decode_steps"] == r["rollout/spec/decode_steps"]
    assert sum(r["rollout/spec/draft_tokens"] for r in rows) > 0
    assert sum(r["rollout/spec/accepted_tokens"] for r in rows) > 0
    accepted = [r for r in rows if r["rollout/spec/drafts"] > 0]
    assert all(r["rollout/spec/mean_accepted_length"] >= 1.0 for r in accepted)

    assert rows[-1]["rollout/history/prompts"] == 8  # every prompt of the set is remembered
    assert rows[-1]["rollout/history/tokens"] > 0
    # Later epochs: each launched prompt with an earlier outcome is scored or routed.
    informed = sum(r["rollout/history/true_long"] + r["rollout/history/false_long"] + r["rollout/history/true_short"]
                   + r["rollout/history/false_short"] + r["rollout/history/routed"] for r in rows)
    assert informed > 0
    state = CheckpointManager.load_driver_state(run_dir / "checkpoints" / f"step_{steps:06d}")
    history = state["scheduler"]["history"]["prompts"]
    assert len(history) == 8 and all(outcome in ("short", "long") for _, _, outcome, _, _ in history)
    assert any(responses for *_, responses in history)
