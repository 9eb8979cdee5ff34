"""The synchronous on-policy RL loop, top to bottom.

    rollout (scheduler hook) -> rewards (already scored as responses finished) -> shaping,
    filtering, advantages -> old/ref logprobs -> Megatron train step -> weight sync -> metrics,
    validation, checkpoint.

The loop owns no scheduling policy: ``scheduler`` (baseline or RollPacker's tail batching) picks
prompts and decides when a step's rollout is done; ``hooks`` observe groups as they complete.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field

from megatron_rl import evaluation
from megatron_rl.algorithms.advantages import compute_advantages
from megatron_rl.algorithms.filters import filter_zero_variance
from megatron_rl.checkpoint import CheckpointManager
from megatron_rl.config import RunConfig
from megatron_rl.data.cursor import PromptCursor
from megatron_rl.graceful_stop import GracefulStop
from megatron_rl.hooks import RolloutBatch, RolloutContext, RolloutScheduler, StepHook
from megatron_rl.metrics import MetricsLogger, PhaseTimer, length_stats, occupancy
from megatron_rl.rollout.engine import GenerationRequest, RolloutEngine
from megatron_rl.sample import Prompt, Sample
from megatron_rl.step_log import StepLog
from megatron_rl.training.policy_group import PolicyGroup

log = logging.getLogger(__name__)


@dataclass
class TrainerParts:
    """Everything the loop drives; built by ``megatron_rl.train`` (or a test)."""

    cfg: RunConfig
    policy: PolicyGroup
    engine: RolloutEngine
    rewards: "object"  # megatron_rl.reward.workers.RewardPool (async score / cancel)
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    scheduler: RolloutScheduler
    hooks: list[StepHook] = field(default_factory=list)
    weight_sync_dir: str = ""
    elastic: "object | None" = None
    """rollpacker.elastic_tp.ElasticTP when planner.enabled (engine is then its ElasticRollout)."""
    fanout_source: str = ""
    """Multi-node runs: Ray node id of trainer rank 0, which writes the weight directories; each
    is then copied to the same path on every other node (``rollout.weight_fanout``). Empty on
    one node."""
    stop: GracefulStop | None = None
    """SIGTERM (train.py installs it): once a stop is requested, the loop checkpoints after the
    current step and returns."""


class Trainer:
    def __init__(self, parts: TrainerParts):
        self.p = parts
        self.cfg = parts.cfg
        self.cursor = PromptCursor(len(parts.train_prompts), seed=self.cfg.trainer.seed, shuffle=self.cfg.data.shuffle)
        self.checkpoints = CheckpointManager(self.cfg.trainer.run_dir, keep=self.cfg.trainer.keep_checkpoints,
                                             config_dict=dataclasses.asdict(self.cfg))
        self.version = 0  # policy version == number of optimizer steps taken == step index
        self.t0 = time.monotonic()
        self.start_step = 0
        # train.py offloads the freshly loaded trainer when offload_during_rollout is set.
        self._resident = not self.cfg.trainer.offload_during_rollout
        self._sync_metrics: dict[str, float] = {}  # this step's weight_sync/* figures
        self.stream = self._make_stream_trainer() if self.cfg.stream.enabled else None
        # The stream trainer is a hook like any other, called first so it sees groups at once.
        self.hooks: list[StepHook] = ([self.stream] if self.stream else []) + list(parts.hooks)

    def _make_stream_trainer(self):
        from megatron_rl.config_io import resolve_device
        from rollpacker.stream_trainer import StreamTrainer

        async def set_threads(n: int) -> None:
            await asyncio.to_thread(self.p.policy.set_num_threads, n)

        on_cpu = resolve_device(self.cfg) == "cpu"
        return StreamTrainer(self.cfg, self.p.engine, self._train_chunk, self._apply_accumulated,
                             set_train_threads=set_threads if on_cpu else None)

    # ---------------------------------------------------------------- the loop
    async def run(self) -> list[dict]:
        cfg = self.cfg
        self._resume_if_asked()
        metrics_log = MetricsLogger(cfg.trainer.run_dir, cfg.trainer, config_dict=dataclasses.asdict(cfg),
                                    start_step=self.start_step, total_steps=cfg.trainer.steps)
        history = []
        try:
            await self._warm_up_engine()
            if self.start_step > 0:
                await self._sync_weights()  # the engine started from HF weights; bring it to the checkpoint
            # Validation before training goes into the first step's record (val/policy_version = 0).
            initial_val = await self._validate() if cfg.data.eval_every and self.start_step == 0 else {}
            for step in range(self.start_step, cfg.trainer.steps):
                metrics = await self._step(step)
                metrics.update(initial_val)
                initial_val = {}
                if cfg.data.eval_every and ((step + 1) % cfg.data.eval_every == 0 or step + 1 == cfg.trainer.steps):
                    metrics.update(await self._validate())
                # Log before saving: a kill in between leaves a line the resumed run drops and
                # redoes, never a checkpointed step without its metrics line.
                metrics_log.log(step, metrics)
                stopping = self.p.stop is not None and self.p.stop.requested and step + 1 < cfg.trainer.steps
                if self._should_save(step) or stopping:
                    await self._save(step + 1)
                for hook in self.hooks:
                    hook.on_step_end(step, metrics)
                history.append(metrics)
                if stopping:
                    self.p.stop.stopped_after = step
                    log.warning("stopped after step %d of %d on request; checkpoint step_%06d written: resume with "
                                "trainer.resume=true", step, cfg.trainer.steps, step + 1)
                    break
        finally:
            metrics_log.close()
        return history

    async def _step(self, step: int) -> dict:
        timer = PhaseTimer()
        step_start = time.monotonic()
        self._sync_metrics = {}
        if self.p.elastic is not None:
            with timer("engine_switch"):
                await self.p.elastic.before_round(self.p.scheduler.next_round_type(self.cfg), self._write_rollout_shards)
        with timer("rollout"):
            batch = await self.p.scheduler.next_batch(self._context(step))
        planner_metrics = await self.p.elastic.after_round(batch.round_type) if self.p.elastic is not None else {}
        if self.cfg.rollout.sleep_during_train:
            with timer("engine_sleep"):
                await self.p.engine.sleep()
        if self.cfg.trainer.offload_during_rollout:
            # After the engine sleeps: on a colocated GPU both would not fit at once.
            with timer("trainer_reload"):
                await self._trainer_resident(True)
        for hook in self.hooks:
            hook.on_batch_ready(step, batch)
        samples, prep_metrics = self._prepare(batch)
        self._check_on_policy(samples)
        stream_metrics: dict[str, float] = {}
        if self.stream is not None and self.stream.streaming(step):
            # Most of the batch already went through forward/backward during the rollout.
            with timer("train"):
                result = await self.stream.finish(step, batch.groups)
            self._check_stream_covered(samples, result.trained)
            train_metrics, stream_metrics = result.train_metrics, result.metrics
        else:
            with timer("logprob"):
                if samples:
                    await self._set_logprobs(samples)
            with timer("train"):
                train_metrics = self.p.policy.train_step(samples) if samples else {}
        self.version += 1
        with timer("weight_sync"):
            await self._sync_weights()
        elapsed = time.monotonic() - step_start
        metrics = self._step_metrics(step, batch, samples, timer, elapsed)
        metrics.update(prep_metrics)
        metrics.update(stream_metrics)
        metrics.update(planner_metrics)
        metrics.update(self._sync_metrics)
        metrics.update(self._parity_metrics(samples, train_metrics))
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        # Reward scheduler: queue wait, busy workers, reward time hidden under rollout, scaling.
        metrics.update(self.p.rewards.step_metrics(batch.samples))
        self._record_trained_prompts(step, batch, samples)
        return metrics

    # ---------------------------------------------------------------- pieces
    def _context(self, step: int) -> RolloutContext:
        def on_group_complete(group: list[Sample]) -> None:
            for hook in self.hooks:
                hook.on_group_complete(step, group)

        def on_round_start(round_type: str, num_groups: int) -> None:
            for hook in self.hooks:
                hook.on_round_start(step, round_type, num_groups)

        return RolloutContext(
            cfg=self.cfg, engine=self.p.engine, score=self.p.rewards.score, cancel_scores=self.p.rewards.cancel_samples,
            next_prompts=self._next_prompts, policy_version=self.version, step=step,
            on_group_complete=on_group_complete, on_round_start=on_round_start,
        )

    def _next_prompts(self, n: int) -> list[Prompt]:
        return [self.p.train_prompts[i] for i in self.cursor.take(n)]

    def _prepare(self, batch: RolloutBatch) -> tuple[list[Sample], dict]:
        """Zero-variance filter (when configured) and advantages. Returns the samples to train on."""
        # Overlong shaping already happened in the reward workers (reward = shaped, raw_reward = rule).
        groups, num_filtered = self._kept_groups(batch.groups)
        metrics: dict[str, float] = {}
        if self.cfg.algorithm.filter_zero_variance:
            metrics["batch/groups_filtered"] = float(num_filtered)
        samples = [s for g in groups for s in g]
        compute_advantages(samples, kind=self.cfg.algorithm.advantage)
        metrics["batch/groups_trained"] = float(len(groups))
        return samples, metrics

    def _kept_groups(self, groups: list[list[Sample]]) -> tuple[list[list[Sample]], int]:
        """Groups to train on (zero-variance ones dropped when configured), and how many were dropped."""
        if not self.cfg.algorithm.filter_zero_variance:
            return groups, 0
        result = filter_zero_variance(groups)
        return result.kept, result.num_filtered

    # ---------------------------------------------------------------- stream trainer callbacks
    async def _train_chunk(self, groups: list[list[Sample]]) -> list[Sample]:
        """Streamed chunk: the same per-group preparation as :meth:`_prepare` (advantages are
        group-local, so a chunk gets exactly the values the whole batch would), old logprobs
        under the current weights, then forward/backward with gradients accumulated."""
        kept, _ = self._kept_groups(groups)
        samples = [s for g in kept for s in g]
        if not samples:
            return []
        if self.cfg.trainer.offload_during_rollout:
            await self._trainer_resident(True)  # streaming trains during the rollout
        compute_advantages(samples, kind=self.cfg.algorithm.advantage)
        self._check_on_policy(samples)
        await self._set_logprobs(samples)
        await self.p.policy.accumulate_gradients_async(samples)
        return samples

    async def _apply_accumulated(self, samples: list[Sample]) -> dict:
        """The step's single optimizer step, normalised by the whole batch's counts."""
        return await self.p.policy.apply_accumulated_gradients_async(
            num_tokens_total=sum(len(s.response_ids) for s in samples), num_seqs_total=len(samples))

    @staticmethod
    def _check_stream_covered(samples: list[Sample], trained: list[Sample]) -> None:
        """The streamed update must cover exactly the samples the ordinary path would train."""
        expected, got = {s.request_id for s in samples}, [s.request_id for s in trained]
        if len(got) != len(set(got)) or set(got) != expected:
            missing, extra = expected - set(got), set(got) - expected
            raise RuntimeError(f"stream trainer trained {len(got)} samples, expected {len(expected)} "
                               f"(missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}, "
                               f"duplicates {len(got) - len(set(got))})")

    def _check_on_policy(self, samples: list[Sample]) -> None:
        stale = [s.request_id for s in samples if s.policy_version != self.version]
        if stale:
            raise RuntimeError(f"{len(stale)} samples were not generated by the current policy version "
                               f"{self.version} (e.g. {stale[:3]}): training would be off-policy")

    async def _set_logprobs(self, samples: list[Sample]) -> None:
        if self.cfg.algorithm.recompute_old_logprobs:  # else the training forward scores the batch
            old = await self.p.policy.compute_logprobs_async(samples, "policy")
            for s, lp in zip(samples, old):
                if len(lp) != len(s.response_ids):
                    raise RuntimeError(f"trainer returned {len(lp)} logprobs for {len(s.response_ids)} tokens "
                                       f"of {s.request_id}")
                s.old_logprobs = lp
        if self.cfg.algorithm.kl_coef > 0:
            ref = await self.p.policy.compute_logprobs_async(samples, "reference")
            for s, lp in zip(samples, ref):
                s.ref_logprobs = lp

    async def _warm_up_engine(self) -> None:
        """One short sampled request before step 0: vLLM's first seeded, logprob-returning call
        is slow (tens of seconds on CPU) and would otherwise inflate the first step's time."""
        start = time.monotonic()
        prompt = self.p.train_prompts[0]
        await self.p.engine.submit(GenerationRequest(request_id="warmup", prompt_ids=prompt.token_ids, max_tokens=4,
                                                     seed=0, temperature=self.cfg.rollout.temperature))
        stream = self.p.engine.completions()
        while (await stream.__anext__()).request_id != "warmup":
            pass
        log.info("engine warm-up took %.1f s", time.monotonic() - start)

    async def _sync_weights(self) -> None:
        """Trainer shards -> weight files (HF export, or per-engine-rank shards moved by the
        resharder: ``rollout.weight_sync_format``) -> engine reload, tagged with the version."""
        if self.cfg.rollout.weight_sync_format == "sharded":
            tp = getattr(self.p.engine, "tp", self.cfg.rollout.tensor_parallel_size)  # elastic: the current TP
            stats = await self.p.policy.write_rollout_shards_async(tp, self.p.weight_sync_dir, self.version,
                                                                   self._engine_dtype)
            self._sync_metrics.update({"weight_sync/reshard_mb": (stats["bytes_sent"] + stats["bytes_local"]) / 1e6,
                                       "weight_sync/reshard_s": stats["seconds"]})
        else:
            self.p.policy.write_hf_weights(self.p.weight_sync_dir)
        await self._fan_out(self.p.weight_sync_dir)
        if self.cfg.trainer.offload_during_rollout:
            await self._trainer_resident(False)  # before the engine wakes (see _step)
        if self.cfg.rollout.sleep_during_train:
            await self.p.engine.wake_up()
        await self.p.engine.reload_weights(self.p.weight_sync_dir, self.version)

    @functools.cached_property
    def _engine_dtype(self) -> str:
        """The dtype the engines run in (and weights are written in); read once."""
        from megatron_rl.config_io import resolve_device
        from megatron_rl.rollout.weight_sync import engine_dtype

        return engine_dtype(self.cfg.model.hf_path, resolve_device(self.cfg) == "cuda")

    async def _write_rollout_shards(self, tp: int) -> tuple[str, dict[str, float]]:
        """Elastic-TP switch: the current weights as per-rank shards for engines of TP ``tp``,
        moved by the resharder into the weight-sync directory (the old engines are already shut
        down, and the per-step sync rewrites it next, so /dev/shm holds one copy)."""
        offload = self.cfg.trainer.offload_during_rollout
        if offload:
            await self._trainer_resident(True)
        try:
            stats = await self.p.policy.write_rollout_shards_async(tp, self.p.weight_sync_dir, self.version,
                                                                   self._engine_dtype)
        finally:
            if offload:
                await self._trainer_resident(False)
        await self._fan_out(self.p.weight_sync_dir)
        return self.p.weight_sync_dir, stats

    async def _fan_out(self, directory: str) -> None:
        """Multi-node runs: copy a weights directory rank 0 just wrote to the same path on every
        other node, where engines read it (``rollout.weight_fanout``)."""
        if not self.p.fanout_source:
            return
        from megatron_rl.rollout.weight_fanout import fan_out, other_nodes

        figures = await fan_out(directory, self.p.fanout_source, other_nodes(self.p.fanout_source))
        for key, value in figures.items():
            name = f"weight_sync/{key}"
            self._sync_metrics[name] = self._sync_metrics.get(name, 0.0) + value

    async def _trainer_resident(self, resident: bool) -> None:
        """trainer.offload_during_rollout: bring the trainer's grads/optimizer/weights back, or
        move them out for the rollout (MegatronWorker.reload_for_training / offload_for_rollout)."""
        if resident == self._resident:
            return  # e.g. every streamed chunk after the first: one Ray round trip saved each
        call = self.p.policy.reload_for_training if resident else self.p.policy.offload_for_rollout
        await asyncio.to_thread(call)
        self._resident = resident

    async def _validate(self) -> dict:
        return await evaluation.validate(self.cfg, self.p.engine, self.p.rewards, self.p.eval_prompts,
                                         policy_version=self.version)

    # ---------------------------------------------------------------- metrics
    @staticmethod
    def _parity_metrics(trained: list[Sample], train_metrics: dict) -> dict[str, float]:
        """Trainer vs engine logprobs of the same tokens (catches stale or mis-mapped weight
        syncs): from the scoring pass's old logprobs or, with algorithm.recompute_old_logprobs=false,
        from the training forward (its ``logprob_abs_diff_*`` sums, taken out of ``train_metrics``)."""
        if "logprob_abs_diff_sum" in train_metrics:
            diff_sum = train_metrics.pop("logprob_abs_diff_sum")
            return {"rollout/logprob_abs_diff_max": train_metrics.pop("logprob_abs_diff_max", 0.0),
                    "rollout/logprob_abs_diff_mean": diff_sum / max(1.0, train_metrics.get("num_tokens", 0.0))}
        diffs = [abs(a - b) for s in trained if s.engine_logprobs for a, b in zip(s.old_logprobs, s.engine_logprobs)]
        if not diffs:
            return {}
        return {"rollout/logprob_abs_diff_max": max(diffs), "rollout/logprob_abs_diff_mean": sum(diffs) / len(diffs)}

    def _step_metrics(self, step: int, batch: RolloutBatch, trained: list[Sample], timer: PhaseTimer,
                      elapsed: float) -> dict:
        samples = batch.samples
        lengths = [len(s.response_ids) for s in samples]
        rewards = [s.reward for s in samples]
        last_finish = max((s.timings.get("finished", 0.0) for s in samples), default=batch.rollout_window[1])
        phases = timer.as_dict()
        # Rewards are computed while generation runs; only the wait after the last response counts.
        reward_tail = max(0.0, batch.rollout_window[1] - last_finish) if samples else 0.0
        phases["rollout"] = max(0.0, phases.get("rollout", 0.0) - reward_tail)
        phases["reward"] = reward_tail
        capacity = self.cfg.rollout.max_num_seqs * self.cfg.rollout.num_engines
        m = {
            "step": step,
            "policy_version": self.version,
            "round_type": batch.round_type,
            "time/step": elapsed,
            **{f"time/{k}": v for k, v in phases.items()},
            "reward/mean": sum(rewards) / max(1, len(rewards)),
            "reward/accuracy": sum(bool(s.correct) for s in samples) / max(1, len(samples)),
            "rollout/tokens_per_s": sum(lengths) / max(1e-9, phases["rollout"]),
            "rollout/engine_occupancy": occupancy([(s, e) for s, e, _ in batch.requests], capacity, batch.rollout_window),
            "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / max(1, len(samples)),
            "batch/samples_trained": float(len(trained)),
        }
        stats = length_stats(lengths)
        m.update({f"response_length/{k}": v for k, v in stats.items()})
        # Short and long rounds are bimodal: also report step time and lengths per round type.
        rt = batch.round_type
        m[f"round/{rt}/time_step"] = elapsed
        m[f"round/{rt}/time_rollout"] = phases["rollout"]
        m.update({f"round/{rt}/response_length_{k}": v for k, v in stats.items()})
        m.update(batch.metrics)
        return m

    def _record_trained_prompts(self, step: int, batch: RolloutBatch, samples: list[Sample]) -> None:
        trained = list(dict.fromkeys(s.prompt.prompt_id for s in samples))
        trained_set = set(trained)
        # Filtered by the scheduler (DAPO refill) or by the loop's zero-variance filter.
        filtered = list(batch.filtered_prompt_ids) + [g[0].prompt.prompt_id for g in batch.groups
                                                      if g[0].prompt.prompt_id not in trained_set]
        self.trained_log.append(step, prompt_ids=trained, filtered_ids=filtered)
        # Times relative to the trainer's start so steps line up on one axis in the plot.
        self.timeline_log.append(step, round_type=batch.round_type,
                                 window=[t - self.t0 for t in batch.rollout_window],
                                 requests=[[s - self.t0, e - self.t0, reason] for s, e, reason in batch.requests],
                                 response_lengths=[len(s.response_ids) for s in batch.samples])

    # ---------------------------------------------------------------- checkpoints
    def _should_save(self, step: int) -> bool:
        every = self.cfg.trainer.save_every
        return step + 1 == self.cfg.trainer.steps or (every > 0 and (step + 1) % every == 0)

    async def _save(self, next_step: int) -> None:
        tmp = self.checkpoints.begin(next_step)
        offloaded = self.cfg.trainer.offload_during_rollout
        if offloaded:
            # The checkpoint needs the trainer state back; the engine makes room meanwhile.
            if self.cfg.rollout.sleep_during_train:
                await self.p.engine.sleep()
            await self._trainer_resident(True)
        self.p.policy.save_checkpoint(str(tmp))
        if offloaded:
            await self._trainer_resident(False)
            if self.cfg.rollout.sleep_during_train:
                await self.p.engine.wake_up()
        state = {"next_step": next_step, "version": self.version, "cursor": self.cursor.state_dict(),
                 "scheduler": self.p.scheduler.state_dict(),
                 "reward_timeouts": self.p.rewards.timeouts.state_dict(),
                 "planner": self.p.elastic.state_dict() if self.p.elastic is not None else {}}
        self.checkpoints.commit(next_step, tmp, driver_state=state)

    def _resume_if_asked(self) -> None:
        self.trained_log = StepLog(self.cfg.trainer.run_dir, "trained_prompts.jsonl")
        self.timeline_log = StepLog(self.cfg.trainer.run_dir, "rollout_timeline.jsonl")
        path = self.checkpoints.latest() if self.cfg.trainer.resume else None
        if self.cfg.trainer.resume and path is None:
            log.warning("trainer.resume=true but no checkpoint in %s/checkpoints: starting from step 0",
                        self.cfg.trainer.run_dir)
        if path is not None:
            state = self.checkpoints.load_driver_state(path)
            self.p.policy.load_checkpoint(str(path))
            self._resident = True  # loading a checkpoint brings an offloaded trainer back
            self.cursor.load_state_dict(state["cursor"])
            self.p.scheduler.load_state_dict(state["scheduler"])
            self.p.rewards.timeouts.load_state_dict(state.get("reward_timeouts", {}))
            if self.p.elastic is not None:
                self.p.elastic.load_state_dict(state.get("planner", {}))
            self.start_step = int(state["next_step"])
            self.version = int(state["version"])
            log.info("resumed from %s at step %d", path, self.start_step)
        # Steps from start_step on are (re)done: drop what a killed run logged for them.
        self.trained_log.truncate(self.start_step)
        self.timeline_log.truncate(self.start_step)


def run_trainer(parts: TrainerParts) -> list[dict]:
    return asyncio.run(Trainer(parts).run())
