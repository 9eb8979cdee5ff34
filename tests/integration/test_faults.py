"""Fault injection on the real stack: parts killed, stalled or lost mid-work.

The whole loop (``python -m megatron_rl.train``), one run directory in seven attempts, faults
injected at exact points by ``megatron_rl.fault_injection`` (armed through the environment). The
chain runs first, before the module's Ray session exists:

1. the engine core SIGKILLed while it receives a tensor weight push, and again while it holds
   validation requests (expected: recovered inside the step); then trainer rank 1 SIGKILLed
   mid-backward (expected: stopped cleanly);
2. resumed; rank 1 SIGKILLed mid-save (stopped cleanly, the last checkpoint kept);
3. resumed; rank 1 stopped (SIGSTOP) as it starts a weight push (an error within
   ``rollout.weight_push_timeout_s``, stopped cleanly);
4. resumed; the driver SIGKILLed inside a checkpoint commit (every process goes with it);
5. resumed on a two-node Ray cluster, the engine's node lost (stopped cleanly, naming the node);
6. resumed; Ctrl-C (stopped cleanly); 7. resumed to the end: every prompt trained exactly once.

"Stopped cleanly": within a bounded time, an error naming the part (rank, engine or node) and the
step; no process and nothing in /dev/shm left; the last checkpoint intact.

Then a tail-batching run whose engine core is SIGKILLed in its first short round and again in
its long round (recovered inside each round, every prompt trained once).

Then one engine actor chain under a ``RestartingEngine`` (``rollout.cpu_executor=mp``: an engine
core and a worker process, which map ``psm_*`` segments; three engine starts):

* the engine core killed mid-round (recovered: finished responses kept, the unfinished ones run
  again at the same policy version, each answered once; the dead engine's processes and psm
  segments gone);
* killed between rounds, found by the weight sync (recovered with the new weights);
* a death beyond ``rollout.max_engine_restarts`` (stopped cleanly, the error names the budget).

And the reward pool: a worker killed with a queue of work (recovered: every verdict equals an
in-process pool's), and a burst of code responses, a quarter of them sandbox attacks.

Each test records its figures (``tests/helpers/fault_figures``): ``FAULT_FIGURES=docs/fault_figures.json``
regenerates docs/faults.md's table.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from typing import Iterator

import pytest

from megatron_rl.config import RolloutConfig, RunConfig
from megatron_rl.rollout.engine import GenerationRequest
from megatron_rl.rollout.engine_restart import EngineRestartsExhausted, RestartingEngine
from megatron_rl.rollout.ray_engine import create_engine_client
from tests.helpers.engine_io import run as run_with_timeout
from tests.helpers.fault_figures import record
from tests.helpers.fault_runs import RAY_AGENTS, Attempt, Chain, cluster_job_processes, kill_node, two_node_cluster
from tests.helpers.processes import describe, left_behind
from tests.helpers.train_runs import P0, overrides, read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.loop, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [10, 20, 30, 40, 50]
VERSION = 3
"""The policy version both the first engine and its replacements serve (reload of the same
weights, tagged): completions must carry it whichever engine produced them."""
HERE = "tests/integration/test_faults.py"


def run(loop, coro, timeout: float = 400.0):
    return run_with_timeout(loop, coro, timeout)


class Supervised:
    """A RestartingEngine over real Ray engine actors, with what the tests inspect."""

    def __init__(self, model_dir: str, max_restarts: int) -> None:
        # mp: the engine core hands its work to a worker process through psm_* segments, which a
        # SIGKILLed core cannot unlink (the removal is what the tests check).
        cfg = RunConfig(rollout=RolloutConfig(max_num_seqs=8, cpu_kv_cache_gib=0.125, num_engines=1,
                                              max_model_len=256, cpu_executor="mp"))
        self.model_dir = model_dir
        self.starts = 0

        def start_one():
            self.starts += 1
            client = create_engine_client(cfg, model_dir, {"num_cpus": 0.5})
            client.poll_wait_s = 0.2
            return client

        async def start():
            return await asyncio.to_thread(start_one)

        async def restore(engine):  # what the loop's push does: current weights, current version
            return await engine.reload_weights(model_dir, VERSION)

        self.engine = RestartingEngine(start_one(), start, max_restarts=max_restarts, health_check_s=1.0)
        self.engine.restore_weights = restore

    async def processes(self) -> tuple[list[int], list[int], list[str]]:
        """(actor pid + engine pids, the engine-core pids, psm segments) of the current engine."""
        client = self.engine.engine
        ids = await client.process_ids()
        core = [p for p in ids["engine"] if "EngineCore" in describe(p)]
        segments = await client.actor.shm_segments.remote()
        return [ids["actor"], *ids["engine"]], core, segments


def _kill_core(core: list[int]) -> float:
    assert core, "no engine-core process found under the engine actor"
    for pid in core:
        os.kill(pid, signal.SIGKILL)
    return time.monotonic()


# ---------------------------------------------------------------------- the whole loop, chained
# One run directory, seven attempts: each of the first six ends by a fault the loop cannot
# replace (or Ctrl-C) and the next resumes from the last checkpoint; the recoverable engine
# deaths happen inside the first. The last attempt runs to the end and checks the accounting
# over all of them. Each fault is checked where it happens: bounded time to an error naming the
# part and the step, nothing left running, nothing left in /dev/shm, the last checkpoint intact.
STEPS = 5
PUSH_TIMEOUT_S = 5.0
"""rollout.weight_push_timeout_s of the stalled-push attempt."""


@pytest.fixture(scope="module")
def chain(tiny_model_dir, tmp_path_factory) -> Iterator[Chain]:
    chain = Chain(tiny_model_dir, tmp_path_factory.mktemp("chain"), STEPS,
                  ["trainer.save_every=1", "trainer.keep_checkpoints=10", "data.eval_every=2", "data.eval_num_prompts=4"])
    yield chain
    chain.end_quiet()


def _stopped_cleanly(attempt: Attempt, rc: int, expect: list[str]) -> tuple[float, int]:
    """The attempt ended with an error naming ``expect`` (regexes: the part and the step), and left
    no process, no psm segment and no /dev/shm directory behind. Returns (the time the loop
    noticed the failure, how many processes were checked)."""
    assert rc == 1, f"{attempt.name}: exit {rc}, expected the error exit 1:\n{attempt.tail()}"
    text = attempt.text()
    assert "\nrun stopped: " in text, f"{attempt.name}: no 'run stopped:' line:\n{attempt.tail()}"
    stopped = text[text.rindex("\nrun stopped: "):]
    for pattern in expect:
        assert re.search(pattern, stopped), f"{attempt.name}: {pattern!r} not in: {stopped}"
    alive, segments = attempt.left_behind()
    assert not alive, f"{attempt.name}: left running: {alive}"
    assert not segments, f"{attempt.name}: psm segments left in /dev/shm: {segments}"
    assert not attempt.shm_dirs_left(), f"{attempt.name}: left in /dev/shm: {attempt.shm_dirs_left()}"
    return attempt.log_times(r"tearing the run down")[-1], len(attempt.seen)


def test_engine_deaths_mid_push_and_mid_validation_recover_then_a_rank_killed_mid_backward_stops(chain) -> None:
    """Attempt 1 (fresh): the engine core is SIGKILLed while it receives the tensor push of policy
    version 1 and again while it holds validation requests at version 2 (both recovered inside
    the step); then trainer rank 1 is SIGKILLed in the backward of step 2 (stopped cleanly)."""
    run = chain.attempt("1-backward", None, "point=weight_push.receive,step=1,action=kill; "
                        "point=engine.submit,step=2,action=kill; point=train.backward,step=2,rank=1,action=kill")
    try:
        rc, exited_at = run.wait_exit(600)
        noticed_at, checked = _stopped_cleanly(run, rc, [r"step 2 \(train\)", r"rank 1 \(pid \d+ on node", "died"])
    finally:
        run.kill()
    push, val, backward = (run.fault(p) for p in ("weight_push.receive", "engine.submit", "train.backward"))
    died, replaced = run.log_times("rollout engine died"), run.log_times("rollout engine replaced")
    assert len(died) == len(replaced) == 2, run.tail()
    resubmitted = [int(n) for n in re.findall(r"(\d+) request\(s\) resubmitted", run.text())]
    assert resubmitted[1] >= 1, "the validation requests were not in flight when the engine died"
    rows = chain.metrics()
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["fault/engine_restarts"] == 1.0 and rows[0]["weight_sync/engine_replaced"] == 1.0
    assert rows[1]["val/num_prompts"] == 4 and rows[1]["val/policy_version"] == 2  # validation completed
    chain.assert_last_checkpoint(2)
    chain.passed.append("1-backward")
    test = f"{HERE}::test_engine_deaths_mid_push_and_mid_validation_recover_then_a_rank_killed_mid_backward_stops"
    record("vLLM engine core SIGKILLed during a tensor weight push (inside a training run)",
           "recovered: the replacement got the pushed version, the step went on", died[0] - push["time"],
           replaced[0] - push["time"], test, "recover = fault until the replacement held the weights")
    record("vLLM engine core SIGKILLed during validation", "recovered: the validation requests resubmitted, "
           "validation completed", died[1] - val["time"], replaced[1] - val["time"], test,
           f"{resubmitted[1]} request(s) resubmitted")
    record("trainer rank SIGKILLed mid-backward", "stopped cleanly: error names rank 1 and step 2; resume trains "
           "every prompt once", noticed_at - backward["time"], exited_at - backward["time"], test,
           f"stop = fault until the driver exited; {checked} processes checked")


def test_a_rank_killed_mid_save_stops_and_keeps_the_last_checkpoint(chain) -> None:
    """Attempt 2: resumes at step 2; trainer rank 1 is SIGKILLed inside the save of checkpoint 3."""
    run = chain.attempt("2-save", "1-backward", "point=checkpoint.save,step=3,rank=1,action=kill")
    try:
        rc, exited_at = run.wait_exit(600)
        noticed_at, checked = _stopped_cleanly(run, rc, [r"step 2 \(checkpoint\)", r"rank 1 \(pid \d+ on node"])
    finally:
        run.kill()
    fault = run.fault("checkpoint.save")
    assert "resumed from" in run.text()
    chain.assert_last_checkpoint(2)  # the torn step_000003.tmp-* is never listed; the next start removes it
    chain.passed.append("2-save")
    record("trainer rank SIGKILLed mid-save", "stopped cleanly: error names rank 1 and step 2; checkpoint 2 kept",
           noticed_at - fault["time"], exited_at - fault["time"],
           f"{HERE}::test_a_rank_killed_mid_save_stops_and_keeps_the_last_checkpoint",
           f"{checked} processes checked")


def test_a_rank_stalled_in_a_weight_push_is_an_error_within_the_push_timeout(chain) -> None:
    """Attempt 3: trainer rank 1 is stopped (SIGSTOP) as it starts sending policy version 3."""
    run = chain.attempt("3-push-stall", "2-save", "point=weight_push.send,step=3,rank=1,action=stop",
                        (f"rollout.weight_push_timeout_s={PUSH_TIMEOUT_S}",))
    try:
        rc, exited_at = run.wait_exit(600)
        noticed_at, checked = _stopped_cleanly(run, rc, [r"step 2 \(weight_sync\)", "trainer rank 1",
                                                         "policy version 3"])
    finally:
        run.kill()
    fault = run.fault("weight_push.send")
    assert not list(chain.run_dir.joinpath("checkpoints").glob("*.tmp-*")), "the torn save of attempt 2 is left"
    chain.assert_last_checkpoint(2)
    assert noticed_at - fault["time"] < PUSH_TIMEOUT_S + 30, "the stalled push was not bounded by its timeout"
    chain.passed.append("3-push-stall")
    record("trainer rank stalled (SIGSTOP) during a weight push", "stopped cleanly: error names the engine, rank 1 "
           "and policy version 3 after rollout.weight_push_timeout_s", noticed_at - fault["time"],
           exited_at - fault["time"], f"{HERE}::test_a_rank_stalled_in_a_weight_push_is_an_error_within_the_push_timeout",
           f"weight_push_timeout_s={PUSH_TIMEOUT_S:.0f}; {checked} processes checked (the stopped rank included)")


def test_the_driver_killed_in_a_checkpoint_commit_leaves_the_last_checkpoint(chain) -> None:
    """Attempt 4: the driver is SIGKILLed inside the commit of checkpoint 3 (its manifest is
    written, the rename is not): every process of the run goes with it."""
    # Quiet from here until attempt 5 has swept what this driver leaves in /dev/shm (attempt 5
    # checks that its own start-up did; another worker's job would sweep it too).
    chain.quiet()
    run = chain.attempt("4-commit", "3-push-stall", "point=checkpoint.commit,step=3,action=kill")
    try:
        rc, _ = run.wait_exit(600)
        fault = run.fault("checkpoint.commit")
        alive, segments = run.left_behind(wait_s=30, ignore=RAY_AGENTS)
        gone_at = time.time()
    finally:
        if run.proc.poll() is None:
            run.kill()
    assert rc == -signal.SIGKILL
    # Ray's two agents follow their raylet ~60 s later (their last report goes to the dead GCS
    # with a 60 s timeout): the next attempt checks that they did, instead of waiting here.
    agents = {p: name for p, name in alive.items() if name.startswith(RAY_AGENTS)}
    assert alive == agents, f"left running after the driver died: {alive}"
    chain.lingering.update(agents)
    assert not segments
    torn = list(chain.run_dir.joinpath("checkpoints").glob("step_000003.tmp-*"))
    assert len(torn) == 1 and (torn[0] / "manifest.json").is_file()  # killed between the manifest and the rename
    chain.assert_last_checkpoint(2)
    chain.passed.append("4-commit")
    record("driver SIGKILLed during a checkpoint commit", "stopped cleanly: every process of the run went with the "
           "driver, checkpoint 2 kept, the next start swept /dev/shm", None, gone_at - fault["time"],
           f"{HERE}::test_the_driver_killed_in_a_checkpoint_commit_leaves_the_last_checkpoint",
           f"stop = fault until the last of {len(run.seen)} processes was gone (upper bound: polled)")


def test_the_engines_ray_node_lost_stops_the_run_naming_it(chain) -> None:
    """Attempt 5: on a two-node Ray cluster (``cluster.placement=split``: the trainer ranks on the
    head, the engine on the other node), the engine's node is lost (all its processes SIGKILLed)
    once checkpoint 3 is written: no node is left to replace the engine on."""
    with two_node_cluster(head_cpus=3, worker_cpus=1) as (cluster, worker):
        run = chain.attempt("5-node", "4-commit", extra=(f"cluster.ray_address={cluster.address}",
                                                          "cluster.num_nodes=2", "cluster.placement=split"),
                            processes=lambda: cluster_job_processes(cluster))
        try:
            run.wait_until(chain.checkpoint_written(3), "checkpoint 3")
            run.poll()
            lost_at = kill_node(cluster, worker)
            rc, exited_at = run.wait_exit(600)
            noticed_at, checked = _stopped_cleanly(run, rc, [r"at step 3 ", r"node\(s\) lost: \w+"])
        finally:
            run.kill()
            chain.end_quiet()
    assert re.search(r"removed /dev/shm/megatron_rl-\S+ .* left by a dead run", run.text()), \
        "the start-up did not sweep what the killed driver of attempt 4 left in /dev/shm"
    alive, _ = left_behind(list(chain.lingering), wait_s=30)
    assert not alive, f"Ray's agents of attempt 4 still running: {[(p, chain.lingering[p]) for p in alive]}"
    chain.assert_last_checkpoint(3)
    chain.passed.append("5-node")
    record("Ray node holding the rollout engine lost (every process SIGKILLed)", "stopped cleanly: error names the "
           "lost node and step 3 (no node left for a replacement)", noticed_at - lost_at, exited_at - lost_at,
           f"{HERE}::test_the_engines_ray_node_lost_stops_the_run_naming_it",
           f"2 Ray nodes on one machine, cluster.placement=split; {checked} processes checked")


def test_ctrl_c_stops_cleanly_and_the_last_resume_trains_every_prompt_once(chain) -> None:
    """Attempt 6: Ctrl-C (SIGINT to the process group, as a terminal sends it) once checkpoint 4
    is written; attempt 7 resumes to the end: across the seven attempts every prompt the cursor
    handed out was trained exactly once, in the cursor's order."""
    from megatron_rl.data.cursor import PromptCursor

    run = chain.attempt("6-ctrl-c", "5-node")
    try:
        run.wait_until(chain.checkpoint_written(4), "checkpoint 4")
        run.poll()
        interrupted_at = time.time()
        os.killpg(run.proc.pid, signal.SIGINT)
        rc, exited_at = run.wait_exit(120)
    finally:
        run.kill()
    assert rc != 0, "the run ended before Ctrl-C: nothing was interrupted"
    alive, segments = run.left_behind()
    assert not alive, f"left running after Ctrl-C: {alive}"
    assert not segments and not run.shm_dirs_left()
    chain.passed.append("6-ctrl-c")
    last = chain.attempt("7-end", "6-ctrl-c")
    try:
        rc, _ = last.wait_exit(600)
    finally:
        last.kill()
    assert rc == 0, last.tail()
    trained = [pid for r in read_jsonl(chain.run_dir / "trained_prompts.jsonl") for pid in r["prompt_ids"]]
    expected = [f"arith:{i}" for i in PromptCursor(64, seed=1234, shuffle=True).take(STEPS * P0)]
    assert trained == expected, "a prompt was lost or trained twice across the faults and resumes"
    assert [r["step"] for r in chain.metrics()] == list(range(STEPS))
    record("Ctrl-C (SIGINT to the process group) mid-run", "stopped cleanly: no processes or /dev/shm left, resume "
           "trains every prompt once", None, exited_at - interrupted_at,
           f"{HERE}::test_ctrl_c_stops_cleanly_and_the_last_resume_trains_every_prompt_once",
           f"stop time = SIGINT until the driver exited; {len(run.seen)} processes checked")


