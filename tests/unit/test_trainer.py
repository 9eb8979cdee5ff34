"""The loop itself, in seconds: ``Trainer`` with a fake engine, a fake policy and the in-process
reward pool (real math-verify grading of the fake engine's answers).

What is checked here: the on-policy assertion, the order in which plug-ins are called and which
one may take a step over, the device-memory order around every phase (engine sleep, trainer
offload/reload, weight sync, checkpoint), checkpoint + resume of plug-in state, and SIGTERM at a
step boundary. The same loop
on the real Megatron/vLLM/Ray stack runs in tests/integration/test_train_loop.py and
test_rollpacker_loop.py.
"""
from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from megatron_rl.checkpoint.store import CheckpointManager
from megatron_rl.config.plugins import make_scheduler
from megatron_rl.config.schema import RunConfig
from megatron_rl.data.datasets import apply_chat_template
from megatron_rl.loop.hooks import LoopServices, RolloutBatch, TrainerPlugin, TrainResult
from megatron_rl.loop.trainer import Trainer, TrainerParts
from megatron_rl.rollout.engine import Completion, GenerationRequest
from megatron_rl.runtime.graceful_stop import GracefulStop
from megatron_rl.sample import Prompt, Sample
from tests.helpers.fake_engine import FakeEngine

P0, R0 = 4, 2




class AnsweringEngine(FakeEngine):
    """FakeEngine whose responses spell '#### 7' (even seeds: right) or '#### 8' (odd: wrong),
    padded with spaces to the length the length function picks, then EOS; records memory moves."""

    def __init__(self, tokenizer, events: list, length_fn=lambda r: 12) -> None:
        super().__init__(length_fn=length_fn, capacity=256)
        self.tok, self.events = tokenizer, events

    def _emit(self, req: GenerationRequest, n: int, reason: str, t0: float) -> None:
        import time

        text = "#### 7" if req.seed % 2 == 0 else "#### 8"
        ids = self.tok.encode(" " * max(0, n - 7) + text, add_special_tokens=False) + [self.tok.eos_token_id]
        ids = ids[-n:] if reason != "abort" else ids[:n]
        self.queue.put_nowait(Completion(req.request_id, ids, [-0.5] * len(ids), reason, self.version, t0,
                                         time.monotonic()))

    async def sleep(self, level: int = 1) -> None:
        self.events.append("engine.sleep" if level == 1 else f"engine.sleep(level {level})")
        await super().sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.events.append("engine.wake_up" if tags is None else f"engine.wake_up({','.join(tags)})")
        await super().wake_up(tags)

    async def reload_weights(self, weights_dir: str, version: int) -> None:
        self.events.append(f"engine.reload(v{version})")
        await super().reload_weights(weights_dir, version)

    async def receive_weights(self, sync_id: int, version: int) -> list[dict]:
        self.events.append(f"engine.receive(v{version})")
        return await super().receive_weights(sync_id, version)


