"""The RL loop, top to bottom (synchronous and on-policy unless the scheduler declares otherwise).

    plug-ins' before_rollout -> rollout (the scheduler) -> plug-ins' after_rollout -> memory to
    the training side -> shaping, filtering, advantages, the staleness check -> old/ref logprobs
    + train step (or a plug-in that takes the step over) -> the scheduler's before_weight_sync ->
    weight sync -> metrics, validation, checkpoint.

The loop owns no policy: the scheduler picks prompts and decides when a step's rollout is done;
plug-ins (``megatron_rl.loop.hooks.TrainerPlugin``) get the named points above and reach the loop
through the services it offers them (:class:`Trainer` implements ``hooks.LoopServices``). Device
memory belongs to ``training.colocation.Colocation``, weight movement to
``rollout.weight_sync.sync.WeightSync``; the loop only asks them for named transitions.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_rl.algorithms.advantages import compute_advantages
from megatron_rl.algorithms.filters import filter_zero_variance
from megatron_rl.checkpoint.store import CheckpointManager
from megatron_rl.config.loading import config_to_dict
from megatron_rl.config.schema import RunConfig
from megatron_rl.data.cursor import PromptCursor
from megatron_rl.loop import evaluation, off_policy, step_record
from megatron_rl.loop.engine_trace_log import EngineTraceLog
from megatron_rl.loop.hooks import RolloutBatch, RolloutContext, RolloutScheduler, TrainerPlugin
from megatron_rl.loop.step_log import StepLog
from megatron_rl.rollout.engine import GenerationRequest, RolloutEngine
from megatron_rl.rollout.weight_sync.factory import make_transport
from megatron_rl.rollout.weight_sync.hf_files import engine_dtype
from megatron_rl.rollout.weight_sync.interface import FanOut
from megatron_rl.rollout.weight_sync.sync import WeightSync
from megatron_rl.runtime.aio import run_until_interrupted
from megatron_rl.runtime.graceful_stop import GracefulStop
from megatron_rl.runtime.metrics_logger import MetricsLogger, PhaseTimer
from megatron_rl.sample import Prompt, Sample
from megatron_rl.training.colocation import Colocation
from megatron_rl.training.policy import Policy

if TYPE_CHECKING:
    from megatron_rl.reward.pool.reward_pool import RewardPool

log = logging.getLogger(__name__)

_STEP_PHASES = ("rollout", "logprob", "train", "weight_sync")
"""Phases inside the step (its ``time/*`` metrics); validation and the checkpoint are timed too,
for ``phases.jsonl``, but stay out of the step's time."""


@dataclass
class TrainerParts:
    """Everything the loop drives; assembled by ``megatron_rl.train`` (or a test)."""

    cfg: RunConfig
    policy: Policy
    """The trainer ranks (``PolicyGroup``)."""
    engine: RolloutEngine
    """The engines, as the plug-in factories left them (e.g. RollPacker's elastic wrapper)."""
    rewards: "RewardPool"
    """Async scoring of each finished response (``megatron_rl.reward.pool.reward_pool.RewardPool``)."""
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    scheduler: RolloutScheduler
    plugins: list[TrainerPlugin] = field(default_factory=list)
    """Called in this order at every hook point; state saved under each one's ``name``."""
    weight_sync_dir: str = ""
    """Directory the engines read weights from (per-run, in /dev/shm by default)."""
    fan_out: FanOut | None = None
    """Multi-node runs: copies a weight directory rank 0 wrote to every other node; None on one."""
    stop: GracefulStop | None = None
    """SIGTERM (train.py installs it): the loop checkpoints after the current step and returns."""
    on_cpu: bool = True
    """Whether the run is on CPU (the engine dtype, and lent cores become trainer threads)."""


class StepFailed(RuntimeError):
    """The loop stopped because a part failed; the message names the step, the phase it was in
    and the part's own error (which names the rank, engine or node)."""

    def __init__(self, step: int, phase: str, cause: BaseException) -> None:
        self.step, self.phase = step, phase
        super().__init__(f"the run stopped at step {step} ({phase}): {type(cause).__name__}: {cause}")


class Trainer:
    """The loop (see the module docstring); also the ``LoopServices`` its plug-ins get."""

    def __init__(self, parts: TrainerParts):
        self.p = parts
        self.cfg = parts.cfg
        self.engine = parts.engine
        self.plugins = list(parts.plugins)
        names = [p.name for p in self.plugins]
        if len(set(names)) != len(names):
            raise ValueError(f"plug-in names must be unique (they key checkpoint state): {names}")
        self.cursor = PromptCursor(len(parts.train_prompts), seed=self.cfg.trainer.seed, shuffle=self.cfg.data.shuffle)
        self.checkpoints = CheckpointManager(self.cfg.trainer.run_dir, keep=self.cfg.trainer.keep_checkpoints,
                                             config_dict=config_to_dict(self.cfg))
        self.version = 0  # policy version == number of optimizer steps taken == step index
        self.max_staleness = parts.scheduler.max_staleness(self.cfg)
        """The scheduler's staleness bound: 0 is the strict on-policy check."""
        if self.max_staleness > 0 and self.cfg.algorithm.tis_cap <= 0:
            log.warning("scheduler %s trains tokens up to %d versions old without truncated importance sampling "
                        "(algorithm.tis_cap=0)", parts.scheduler.name, self.max_staleness)
        self.t0 = time.monotonic()
        self.start_step = 0
        self.colocation = Colocation(self.cfg, parts.policy, parts.engine, on_cpu=parts.on_cpu)
        dtype = engine_dtype(self.cfg.model.hf_path, on_gpu=not parts.on_cpu)
        transport = make_transport(self.cfg.rollout.weight_sync_format, parts.policy, parts.weight_sync_dir, dtype,
                                   self.cfg, on_gpu=not parts.on_cpu)
        self.weight_sync = WeightSync(transport, parts.policy, parts.engine, self.colocation, parts.fan_out)
        self._restart_s_logged = 0.0  # engine replacement seconds already reported (fault/seconds_lost)
        for plugin in self.plugins:
            plugin.attach(self)

    # ---------------------------------------------------------------- the loop
    async def run(self) -> list[dict]:
        cfg = self.cfg
        await self._resume_if_asked()
        metrics_log = MetricsLogger(cfg.trainer.run_dir, cfg.trainer, config_dict=config_to_dict(cfg),
                                    start_step=self.start_step, total_steps=cfg.trainer.steps)
        history = []
        try:
            # Validation before training goes into the first step's record (val/policy_version = 0).
            timer = PhaseTimer()
            initial_val = {}
            try:
                # Replacements of dead engines get the current weights from the loop's sync.
                await self.engine.supervise(self._weights_for_new_engine)
                await self._warm_up_engine()
                if self.start_step > 0:  # the engine started from HF weights: push the resumed ones
                    await self.colocation.to_training()  # the memory as after a step's training (engines asleep)
                    await self._push_weights()
                if cfg.data.eval_every and self.start_step == 0:
                    with timer("validation"):
                        initial_val = await self._validate()
            except Exception as exc:  # a part failed: say where the loop was (the part names itself)
                raise self._failed(self.start_step, timer.last_started or "start-up: engine warm-up, first weight sync",
                                   exc) from exc
            await self.trace_log.collect(self.engine, keep=False)  # warm-up and validation: no step's rollout
            for step in range(self.start_step, cfg.trainer.steps):
                timer = timer if step == self.start_step else PhaseTimer()
                try:
                    metrics = await self._step(step, timer)
                    metrics.update(initial_val)
                    initial_val = {}
                    if cfg.data.eval_every and ((step + 1) % cfg.data.eval_every == 0 or step + 1 == cfg.trainer.steps):
                        with timer("validation"):
                            await self.trace_log.collect(self.engine, keep=True)  # overlapped generation: next step's
                            metrics.update(await self._validate())
                            await self.trace_log.collect(self.engine, keep=False)
                    # Log before saving: a kill in between leaves a line the resumed run drops and
                    # redoes, never a checkpointed step without its metrics line.
                    metrics_log.log(step, metrics)
                    for plugin in self.plugins:  # before the save: what they record is in the checkpoint
                        plugin.on_step_end(step, metrics)
                    stopping = self.p.stop is not None and self.p.stop.requested and step + 1 < cfg.trainer.steps
                    if self._should_save(step) or stopping:
                        with timer("checkpoint"):
                            await self._save(step + 1)
                except Exception as exc:  # a part failed: say where the loop was (the part names itself)
                    raise self._failed(step, timer.last_started or "start of the step", exc) from exc
                # Every phase's (start, end) on the system-wide monotonic clock: what a profiler
                # in another process lines its samples up with (rollpacker-profile-loop).
                self.phase_log.append(step, round_type=metrics["round_type"],
                                      phases=[[n, s, e] for n, s, e in timer.intervals()])
                history.append(metrics)
                if stopping:
                    self.p.stop.stopped_after = step
                    log.warning("stopped after step %d of %d on request; checkpoint step_%06d written: resume with "
                                "trainer.resume=true", step, cfg.trainer.steps, step + 1)
                    break
        finally:
            metrics_log.close()
        return history

    @staticmethod
    def _failed(step: int, phase: str, exc: Exception) -> StepFailed:
        failed = StepFailed(step, phase, exc)
        log.error("%s; tearing the run down", failed)  # when the failure was noticed (teardown follows)
        return failed

    async def _step(self, step: int, timer: PhaseTimer) -> dict:
        step_start = time.monotonic()
        extra: dict[str, float] = {}
        round_type = self.p.scheduler.next_round_type(self.cfg)
        for plugin in self.plugins:
            extra.update(await plugin.before_rollout(step, round_type))
        engine_before = await self.engine.stats()
        with timer("rollout"):
            batch = await self.p.scheduler.next_batch(self._context(step))
        engine_after = await self.engine.stats()
        await self.trace_log.collect(self.engine, keep=True)  # this rollout's iterations (rollout.engine_trace)
        for plugin in self.plugins:
            extra.update(await plugin.after_rollout(step, batch))
        extra.update(await self.colocation.to_training())
        for plugin in self.plugins:
            plugin.on_batch_ready(step, batch)
        samples, prep_metrics = self._prepare(batch)
        self._check_on_policy(samples)
        prep_metrics.update(off_policy.staleness_metrics(samples, self.version))
        owner = self._training_owner(step)
        if owner is not None:
            with timer("train"):
                result = await owner.train(step, batch, samples)
            train_metrics = result.train_metrics
            extra.update(result.metrics)
        else:
            with timer("logprob"):
                if samples:
                    await self._set_logprobs(samples)
            with timer("train"):
                train_metrics = await self.p.policy.train_step(samples) if samples else {}
        # A generation that overlapped training (one-step-off) ends here, on the old weights.
        extra.update(await self.p.scheduler.before_weight_sync(step))
        self.version += 1
        with timer("weight_sync"):
            extra.update(await self._push_weights())
        extra.update(await self._fault_metrics())
        phases = {k: v for k, v in timer.as_dict().items() if k in _STEP_PHASES}
        metrics = step_record.step_metrics(self.cfg, step, self.version, batch, samples, phases,
                                            time.monotonic() - step_start)
        for key in [k for k in extra if k.startswith("time/")]:  # phases timed by their owners
            metrics[key] = extra.pop(key)
        metrics.update(prep_metrics)
        metrics.update(step_record.speculation_metrics(batch, engine_before, engine_after))
        metrics.update(extra)
        metrics.update(step_record.parity_metrics(samples, train_metrics))
        metrics.update(off_policy.tis_metrics(train_metrics))
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        # Reward scheduler: queue wait, busy workers, reward time hidden under rollout, scaling.
        metrics.update(self.p.rewards.step_metrics(batch.samples))
        self.trained_log.append(step, **step_record.trained_prompt_record(batch, samples))
        self.timeline_log.append(step, **step_record.timeline_record(batch, self.t0))
        metrics.update(self.trace_log.write(step, batch.round_type))
        return metrics

    def _training_owner(self, step: int) -> TrainerPlugin | None:
        owners = [p for p in self.plugins if p.takes_over_training(step)]
        if len(owners) > 1:
            raise RuntimeError(f"step {step}: plug-ins {[p.name for p in owners]} all want to train it; one may")
        return owners[0] if owners else None

    # ---------------------------------------------------------------- pieces
    def _context(self, step: int) -> RolloutContext:
        def on_group_complete(group: list[Sample]) -> None:
            for plugin in self.plugins:
                plugin.on_group_complete(step, group)

        def on_round_start(round_type: str, num_groups: int) -> None:
            for plugin in self.plugins:
                plugin.on_round_start(step, round_type, num_groups)

        return RolloutContext(
            cfg=self.cfg, engine=self.engine, score=self.p.rewards.score, cancel_scores=self.p.rewards.cancel_samples,
            next_prompts=self._next_prompts, policy_version=self.version, step=step,
            on_group_complete=on_group_complete, on_round_start=on_round_start, epoch=lambda: self.cursor.epoch,
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

    def _check_on_policy(self, samples: list[Sample]) -> None:
        """Every token within the scheduler's staleness bound of the current version (bound 0:
        every sample and token of exactly this version), or the step fails; then marks each
        token's staleness when some are stale (the trainer tells on-policy tokens by it)."""
        off_policy.check_staleness(samples, self.version, self.max_staleness)
        off_policy.mark_staleness(samples, self.version)

    async def _set_logprobs(self, samples: list[Sample], **on) -> None:
        """Old (and reference) logprobs of ``samples`` (``on``: ``replicas=[...]``, the DP replicas that
        score them, as :meth:`train_groups` trains them)."""
        if self.cfg.algorithm.recomputes_old_logprobs():  # else the training forward scores the batch
            old = await self.p.policy.compute_logprobs(samples, "policy", **on)
            for s, lp in zip(samples, old):
                if len(lp) != len(s.response_ids):
                    raise RuntimeError(f"trainer returned {len(lp)} logprobs for {len(s.response_ids)} tokens "
                                       f"of {s.request_id}")
                s.old_logprobs = lp
        if self.cfg.algorithm.kl_coef > 0:
            ref = await self.p.policy.compute_logprobs(samples, "reference", **on)
            for s, lp in zip(samples, ref):
                s.ref_logprobs = lp

    async def _warm_up_engine(self) -> None:
        """One short sampled request before step 0: vLLM's first seeded, logprob-returning call
        is slow (tens of seconds on CPU) and would otherwise inflate the first step's time."""
        start = time.monotonic()
        prompt = self.p.train_prompts[0]
        await self.engine.submit(GenerationRequest(request_id="warmup", prompt_ids=prompt.token_ids, max_tokens=4,
                                                   seed=0, temperature=self.cfg.rollout.temperature))
        stream = self.engine.completions()
        while (await stream.__anext__()).request_id != "warmup":
            pass
        log.info("engine warm-up took %.1f s", time.monotonic() - start)

    async def _weights_for_new_engine(self, engine: RolloutEngine) -> dict:
        """A replacement engine starts from the run's initial weights (version 0): bring it to
        the current policy version, so the step's resubmitted requests stay on-policy."""
        if self.version == 0:
            return {}
        return await self.weight_sync.load_into(engine, self.version)

    async def _push_weights(self) -> dict:
        """The weight sync of ``self.version``; when it failed because the engines died, their
        replacement takes the same weights as it starts (``_weights_for_new_engine``)."""
        try:
            return await self.weight_sync.push(self.version)
        except Exception as exc:
            if not await self.engine.recover(exc):
                raise  # no engine died: the push's own error
            # The failed sync stopped before its last memory moves: finish them (trainer out, KV caches in).
            await self.colocation.to_rollout()
            log.warning("the weight sync of policy version %d failed because the engines died (%s); their "
                        "replacement holds version %d", self.version, exc, self.version)
            return {"weight_sync/engine_replaced": 1.0}

    async def _fault_metrics(self) -> dict[str, float]:
        """``fault/engine_restarts`` (engines replaced in the run so far), ``fault/seconds_lost``
        (replacement time since the last step's figure) and ``fault/resubmitted_requests`` (run
        total), from the engine layer's stats."""
        st = await self.engine.stats()
        lost, self._restart_s_logged = st.restart_s - self._restart_s_logged, st.restart_s
        return {"fault/engine_restarts": float(st.restarts), "fault/seconds_lost": lost,
                "fault/resubmitted_requests": float(st.resubmitted)}

    async def _validate(self) -> dict:
        return await evaluation.validate(self.cfg, self.engine, self.p.rewards, self.p.eval_prompts,
                                         policy_version=self.version)

    # ---------------------------------------------------------------- services for plug-ins
    async def train_groups(self, groups: list[list[Sample]], replicas: list[int] | None = None) -> list[Sample]:
        """LoopServices: the same per-group preparation as :meth:`_prepare` (advantages are
        group-local, so a chunk gets exactly the values the whole batch would), old logprobs
        under the current weights, then forward/backward with gradients accumulated: on every
        trainer rank, or (``replicas``) on those DP replicas' ranks only, each its own share."""
        kept, _ = self._kept_groups(groups)
        samples = [s for g in kept for s in g]
        if not samples:
            return []
        ranks = None if replicas is None else self.p.policy.ranks_of(replicas)
        await self.colocation.make_trainer_resident(ranks)  # streaming trains during the rollout
        compute_advantages(samples, kind=self.cfg.algorithm.advantage)
        self._check_on_policy(samples)
        on = {} if replicas is None else {"replicas": list(replicas)}
        await self._set_logprobs(samples, **on)
        await self.p.policy.accumulate_gradients(samples, **on)
        return samples

    async def apply_gradients(self, trained: list[Sample]) -> dict:
        """LoopServices: the step's single optimizer step, normalised by the whole batch's counts."""
        return await self.p.policy.apply_accumulated_gradients(
            num_tokens_total=sum(len(s.response_ids) for s in trained), num_seqs_total=len(trained))

    # ---------------------------------------------------------------- checkpoints
    def _should_save(self, step: int) -> bool:
        every = self.cfg.trainer.save_every
        return step + 1 == self.cfg.trainer.steps or (every > 0 and (step + 1) % every == 0)

    async def _save(self, next_step: int) -> None:
        tmp = self.checkpoints.begin(next_step)
        async with self.colocation.training_side():  # the checkpoint needs the trainer state
            await self.p.policy.save_checkpoint(str(tmp))
        state = {"next_step": next_step, "version": self.version, "cursor": self.cursor.state_dict(),
                 "scheduler": self.p.scheduler.state_dict(),
                 "reward_timeouts": self.p.rewards.timeouts.state_dict(),
                 "plugins": {p.name: p.state_dict() for p in self.plugins}}
        self.checkpoints.commit(next_step, tmp, driver_state=state)

    async def _resume_if_asked(self) -> None:
        self.trained_log = StepLog(self.cfg.trainer.run_dir, "trained_prompts.jsonl")
        self.timeline_log = StepLog(self.cfg.trainer.run_dir, "rollout_timeline.jsonl")
        self.phase_log = StepLog(self.cfg.trainer.run_dir, "phases.jsonl")
        self.trace_log = EngineTraceLog(self.cfg.trainer.run_dir, self.cfg.rollout.engine_trace)
        path = self.checkpoints.latest() if self.cfg.trainer.resume else None
        if self.cfg.trainer.resume and path is None:
            log.warning("trainer.resume=true but no checkpoint in %s/checkpoints: starting from step 0",
                        self.cfg.trainer.run_dir)
        if path is not None:
            state = self.checkpoints.load_driver_state(path)
            # The trainer comes back for the load (train.py offloads it when trainer.offload_during_rollout
            # is set) and stays: the first weight sync pushes what it loaded, then it leaves for the rollout.
            await self.colocation.make_trainer_resident()
            loaded = await self.p.policy.load_checkpoint(str(path)) or {}
            self.cursor.load_state_dict(state["cursor"])
            self.p.scheduler.load_state_dict(state["scheduler"])
            self.p.rewards.timeouts.load_state_dict(state["reward_timeouts"])
            for plugin in self.plugins:  # one turned on since the save starts from its initial state
                plugin.load_state_dict(state["plugins"].get(plugin.name, {}))
            self.start_step = int(state["next_step"])
            self.version = int(state["version"])
            saved = loaded.get("saved_layout")
            where = (f" (saved at layout TP{saved['tensor_model_parallel_size']} PP{saved['pipeline_model_parallel_size']}"
                     f" DP{saved['data_parallel_size']}, RNG {'restored' if loaded.get('rng_restored') else 'reseeded'})"
                     if saved else "")
            log.info("resumed from %s at step %d%s", path, self.start_step, where)
        # Steps from start_step on are (re)done: drop what a killed run logged for them.
        for step_log in (self.trained_log, self.timeline_log, self.phase_log, self.trace_log):
            step_log.truncate(self.start_step)


def run_trainer(parts: TrainerParts) -> list[dict]:
    """Run the loop; Ctrl-C stops it with KeyboardInterrupt (megatron_rl.runtime.aio.run_until_interrupted)."""
    return run_until_interrupted(Trainer(parts).run())