# ---------------------------------------------------------------------- a long round
def test_engine_core_killed_in_a_short_and_a_long_round_is_replaced_and_each_round_completes(
        tiny_model_dir, tmp_path) -> None:
    """Tail batching (``tail_batching.eta_prompts=2``: short, long, short); the engine core is
    SIGKILLed as the first short round's first request is accepted, and again as the long
    round's is. Expected outcome: recovered inside each round (the replacement takes the current
    weights by the loop's sync, the round's requests run again at the same policy version),
    every prompt trained once, nothing left."""
    import json

    records = tmp_path / "faults"
    records.mkdir()
    args = overrides(tiny_model_dir, tmp_path / "run", 3, [
        "scheduler.name=tail_batching", "tail_batching.eta_prompts=2.0", "data.eval_every=0",
        "rollout.max_new_tokens=64", "algorithm.overlong_buffer_tokens=56"])
    # step: the engine's weight version, which is the loop step (0: the short round of step 0,
    # 1: the long round of step 1).
    run = Attempt("short-and-long-round", args, tmp_path, records,
                  "point=engine.submit,step=0,action=kill; point=engine.submit,step=1,action=kill")
    try:
        rc, _ = run.wait_exit(600)
    finally:
        run.kill()
    assert rc == 0, run.tail()
    faults = [json.loads(p.read_text()) for p in sorted(records.glob("fault*-engine.submit.json"))]
    assert [f["step"] for f in faults] == [0, 1], faults
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["round_type"] for r in rows] == ["short", "long", "short"], run.tail()
    assert [r["fault/engine_restarts"] for r in rows] == [1.0, 2.0, 2.0]
    for r in rows:  # on-policy after the replacements: the engine's logprobs are the trainer's
        assert r["policy_version"] == rows.index(r) + 1 and r["rollout/logprob_abs_diff_max"] <= 1e-4, r
    trained = [pid for rec in read_jsonl(tmp_path / "run" / "trained_prompts.jsonl") for pid in rec["prompt_ids"]]
    assert len(trained) == len(set(trained)) == 3 * P0
    died, replaced = run.log_times("rollout engine died"), run.log_times("rollout engine replaced")
    assert len(died) == len(replaced) == 2, run.tail()
    resubmitted = [int(n) for n in re.findall(r"(\d+) request\(s\) resubmitted", run.text())]
    assert len(resubmitted) == 2 and min(resubmitted) >= 1, resubmitted
    alive, segments = run.left_behind()
    assert not alive and not segments and not run.shm_dirs_left(), (alive, segments)
    test = f"{HERE}::test_engine_core_killed_in_a_short_and_a_long_round_is_replaced_and_each_round_completes"
    for i, (kind, what) in enumerate((("short", "the short round's"), ("long", "the long round's"))):
        record(f"vLLM engine core SIGKILLed in a {kind} round (tail batching, inside a training run)",
               f"recovered: {what} requests resubmitted to the replacement, the step stayed on-policy",
               died[i] - faults[i]["time"], replaced[i] - faults[i]["time"], test,
               f"{resubmitted[i]} request(s) resubmitted; {len(run.seen)} processes checked")