class FakePolicy:
    """The Policy contract without Megatron: logprobs equal the engine's (-0.5 per token), train
    steps recorded, the 'weights' are the number of optimizer steps, checkpoints are JSON."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.steps = 0
        self.trained: list[list[str]] = []
        self.advantages: list[float] = []
        self.accumulated: list[str] = []

    async def compute_logprobs(self, samples, which="policy"):
        self.events.append(f"policy.logprobs({which})")
        return [[-0.5] * len(s.response_ids) for s in samples]

    async def train_step(self, samples):
        self.events.append("policy.train_step")
        self.steps += 1
        self.trained.append([s.request_id for s in samples])
        self.advantages.extend(s.advantage for s in samples)
        metrics = {"loss": 0.5, "num_tokens": float(sum(len(s.response_ids) for s in samples))}
        if not any(s.old_logprobs for s in samples):
            # No scoring pass ran (one optimizer step: the default): like the real worker, the
            # training forward's own logprobs (-0.5 here) are held against the engine's.
            diffs = [abs(-0.5 - e) for s in samples for e in s.engine_logprobs]
            metrics.update(logprob_abs_diff_sum=sum(diffs), logprob_abs_diff_max=max(diffs, default=0.0))
        return metrics

    async def accumulate_gradients(self, samples):
        self.events.append("policy.accumulate")
        self.accumulated.extend(s.request_id for s in samples)
        return {}

    async def apply_accumulated_gradients(self, num_tokens_total, num_seqs_total):
        self.events.append("policy.apply")
        self.steps += 1
        self.trained.append(list(self.accumulated))
        self.accumulated = []
        return {"loss": 0.25}

    async def free_grad_buffers(self):
        self.events.append("trainer.free_grads")
        return {}

    async def offload_for_rollout(self):
        self.events.append("trainer.offload")
        return {}

    async def reload_for_training(self):
        self.events.append("trainer.reload")
        return {}

    async def set_num_threads(self, n):
        self.events.append(f"trainer.threads({n})")

    async def write_hf_weights(self, directory):
        self.events.append("policy.write_hf")

    async def write_rollout_shards(self, rollout_tp, directory, version, dtype):
        self.events.append(f"policy.write_shards(tp{rollout_tp},v{version})")
        return {"bytes_sent": 1e6, "bytes_received": 1e6, "bytes_local": 0.0, "seconds": 0.01, "rounds": 1.0}

    # The tensor weight push (the default sync): nothing moves, the calls are recorded.
    async def rank_nodes(self):
        return [("fake-node", "127.0.0.1")]

    async def open_weight_push(self, spec):
        self.events.append(f"policy.open_push(tp{spec['rollout_tp']})")
        return [{"path": "", "ipc_handle": "", "port": 0, "fingerprint": "plan"}]

    async def join_weight_push(self, key, port):
        raise AssertionError("one node: no push group")

    async def push_weights(self, key, sync_id, version):
        self.events.append(f"policy.push(v{version})")
        return {"bytes": 1e6, "net_bytes": 0.0, "pack_s": 0.001, "wait_s": 0.0, "net_s": 0.0, "seconds": 0.01}

    async def close_weight_push(self, key):
        self.events.append("policy.close_push")

    async def save_checkpoint(self, directory):
        self.events.append("policy.save")
        Path(directory, "policy.json").write_text(json.dumps({"steps": self.steps}))

    async def load_checkpoint(self, directory):
        self.events.append("policy.load")
        self.steps = json.loads(Path(directory, "policy.json").read_text())["steps"]


class RecordingPlugin(TrainerPlugin):
    """Records every call it gets, in order; its state counts the steps it saw end."""

    name = "recorder"

    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.seen = 0
        self.loaded: dict | None = None

    def attach(self, loop: LoopServices) -> None:
        self.calls.append("attach")
        self.loop = loop

    async def before_rollout(self, step, round_type):
        self.calls.append(f"before_rollout({step},{round_type})")
        return {"recorder/before": 1.0}

    def on_round_start(self, step, round_type, num_groups):
        self.calls.append(f"round_start({step},{round_type},{num_groups})")

    def on_group_complete(self, step, group):
        self.calls.append(f"group({step})")

    async def after_rollout(self, step, batch):
        self.calls.append(f"after_rollout({step},{len(batch.groups)})")
        return {"recorder/groups": float(len(batch.groups))}

    def on_batch_ready(self, step, batch):
        self.calls.append(f"batch_ready({step})")

    def on_step_end(self, step, metrics):
        self.calls.append(f"step_end({step})")
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.loaded = dict(state)
        self.seen = state.get("seen", 0)


class TakeOver(TrainerPlugin):
    """Trains the steps in ``steps`` itself through the loop's services."""

    name = "takeover"

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def attach(self, loop):
        self.loop = loop

    def takes_over_training(self, step):
        return step in self.steps

    async def train(self, step, batch: RolloutBatch, samples):
        trained = await self.loop.train_groups(batch.groups)
        assert [s.request_id for s in trained] == [s.request_id for s in samples]
        return TrainResult(await self.loop.apply_gradients(trained), {"takeover/step": float(step)}, trained)


