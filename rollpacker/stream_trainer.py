"""RollPacker's stream trainer: gradients on completed groups while a round is still generating.

In a long round the last few prompts take most of the time, and the trainer sits idle. Here,
once ``stream.start_fraction_min`` .. ``start_fraction_max`` of the round's prompts are complete
(checked each time another ``check_interval`` of them completes), completed groups go to the
trainer in chunks: old logprobs under the current weights, group-local advantages, forward and
backward, gradients accumulated, no optimizer step and no clipping. After the rollout ends the
rest of the batch follows and the single optimizer step is taken with the full-batch token and
sequence counts. The update is the ordinary on-policy one (tests/integration/
test_stream_accumulation.py checks it to 1e-6).

Resource handoff, as the paper does it: with ``stream.release_engines`` > 0 the start also waits (until
``start_fraction_max``) for the moment the running requests fit on the engines that stay; then the
released engines' requests migrate recompute-style to the others and they sleep, and only the trainer
ranks on their GPUs compute. The released engines are chosen so that their GPUs are exactly whole
data-parallel replicas of the trainer (``megatron_rl.distributed.replica_release``: every GPU of the
replica's TP x CP x PP ranks); those replicas come back into device memory and take the completed
groups (on CPU with ``stream.train_threads`` threads, the freed cores), while the other replicas stay
offloaded beside the engines that keep generating. After the round every replica comes back and the
rest of the batch is split so that the replicas finish together (the freed ones, which trained
already, take less); one optimizer step, as ever. A GPU holds a generating engine or the trainer,
never both. Where the trainer shares no GPU with the engines (``cluster.placement=split``), or on CPU
with nothing released, every replica streams. Everything is given back when the round's training is
done, before the weight sync (if the pool sleeps through training, the released engines rejoin it
asleep and the sync's wake_up wakes them with the rest).

It is a trainer plug-in (``megatron_rl.loop.hooks.TrainerPlugin``): it sees groups complete through
the rollout hooks, takes over the training of the steps it streams (``takes_over_training`` /
``train``, which checks that exactly the step's prepared samples were trained, each once), and
reaches the loop only through its services: ``train_groups`` / ``apply_gradients`` for the
trainer's work, ``colocation.lend_engines`` / ``return_engines`` for the handoff. So this module
holds only the policy and is tested on a fake loop and engine as well as in the real loop.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from megatron_rl.config.schema import RunConfig
from megatron_rl.config.values import comma_list
from megatron_rl.distributed.gpu_layout import run_layout
from megatron_rl.distributed.replica_release import (
    ReleaseError,
    ReleaseUnit,
    choose_release,
    release_units,
    replica_ranks,
)
from megatron_rl.loop.hooks import LoopServices, RolloutBatch, TrainerPlugin, TrainResult
from megatron_rl.sample import Sample
from rollpacker.config import StreamConfig

log = logging.getLogger(__name__)


class StartRule:
    """When streaming starts: checks at start_fraction_min, +check_interval, ... up to
    start_fraction_max of the round's groups; at each, start if the running requests fit on the
    engines that would stay (always true when no engine is released), and at the last one anyway."""

    def __init__(self, total_groups: int, cfg: StreamConfig) -> None:
        self.total_groups = total_groups
        steps = max(0, math.floor((cfg.start_fraction_max - cfg.start_fraction_min) / cfg.check_interval + 1e-9))
        marks = [cfg.start_fraction_min + k * cfg.check_interval for k in range(steps + 1)]
        if marks[-1] < cfg.start_fraction_max - 1e-9:
            marks.append(cfg.start_fraction_max)
        self.marks = marks
        self._next = 0

    def crossed(self, completed_groups: int) -> float | None:
        """The highest check mark reached since the last call, or None when no new mark was
        reached (a check happens only once enough new prompts completed)."""
        fraction = completed_groups / max(1, self.total_groups)
        reached = None
        while self._next < len(self.marks) and fraction >= self.marks[self._next] - 1e-9:
            reached = self.marks[self._next]
            self._next += 1
        return reached

    def should_start(self, mark: float, requests_fit: bool) -> bool:
        return requests_fit or mark >= self.marks[-1] - 1e-9


@dataclass
class _Chunk:
    groups: int
    samples: int
    start: float
    end: float


@dataclass
class _Round:
    step: int
    round_type: str
    total_groups: int
    rule: StartRule
    start_time: float
    completed: list[list[Sample]] = field(default_factory=list)
    """Groups completed so far, in completion order."""
    sent: int = 0
    """How many of ``completed`` went to the trainer."""
    trained: list[Sample] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)
    started_at: float | None = None
    start_fraction: float = 0.0
    start_mark: float = 0.0
    release: dict = field(default_factory=dict)
    replicas: list[int] | None = None
    """The DP replicas streamed chunks train on (None: every replica, the workers split each chunk)."""
    skipped: str = ""
    """Why this round did not stream (a release that frees no whole replica on GPUs)."""
    closing: bool = False
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class StreamTrainer(TrainerPlugin):
    """Trainer plug-in that streams completed groups into the trainer (see the module docstring)."""

    name = "stream"

    def __init__(self, cfg: RunConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.scfg = cfg.section(StreamConfig)
        self.rounds = set(comma_list(self.scfg.rounds))
        self.clock = clock
        self.round: _Round | None = None
        self.loop: LoopServices | None = None

    def attach(self, loop: LoopServices) -> None:
        self.loop = loop

    # ------------------------------------------------------------------ hook side (rollout)
    def on_round_start(self, step: int, round_type: str, num_groups: int) -> None:
        if self.round is not None and self.round.task is not None and not self.round.task.done():
            raise RuntimeError(f"stream trainer: round of step {self.round.step} was never finished")
        self.round = None
        if self.scfg.enabled and round_type in self.rounds and num_groups > 0:
            self.round = _Round(step, round_type, num_groups, StartRule(num_groups, self.scfg), self.clock())

    def on_group_complete(self, step: int, group: list[Sample]) -> None:
        r = self.round
        if r is None or r.closing:
            return
        r.completed.append(group)
        if r.task is None:
            # Called from inside the scheduler's event loop: the driver runs beside it.
            r.task = asyncio.get_running_loop().create_task(self._drive(r))
        r.wakeup.set()

    def streaming(self, step: int) -> bool:
        """Whether this step's training goes through :meth:`finish` (accumulated gradients)."""
        return self.round is not None and self.round.step == step

    async def _drive(self, r: _Round) -> None:
        while True:
            await r.wakeup.wait()
            r.wakeup.clear()
            if r.closing:
                return
            if r.skipped:
                return  # no whole replica can be freed at this TP on GPUs: the round trains afterwards
            if r.started_at is None:
                mark = r.rule.crossed(len(r.completed))
                if mark is None or not r.rule.should_start(mark, await self._requests_fit()):
                    continue
                await self._start(r, mark)
                if r.skipped:
                    return
            # Drain in chunks; groups that complete meanwhile wait for the next pass.
            while not r.closing and len(r.completed) - r.sent >= self.scfg.min_new_groups:
                groups, r.sent = r.completed[r.sent:], len(r.completed)
                await self._train(r, groups, r.replicas)

    async def _requests_fit(self) -> bool:
        """Do the running requests fit on the engines left after the release?"""
        if self.scfg.release_engines == 0:
            return True
        staying = self.loop.engine.active_engines - self.scfg.release_engines
        if staying < 1:
            return True  # nothing will be released (see _start): no reason to wait
        stats = await self.loop.engine.stats()
        return stats.running + stats.waiting <= staying * self.cfg.rollout.max_num_seqs

    def _release_units(self) -> tuple[list[ReleaseUnit], int]:
        """The release units of the engines as they run now (the planner may have changed their TP),
        and how many engines that is."""
        tp = self.loop.engine.tensor_parallel_size
        devices = self.cfg.rollout.tensor_parallel_size * self.cfg.rollout.num_engines
        layout = run_layout(self.cfg, rollout_tp=tp, num_engines=devices // tp)
        p = self.cfg.parallel
        replicas = replica_ranks(p.tensor_model_parallel_size, p.context_parallel_size, p.data_parallel_size,
                                 p.pipeline_model_parallel_size)
        return release_units(layout, replicas), len(layout.engine_gpus)

    async def _start(self, r: _Round, mark: float) -> None:
        r.started_at = self.clock()
        # Groups can complete in a burst, so the completed fraction may lie past the mark.
        r.start_fraction, r.start_mark = len(r.completed) / r.total_groups, mark
        if self.scfg.release_engines == 0 and not self.loop.colocation.on_cpu and self._release_units()[0]:
            r.skipped = ("stream.release_engines=0 with colocated GPUs: the trainer cannot come back beside the engines "
                         "that generate on its GPUs")
            log.warning("step %d: not streaming: %s", r.step, r.skipped)
            return
        if self.scfg.release_engines > 0:
            units, engines = self._release_units()
            if self.loop.engine.active_engines < engines:
                # A member is being replaced (dead, restarting): a release now could take the engines that
                # serve. The round streams without a handoff on CPU and trains after its rollout on GPUs.
                log.info("step %d: %d of %d engines active (a member is being replaced): none released", r.step,
                         self.loop.engine.active_engines, engines)
                r.release = {"released_engines": 0.0}
                if not self.loop.colocation.on_cpu:
                    r.skipped = "a member was being replaced when streaming would have started"
            else:
                await self._release(r, units, engines)
            if r.skipped:
                return
        log.info("step %d: streaming %s round at %.0f%% of prompts complete", r.step, r.round_type,
                 100 * r.start_fraction)

    async def _release(self, r: _Round, units: list[ReleaseUnit], engines: int) -> None:
        """Lend ``stream.release_engines`` engines whose GPUs are whole replicas (see the module docstring)."""
        try:
            chosen = choose_release(units, self.scfg.release_engines, engines, await self._engine_load(engines))
        except ReleaseError as exc:
            if self.loop.colocation.on_cpu and engines > self.scfg.release_engines:
                # On CPU the trainer may share the cores, so no whole replica need be freed: the engines
                # holding the fewest requests go and every replica streams on the freed cores.
                load = await self._engine_load(engines) or [0.0] * engines
                engines_out = sorted(sorted(range(engines), key=lambda e: (load[e], -e))[:self.scfg.release_engines])
                r.release = await self.loop.colocation.lend_engines(engines_out, None, self.scfg.train_threads)
                log.info("step %d: engines %s released; every trainer replica streams (%s)", r.step, engines_out,
                         exc)
            else:
                # E.g. the elastic planner runs this round as one large-TP engine: a TP group is never
                # split. On GPUs the trainer may not share a generating engine's memory, so the round
                # trains after the rollout.
                log.info("step %d: %d engine(s) at TP %d, none released for streaming (%s)", r.step, engines,
                         self.loop.engine.tensor_parallel_size, exc)
                r.release = {"released_engines": 0.0}
                if not self.loop.colocation.on_cpu:
                    r.skipped = str(exc)
        else:
            engines_out = sorted(e for u in chosen for e in u.engines)
            r.replicas = sorted(rep for u in chosen for rep in u.replicas)
            ranks = sorted(rank for rep in r.replicas for rank in self._replica_ranks()[rep])
            r.release = await self.loop.colocation.lend_engines(engines_out, ranks, self.scfg.train_threads)
            r.release["released_replicas"] = float(len(r.replicas))
            log.info("step %d: engines %s released; trainer replicas %s (ranks %s) train on their GPUs", r.step,
                     engines_out, r.replicas, ranks)

    def _replica_ranks(self) -> list[tuple[int, ...]]:
        p = self.cfg.parallel
        return replica_ranks(p.tensor_model_parallel_size, p.context_parallel_size, p.data_parallel_size,
                             p.pipeline_model_parallel_size)

    async def _engine_load(self, engines: int) -> list[float] | None:
        """Requests routed to each engine now (what a release migrates), when a pool reports them."""
        routed = (await self.loop.engine.stats()).extra.get("routed_in_flight")
        if not isinstance(routed, list) or len(routed) != engines:
            return None
        return [float(n) for n in routed]

    async def _train(self, r: _Round, groups: list[list[Sample]], replicas: list[int] | None) -> None:
        start = self.clock()
        trained = await self.loop.train_groups(groups, replicas=replicas)
        r.trained.extend(trained)
        r.chunks.append(_Chunk(len(groups), len(trained), start, self.clock()))

    async def after_rollout(self, step: int, batch: RolloutBatch) -> dict[str, float]:
        """The round is over: no handoff may begin now. The driver is stopped here, before the loop
        puts the engines to sleep for training (``Colocation.to_training``): a start decided as the
        round ended would otherwise wait for the pool behind that sleep and find no engine awake to
        keep (a release it already began completes first)."""
        r = self.round
        if r is not None and r.step == step:
            r.closing = True
            r.wakeup.set()
            if r.task is not None:
                try:
                    await asyncio.shield(r.task)
                except Exception:  # noqa: S110 - finish() awaits the task again and raises its error there
                    pass
        return {}

    # ------------------------------------------------------------------ trainer side
    def takes_over_training(self, step: int) -> bool:
        return self.streaming(step)

    async def train(self, step: int, batch: RolloutBatch, samples: list[Sample]) -> TrainResult:
        """Finish the streamed step and check it covered exactly ``samples``, each once (a
        streamed gradient cannot be taken back, so a gap or a duplicate is an error)."""
        result = await self.finish(step, batch.groups)
        expected, got = {s.request_id for s in samples}, [s.request_id for s in result.trained]
        if len(got) != len(set(got)) or set(got) != expected:
            missing, extra = expected - set(got), set(got) - expected
            raise RuntimeError(f"stream trainer trained {len(got)} samples, expected {len(expected)} "
                               f"(missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}, "
                               f"duplicates {len(got) - len(set(got))})")
        return result

    async def finish(self, step: int, batch_groups: list[list[Sample]]) -> TrainResult:
        """Train what was not streamed yet, take the optimizer step, give resources back.

        ``batch_groups`` is the scheduler's batch;
        every streamed group must be in it (a streamed gradient cannot be taken back).
        """
        r = self.round
        if r is None or r.step != step:
            raise RuntimeError(f"stream trainer: step {step} is not streaming")
        rollout_end = self.clock()
        r.closing = True
        r.wakeup.set()
        try:
            if r.task is not None:
                await r.task
            in_batch = {g[0].prompt.prompt_id for g in batch_groups}
            streamed = [g[0].prompt.prompt_id for g in r.completed[:r.sent]]
            outside = [pid for pid in streamed if pid not in in_batch]
            if outside:
                raise RuntimeError(f"stream trainer: groups {outside[:3]} were trained but are not in the step's "
                                   "batch; the scheduler must only report groups it keeps")
            sent = set(streamed)
            remaining = [g for g in batch_groups if g[0].prompt.prompt_id not in sent]
            if remaining:
                # Every replica now: split so that the ones that streamed take less and all finish together.
                everyone = None if r.replicas is None else list(range(self.cfg.parallel.data_parallel_size))
                await self._train(r, remaining, everyone)
            train_metrics = await self.loop.apply_gradients(r.trained) if r.trained else {}
        finally:
            await self._give_back(r)
            self.round = None
        return TrainResult(train_metrics, self._metrics(r, rollout_end), list(r.trained))

    async def _give_back(self, r: _Round) -> None:
        if r.task is not None and not r.task.done():
            r.task.cancel()
        if r.release.get("released_engines"):
            # If the whole pool sleeps through training (rollout.sleep_during_train), the pool
            # keeps the restored engines asleep until the weight sync's wake_up.
            await self.loop.colocation.return_engines()

    def _metrics(self, r: _Round, rollout_end: float) -> dict[str, float]:
        total = max(1, len(r.trained))
        before = sum(c.samples for c in r.chunks if c.end <= rollout_end)
        hidden = sum(max(0.0, min(c.end, rollout_end) - c.start) for c in r.chunks)
        exposed = sum(max(0.0, c.end - max(c.start, rollout_end)) for c in r.chunks)
        m = {
            "stream/started": float(r.started_at is not None),
            "stream/start_fraction": r.start_fraction,
            "stream/start_mark": r.start_mark,
            "stream/start_time_s": (r.started_at - r.start_time) if r.started_at is not None else -1.0,
            "stream/chunks": float(len(r.chunks)),
            "stream/trained_fraction_before_rollout_end": before / total,
            "stream/hidden_train_s": hidden,
            "stream/exposed_train_s": exposed,
        }
        for key in ("released_engines", "released_replicas", "migrated_requests", "migrated_tokens", "release_s"):
            if key in r.release:
                m[f"stream/{key}"] = float(r.release[key])
        return m