# ---------------------------------------------------------------------- one engine chain
@pytest.fixture(scope="module")
def supervised(ray_session, tiny_model_dir, loop):
    sup = Supervised(str(tiny_model_dir), max_restarts=2)
    run(loop, sup.engine.reload_weights(str(tiny_model_dir), VERSION))
    yield sup
    run(loop, asyncio.wait_for(sup.engine.shutdown(), 90))


def test_engine_core_killed_mid_round_is_replaced_and_the_round_completes(supervised, loop) -> None:
    """Expected outcome: recovered inside the round."""
    engine = supervised.engine
    short = [GenerationRequest(f"s{i}", PROMPT, max_tokens=2, seed=i) for i in range(2)]
    long = [GenerationRequest(f"l{i}", PROMPT, max_tokens=200, seed=10 + i) for i in range(6)]

    async def scenario():
        pids, core, segments = await supervised.processes()
        await asyncio.gather(*(engine.submit(r) for r in short + long))
        stream = engine.completions()
        got = {}
        while len(got) < 2:  # the two short ones finish first
            c = await stream.__anext__()
            got[c.request_id] = c
        killed_at = _kill_core(core)
        before_kill = dict(got)
        while len(got) < len(short) + len(long):
            c = await stream.__anext__()
            assert c.request_id not in got, f"{c.request_id} answered twice"
            got[c.request_id] = c
        return pids, segments, killed_at, before_kill, got

    pids, segments, killed_at, before_kill, got = run(loop, scenario())
    assert sorted(got) == sorted(r.request_id for r in short + long)
    assert all(c.weight_version == VERSION for c in got.values()), "a sample is off-policy"
    assert all(c.finish_reason in ("stop", "length") for c in got.values())
    assert all(got[rid] is c for rid, c in before_kill.items())  # finished work is kept as it was
    assert len(engine.restarts) == 1
    restart = engine.restarts[0]
    detect_s = restart.detected_at - killed_at
    assert 0 <= detect_s < 5.0, f"death noticed after {detect_s:.1f} s"
    assert 1 <= restart.resubmitted <= len(long)  # a long one may have ended before the kill landed
    metrics = engine.step_metrics()
    assert metrics["fault/engine_restarts"] == 1.0 and metrics["fault/seconds_lost"] == pytest.approx(restart.restart_s)
    assert segments, "the mp engine's processes mapped no psm segment: the removal was not exercised"
    assert len(pids) >= 3, f"expected the actor, the engine core and its worker: {[(p, describe(p)) for p in pids]}"
    alive, left = left_behind(pids, segments)
    assert not alive, f"processes of the dead engine still running: {[(p, describe(p)) for p in alive]}"
    assert not left, f"shared memory of the dead engine left in /dev/shm: {left}"
    record("vLLM engine core SIGKILLed mid-round (rollout.cpu_executor=mp)",
           "recovered: replaced in the round, unfinished requests resubmitted, its psm segments removed",
           detect_s, restart.restart_s, f"{HERE}::test_engine_core_killed_mid_round_is_replaced_and_the_round_completes",
           f"{restart.resubmitted} of {len(got)} requests resubmitted; {len(segments)} psm segment(s) removed")