def make_parts(tmp_path, tokenizer, tokenizer_dir, events, *, plugins=(), steps=3, stop=None,
               overrides=(), scheduler="baseline", length_fn=lambda r: 12) -> TrainerParts:
    from megatron_rl.config.loading import apply_override
    from megatron_rl.reward.pool.reward_pool import RewardPool

    cfg = RunConfig()
    for assignment in [f"model.hf_path={tokenizer_dir}", f"trainer.run_dir={tmp_path / 'run'}",
                       f"trainer.steps={steps}", f"data.prompts_per_step={P0}", f"data.responses_per_prompt={R0}",
                       "trainer.tensorboard=false", "trainer.progress_bar=false", "reward.num_workers=1",
                       "rollout.max_new_tokens=32", f"scheduler.name={scheduler}", *overrides]:
        apply_override(cfg, assignment)
    prompts = [Prompt(prompt_id=f"q:{i}", token_ids=apply_chat_template(tokenizer, f"What is {i} - {i} + 7?"),
                      answer="7", text=f"What is {i} - {i} + 7?", metadata={"format": "gsm8k"}) for i in range(64)]
    rewards = RewardPool.from_run_config(cfg, use_ray=False)
    engine = AnsweringEngine(tokenizer, events, length_fn)
    return TrainerParts(cfg=cfg, policy=FakePolicy(events), engine=engine, rewards=rewards, train_prompts=prompts,
                        eval_prompts=[], scheduler=make_scheduler(cfg), plugins=list(plugins),
                        weight_sync_dir=str(tmp_path / "weights"), stop=stop, on_cpu=True)


def run(parts: TrainerParts) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(parts)
    try:
        return trainer, asyncio.run(asyncio.wait_for(trainer.run(), timeout=120))
    finally:
        parts.rewards.shutdown()


def test_steps_are_on_policy_and_plugins_are_called_in_order(tmp_path, tokenizer, tokenizer_dir):
    events, calls = [], []
    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, events, plugins=[RecordingPlugin(calls)], steps=2)
    trainer, history = run(parts)
    assert [m["policy_version"] for m in history] == [1, 2] and trainer.version == 2
    assert parts.engine.version == 2  # every step's weights reached the engine
    groups = ["group(0)"] * P0
    assert calls == (["attach", "before_rollout(0,baseline)", f"round_start(0,baseline,{P0})", *groups,
                      f"after_rollout(0,{P0})", "batch_ready(0)", "step_end(0)",
                      "before_rollout(1,baseline)", f"round_start(1,baseline,{P0})", *["group(1)"] * P0,
                      f"after_rollout(1,{P0})", "batch_ready(1)", "step_end(1)"])
    for m in history:
        assert m["recorder/before"] == 1.0 and m["recorder/groups"] == float(P0)
        assert m["reward/accuracy"] == pytest.approx(0.5)  # the grader really graded '#### 7' / '#### 8'
        assert m["rollout/logprob_abs_diff_max"] == 0.0
        assert m["weight_sync/push_mb"] == pytest.approx(1.0)  # the default sync: a tensor push
    # Advantages reached the policy: (r - mean) / std of each group of one right, one wrong (GRPO).
    assert sorted(set(round(a, 4) for a in parts.policy.advantages)) == [-0.7071, 0.7071]
    # Without offload/sleep options nothing moves but the weights.
    assert events.count("trainer.offload") == 0 and "engine.sleep" not in events
    # One optimizer step per batch (the default): no scoring pass; the parity above came from the
    # training forward (algorithm.recompute_old_logprobs unset).
    assert "policy.logprobs(policy)" not in events and all("time/logprob" not in m or m["time/logprob"] < 0.01
                                                           for m in history)
    # phases.jsonl: every step's phases in order on the monotonic clock (the profiler's time line),
    # the last step's checkpoint included; time/* of the step agree with them.
    records = [json.loads(line) for line in (tmp_path / "run/phases.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert [n for n, _, _ in records[0]["phases"]] == ["rollout", "logprob", "train", "weight_sync"]
    assert [n for n, _, _ in records[1]["phases"]][-1] == "checkpoint"
    ends = [t for r in records for _, s, e in r["phases"] for t in (s, e)]
    assert ends == sorted(ends)
    for rec, m in zip(records, history):
        rollout = next(e - s for n, s, e in rec["phases"] if n == "rollout")
        assert m["time/rollout"] + m["time/reward"] == pytest.approx(rollout, abs=1e-6)


def test_stale_samples_are_refused(tmp_path, tokenizer, tokenizer_dir):
    """A weight sync that never reaches the engine leaves it on version 0: step 1's samples carry
    version 0 while the policy is at 1, and the loop refuses to train off-policy."""
    events = []
    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, events, steps=2)

    async def lost_push(sync_id, version):
        return [{"bytes": 1e6, "seconds": 0.0, "load_s": 0.0}]  # "succeeds", loads nothing

    parts.engine.receive_weights = lost_push
    with pytest.raises(RuntimeError, match="generated by weight version 0 but the policy is at version 1"):
        run(parts)
    # The loop checks again before training, whatever a scheduler hands it.
    trainer = Trainer(make_parts(tmp_path / "b", tokenizer, tokenizer_dir, []))
    trainer.version = 3
    stale = [Sample(prompt=trainer.p.train_prompts[0], response_index=0, request_id="old", policy_version=2)]
    with pytest.raises(RuntimeError, match=r"not generated by the current policy version 3 \(e.g. \['old'\]\)"):
        trainer._check_on_policy(stale)
    trainer.p.rewards.shutdown()


def test_memory_moves_in_order_around_every_phase(tmp_path, tokenizer, tokenizer_dir):
    events = []
    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, events, steps=2,
                       overrides=["trainer.offload_during_rollout=true", "rollout.sleep_during_train=true",
                                  "trainer.save_every=1", "algorithm.recompute_old_logprobs=true",
                                  "rollout.sleep_level=2"])
    run(parts)
    # The tensor push reads trainer memory: its grad buffers are freed, only the engines' weights
    # wake (they slept at level 2: dropped, the push rewrites them), the push runs, the trainer
    # leaves, and only then the KV cache wakes (the file syncs write first, offload, wake the
    # weights, reload: the test below).
    # The checkpoint save's sleep is level 1: no push follows it.
    step = ["engine.sleep(level 2)", "trainer.reload", "policy.logprobs(policy)", "policy.train_step",
            "trainer.free_grads", "engine.wake_up(weights)", "policy.push(v{v})", "engine.receive(v{v})",
            "trainer.offload", "engine.wake_up(kv_cache)"]
    save = ["engine.sleep", "trainer.reload", "policy.save", "trainer.offload", "engine.wake_up"]
    expected = ([e.format(v=1) for e in step[:6]] + ["policy.open_push(tp1)"] + [e.format(v=1) for e in step[6:]]
                + save + [e.format(v=2) for e in step] + save)
    assert events == expected