def test_engine_core_dead_at_the_weight_sync_is_replaced_with_the_new_weights(supervised, loop) -> None:
    """Killed between rounds; the step's weight sync (here a reload of the weight directory, as
    the 'hf' / 'sharded' formats do) fails on the dead engine, and the loop's recovery
    (``Trainer._push_weights``: ``recover_if_dead``) replaces it: the replacement starts with the
    weights that sync was loading. Expected outcome: recovered."""
    engine = supervised.engine

    async def scenario():
        pids, core, segments = await supervised.processes()
        killed_at = _kill_core(core)
        await asyncio.sleep(0.5)  # the kill lands while nothing is in flight
        with pytest.raises(Exception) as failed:
            await engine.reload_weights(supervised.model_dir, VERSION)
        assert await engine.recover_if_dead(failed.value)
        await engine.submit(GenerationRequest("after", PROMPT, max_tokens=8, seed=1))
        stream = engine.completions()
        return pids, segments, killed_at, await stream.__anext__()

    pids, segments, killed_at, completion = run(loop, scenario())
    assert completion.request_id == "after" and completion.weight_version == VERSION
    assert len(engine.restarts) == 2
    restart = engine.restarts[1]
    assert restart.resubmitted == 0
    alive, left = left_behind(pids, segments)
    assert not alive and not left
    record("vLLM engine core SIGKILLed between rounds, found by the weight sync",
           "recovered: the replacement takes the weights the failed sync was loading", restart.detected_at - killed_at,
           restart.restart_s, f"{HERE}::test_engine_core_dead_at_the_weight_sync_is_replaced_with_the_new_weights",
           "detection time includes the test's 0.5 s wait before the sync")