def test_file_syncs_write_before_the_memory_moves(tmp_path, tokenizer, tokenizer_dir):
    events = []
    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, events, steps=2,
                       overrides=["trainer.offload_during_rollout=true", "rollout.sleep_during_train=true",
                                  "trainer.save_every=1", "rollout.weight_sync_format=sharded",
                                  "algorithm.recompute_old_logprobs=true"])
    run(parts)
    step = ["engine.sleep", "trainer.reload", "policy.logprobs(policy)", "policy.train_step",
            "policy.write_shards(tp1,v{v})", "trainer.offload", "engine.wake_up(weights)", "engine.reload(v{v})",
            "engine.wake_up(kv_cache)"]
    save = ["engine.sleep", "trainer.reload", "policy.save", "trainer.offload", "engine.wake_up"]
    assert events == [e.format(v=1) for e in step] + save + [e.format(v=2) for e in step] + save


def test_a_plugin_may_take_over_a_step_and_only_one(tmp_path, tokenizer, tokenizer_dir):
    events = []
    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, events, plugins=[TakeOver({1})], steps=2)
    trainer, history = run(parts)
    assert "takeover/step" not in history[0] and history[1]["takeover/step"] == 1.0
    assert history[1]["train/loss"] == 0.25 and history[0]["train/loss"] == 0.5
    assert events.count("policy.accumulate") == 1 and events.count("policy.apply") == 1
    assert len(parts.policy.trained[1]) == P0 * R0

    parts = make_parts(tmp_path / "two", tokenizer, tokenizer_dir, [],
                       plugins=[TakeOver({0}), type("Other", (TakeOver,), {"name": "other"})({0})], steps=1)
    with pytest.raises(RuntimeError, match=r"plug-ins \['takeover', 'other'\] all want to train it"):
        run(parts)