def test_a_death_beyond_max_restarts_stops_with_a_clear_error(supervised, loop) -> None:
    """Expected outcome: stopped cleanly (budget rollout.max_engine_restarts=2 spent)."""
    engine = supervised.engine

    async def scenario():
        pids, core, segments = await supervised.processes()
        await engine.submit(GenerationRequest("doomed", PROMPT, max_tokens=200, seed=2))
        killed_at = _kill_core(core)
        stream = engine.completions()
        with pytest.raises(EngineRestartsExhausted, match="max_engine_restarts=2") as info:
            await stream.__anext__()
        stopped_at = time.monotonic()
        await asyncio.wait_for(engine.shutdown(), 60)
        return pids, segments, killed_at, stopped_at, str(info.value)

    pids, segments, killed_at, stopped_at, message = run(loop, scenario())
    assert "after 2 restart(s)" in message
    assert supervised.starts == 3  # no fourth engine was started
    alive, left = left_behind(pids, segments)
    assert not alive, f"processes left after the stop: {[(p, describe(p)) for p in alive]}"
    assert not left
    record("vLLM engine core SIGKILLed after rollout.max_engine_restarts", "stopped cleanly: error names the budget",
           stopped_at - killed_at, None, f"{HERE}::test_a_death_beyond_max_restarts_stops_with_a_clear_error",
           "no processes or psm segments left after shutdown")


def run_processes_of(pid: int) -> list[int]:
    """The descendants of ``pid`` (a reward worker's grading process)."""
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _math_samples(tokenizer, n: int) -> list:
    from megatron_rl.sample import Prompt, Sample

    samples = []
    for i in range(n):
        answer = str(i % 17)
        text = f"\\boxed{{{i % 17 if i % 3 else i % 5}}}" if i % 7 else "no answer here"
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        samples.append(Sample(prompt=Prompt(prompt_id=f"p{i}", token_ids=[1], answer=answer),
                              response_index=0, response_ids=ids, finish_reason="stop"))
    return samples


def test_reward_worker_killed_under_load_keeps_every_verdict(ray_session, tokenizer_dir, caplog) -> None:
    """Expected outcome: recovered: the dead worker's queued and running tasks run again."""
    import copy
    import logging

    import ray
    from transformers import AutoTokenizer

    from megatron_rl.config import AlgorithmConfig, RewardConfig
    from megatron_rl.reward.pool.reward_pool import RewardPool

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = RewardConfig(num_workers=2, worker_num_cpus=0.25, timeout_s=5.0)
    samples = _math_samples(tok, 400)
    reference = [copy.deepcopy(s) for s in samples]
    local = RewardPool(cfg, str(tokenizer_dir), max_new_tokens=256, algorithm_cfg=AlgorithmConfig(), use_ray=False)
    try:
        local.wait([local.submit(s) for s in reference], timeout_s=300)
    finally:
        local.shutdown()
    pool = RewardPool(cfg, str(tokenizer_dir), max_new_tokens=256, algorithm_cfg=AlgorithmConfig())
    caplog.set_level(logging.WARNING, logger="megatron_rl.reward.pool.dispatch")
    try:
        pool.ready(timeout_s=120)
        victim = pool._workers.actors[0]
        pid = ray.get(victim.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        handles = [pool.submit(s) for s in samples]
        done, pending = pool.poll(handles, timeout_s=0.0)
        deadline = time.monotonic() + 60
        while len(done) < 20 and time.monotonic() < deadline:  # the worker is busy with its queue
            more, pending = pool.poll(pending, timeout_s=0.2)
            done += more
        assert pending, "the batch finished before the kill: make it larger"
        victim_tree = [pid, *run_processes_of(pid)]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        pool.wait(handles, timeout_s=300)
        finished_at = time.time()
        assert [s.reward for s in samples] == [s.reward for s in reference], "a verdict changed or was lost"
        assert [s.correct for s in samples] == [s.correct for s in reference]
        lost = [r for r in caplog.records if "resubmitted to worker" in r.getMessage()]
        assert lost, "the kill lost no task: nothing was tested"
        detect_s = min(r.created for r in lost) - killed_at
        assert pool.status_counts.get("error", 0) == 0
        alive, _ = left_behind(victim_tree)
        assert not alive, f"the killed worker's processes outlived it: {[(p, describe(p)) for p in alive]}"
    finally:
        pool.shutdown()
    record("reward worker SIGKILLed with a queue of work", "recovered: its tasks resubmitted, every verdict kept",
           detect_s, finished_at - killed_at, f"{HERE}::test_reward_worker_killed_under_load_keeps_every_verdict",
           f"{len(lost)} of {len(samples)} tasks resubmitted; recovery = until the whole batch was scored")


def test_reward_workers_dying_past_their_restarts_stop_scoring_with_a_clear_error(ray_session, tokenizer_dir) -> None:
    """Expected outcome: stopped cleanly. The pool's only worker is SIGKILLed, Ray restarts it
    once, and it is SIGKILLed again: the queued responses are lost past their resubmissions, and
    ``wait`` raises ``RewardPoolExhausted`` naming the response and the worker instead of scoring
    failure rewards that a run would train on."""
    import ray
    from transformers import AutoTokenizer

    from megatron_rl.config import AlgorithmConfig, RewardConfig
    from megatron_rl.reward.pool.dispatch import RewardPoolExhausted
    from megatron_rl.reward.pool.reward_pool import RewardPool

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    pool = RewardPool(RewardConfig(num_workers=1, worker_num_cpus=0.25, timeout_s=5.0), str(tokenizer_dir),
                      max_new_tokens=256, algorithm_cfg=AlgorithmConfig())
    try:
        pool.ready(timeout_s=120)
        worker = pool._workers.actors[0]

        def worker_pid(other_than: int = 0) -> int:
            """The worker's pid once it answers (after a kill: once Ray has restarted it)."""
            deadline = time.monotonic() + 120
            while True:
                try:
                    pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()), timeout=120)
                    if pid != other_than:
                        return pid
                except ray.exceptions.RayError:  # unavailable while Ray notices the death and restarts it
                    assert time.monotonic() < deadline, "the reward worker was not restarted within 120 s"
                time.sleep(0.2)

        first = worker_pid()
        handles = [pool.submit(s) for s in _math_samples(tok, 200)]
        os.kill(first, signal.SIGKILL)
        killed_at = time.time()
        second = worker_pid(other_than=first)  # Ray's one restart of it
        os.kill(second, signal.SIGKILL)
        with pytest.raises(RewardPoolExhausted, match=r"reward pool is exhausted: the reward of \S+#\d+ .* lost "
                           r"with its worker \d+ times .*1 worker\(s\) in the pool") as info:
            pool.wait(handles, timeout_s=300)
        stopped_at = time.time()
        assert pool.status_counts.get("error", 0) == 0, "failure rewards were scored before the stop"
        alive, _ = left_behind([first, second])
        assert not alive
    finally:
        pool.shutdown()
    record("reward worker SIGKILLed again after Ray's one restart (pool exhausted)", "stopped cleanly: "
           "RewardPoolExhausted names the response and the worker; no failure rewards scored", None,
           stopped_at - killed_at,
           f"{HERE}::test_reward_workers_dying_past_their_restarts_stop_scoring_with_a_clear_error",
           "stop = first kill until wait raised (Ray's restart and the second kill included)")
    assert "worker #0" in str(info.value)