def test_checkpoint_and_resume_restore_plugin_state_and_the_data_cursor(tmp_path, tokenizer, tokenizer_dir):
    events, calls = [], []
    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, events, plugins=[RecordingPlugin(calls)], steps=2,
                       overrides=["trainer.save_every=1"])
    run(parts)
    first_prompts = [r["prompt_ids"] for r in map(json.loads, (tmp_path / "run/trained_prompts.jsonl").open())]
    state = CheckpointManager.load_driver_state(tmp_path / "run/checkpoints/step_000002")
    assert state["plugins"] == {"recorder": {"seen": 2}}

    calls2: list = []
    plugin = RecordingPlugin(calls2)
    resumed = make_parts(tmp_path, tokenizer, tokenizer_dir, [], plugins=[plugin], steps=4,
                         overrides=["trainer.save_every=1", "trainer.resume=true"])
    trainer, history = run(resumed)
    assert plugin.loaded == {"seen": 2} and plugin.seen == 4
    assert [m["step"] for m in history] == [2, 3] and resumed.policy.steps == 4
    assert resumed.engine.version == 4
    rows = [r["prompt_ids"] for r in map(json.loads, (tmp_path / "run/trained_prompts.jsonl").open())]
    assert rows[:2] == first_prompts
    flat = [p for r in rows for p in r]
    assert len(flat) == len(set(flat)) == 4 * P0  # every prompt once across the resume


def test_sigterm_stops_at_the_step_boundary_with_a_checkpoint(tmp_path, tokenizer, tokenizer_dir):
    stop = GracefulStop()

    class Terminate(TrainerPlugin):
        name = "terminate"

        def on_batch_ready(self, step, batch):
            if step == 1:
                stop.handle(signal.SIGTERM)  # arrives mid-step: the step still finishes

    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, [], plugins=[Terminate()], steps=5, stop=stop)
    trainer, history = run(parts)
    assert [m["step"] for m in history] == [0, 1] and stop.stopped_after == 1 and stop.exit_code == 143
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["step_000002"]
    assert parts.policy.steps == 2 and parts.engine.version == 2


def test_tail_batching_runs_through_the_same_loop(tmp_path, tokenizer, tokenizer_dir):
    """RollPacker's scheduler plugs in by name; a long tail of slow prompts goes to the queue and
    comes back in a long round (the scheduler's own logic is tested in test_tail_batching)."""
    from megatron_rl.config.plugins import load_plugin_packages

    load_plugin_packages()  # 'tail_batching' is RollPacker's, named by its entry point (as a run loads it)

    def length(req: GenerationRequest) -> int:
        if "q:" not in req.request_id:  # the warm-up request
            return 4
        return 30 if int(req.request_id.split("q:")[1].split("-")[0]) % 4 == 0 else 10

    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, [], steps=5, scheduler="tail_batching", length_fn=length)
    trainer, history = run(parts)
    assert [m["round_type"] for m in history] == ["short"] * 4 + ["long"]
    assert all(m["batch/samples_trained"] == P0 * R0 for m in history)


def test_an_exhausted_reward_pool_stops_the_step_and_keeps_the_last_checkpoint(tmp_path, tokenizer, tokenizer_dir):
    """The dispatcher raises RewardPoolExhausted once a response's task is lost past its
    resubmissions (the Ray pool's own test: tests/integration/test_faults_parts.py). In the loop
    that is a failed step: StepFailed names the step, the phase and the pool's error; the step's
    responses are not trained on a made-up reward, and the checkpoint of the step before stays."""
    from megatron_rl.checkpoint.store import list_checkpoints
    from megatron_rl.loop.trainer import StepFailed
    from megatron_rl.reward.pool.dispatch import RewardPoolExhausted

    parts = make_parts(tmp_path, tokenizer, tokenizer_dir, [], steps=4, overrides=["trainer.save_every=1"])
    real_score, calls = parts.rewards.score, []

    async def score(sample):
        calls.append(sample.request_id)
        if len(calls) > 2 * P0 * R0 + 3:  # some way into step 2's rollout
            raise RewardPoolExhausted(f"the reward pool is exhausted: the reward of {sample.request_id} was lost")
        return await real_score(sample)

    parts.rewards.score = score
    with pytest.raises(StepFailed) as failed:
        run(parts)
    assert failed.value.step == 2 and failed.value.phase == "rollout"
    assert "RewardPoolExhausted: the reward pool is exhausted" in str(failed.value)
    assert parts.policy.steps == 2  # steps 0 and 1 trained; step 2 trained nothing
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1]
    assert [step for step, _ in list_checkpoints(parts.cfg.trainer.run_dir)] == [1, 2]