def test_reward_pool_burst_beyond_its_workers_keeps_every_verdict(ray_session, tokenizer_dir) -> None:
    """The in-suite size of ``python -m megatron_rl.tools.reward_burst`` (5,000 responses there):
    every verdict arrives and is the expected one, attacks included; memory stays bounded."""
    from transformers import AutoTokenizer

    from megatron_rl.config import AlgorithmConfig, RewardConfig
    from megatron_rl.reward.pool.reward_pool import RewardPool
    from megatron_rl.tools.reward_burst import build_burst, run_burst
    from tests.helpers.fault_figures import record_burst

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    burst = build_burst(tok, 160, 0.25)
    cfg = RewardConfig(kind="code", num_workers=2, worker_num_cpus=0.25, code_timeout_min_s=2.0,
                       code_timeout_max_s=2.0)
    pool = RewardPool(cfg, str(tokenizer_dir), max_new_tokens=1 << 16, algorithm_cfg=AlgorithmConfig())
    try:
        pool.ready(timeout_s=120)
        figures = run_burst(pool, burst)
    finally:
        pool.shutdown()
    assert figures["missing"] == 0 and figures["num_wrong"] == 0, figures["wrong"]
    assert figures["errors"] == 0
    assert figures["queue_wait_max_s"] > 0  # it was a burst: responses queued behind the workers
    assert figures["driver_rss_growth_kb_per_response"] < 500, figures
    record_burst("in-suite", figures, "tests/integration/test_faults.py (160 responses)")
