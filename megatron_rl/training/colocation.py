"""The one owner of device memory shared by the trainer and the rollout engines.

On a colocated GPU the trainer's state and the engines' weights + KV cache do not fit at once, so
every phase of a step moves memory in a fixed order. This module is the only place that order is
written down; the loop, the weight sync and plug-ins ask for named transitions:

* :meth:`Colocation.to_training` (after the rollout): engines sleep (``rollout.sleep_during_train``)
  *then* the trainer comes back (``trainer.offload_during_rollout``).
* :meth:`Colocation.to_rollout` (after the new weights left the trainer): the trainer is offloaded
  *then* the engines wake up. :meth:`offload_trainer` and :meth:`wake_engines` are its two halves.
  The weight sync splits the wake-up further: :meth:`wake_engine_weights` wakes only the engines'
  weights for the push (a tensor push reads trainer memory, so the trainer is still resident), and
  :meth:`wake_engines` wakes their KV cache after the push, once the trainer is offloaded, so
  trainer state, engine weights and KV cache are never all on a GPU at once
  (``megatron_rl.planning.moments`` checks each of these moments against the GPU's memory).
* Engines sleep through training at ``rollout.sleep_level`` (2 drops the weights the push
  rewrites); every other sleep (a checkpoint save, see :meth:`training_side`) is level 1,
  since no push follows it.
* :meth:`Colocation.trainer_resident` (context): the trainer state is needed while the engines are
  not generating, e.g. to export weights for new engines of another TP (the old ones are shut down).
* :meth:`Colocation.training_side` (context): like ``to_training`` and back again afterwards, for
  a checkpoint save between steps.
* :meth:`Colocation.lend_engines` / :meth:`return_engines`: during a round, hand whole engines to
  the trainer (the stream trainer trains on completed groups meanwhile): the engines' requests
  migrate, they sleep at level 2 (the push after the step refills their weights), and only the
  trainer ranks on their GPUs (whole data-parallel replicas, ``distributed.replica_release``) come
  back and, on CPU, get the freed cores as threads. The other ranks stay offloaded beside the
  engines that keep generating, so a GPU holds a generating engine or the trainer, never both;
  they come back with :meth:`to_training` after the round.

It tracks which trainer ranks are resident, so repeated requests (every streamed chunk) cost
nothing, and records every transition it made (``log``) for tests and debugging. With neither
option set, every transition is free and does nothing.
"""
from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator, Awaitable, Callable, Protocol

from megatron_rl.config.schema import RunConfig
from megatron_rl.rollout.engine import RolloutEngine


class MovablePolicy(Protocol):
    """The trainer ranks as far as device memory goes (``PolicyGroup`` implements it)."""

    async def free_grad_buffers(self) -> dict: ...
    async def offload_for_rollout(self) -> dict: ...
    async def reload_for_training(self, ranks: list[int] | None = None) -> dict: ...
    async def set_num_threads(self, n: int, ranks: list[int] | None = None) -> None: ...


class Colocation:
    """Named memory transitions between trainer and engines (see the module docstring)."""

    def __init__(self, cfg: RunConfig, policy: MovablePolicy, engine: RolloutEngine, on_cpu: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.offload = cfg.trainer.offload_during_rollout
        self.sleep = cfg.rollout.sleep_during_train
        self.sleep_level = cfg.rollout.sleep_level
        self.policy = policy
        self.engine = engine
        self.on_cpu = on_cpu
        self.clock = clock
        self.trainer_is_resident = not self.offload
        """Every trainer rank is resident (train.py offloads the freshly loaded trainer when
        offload_during_rollout is set)."""
        self.resident_ranks: frozenset[int] = frozenset()
        """While not every rank is: the ranks brought back on their own (a lent engine's replicas)."""
        self.trainer_grads_freed = False
        """Only the trainer's grad buffers are off the GPU (:meth:`free_trainer_grads`)."""
        self.engines_awake = True
        self.engine_weights_awake = True
        """The engines' weights are on the device (also while their KV cache still sleeps)."""
        self.lent_threads = 0
        self.lent_ranks: list[int] | None = None
        """The trainer ranks that got the freed cores (None: every rank)."""
        self.log: list[str] = []
        """Every memory move made, in order ('engine.sleep', 'trainer.reload', ...)."""

    # ------------------------------------------------------------------ the two halves of a step
    async def to_training(self, level: int | None = None) -> dict[str, float]:
        """After the rollout: engines sleep (at ``rollout.sleep_level`` unless ``level`` says
        otherwise), then the trainer comes back. Returns timings."""
        timings: dict[str, float] = {}
        if self.sleep:
            timings["time/engine_sleep"] = await self._timed(lambda: self._sleep_engines(level or self.sleep_level))
        if self.offload:
            timings["time/trainer_reload"] = await self._timed(lambda: self._set_trainer(True))
        return timings

    async def to_rollout(self) -> None:
        """The new weights are out of the trainer: offload it, then wake the engines."""
        await self.offload_trainer()
        await self.wake_engines()

    async def offload_trainer(self) -> None:
        """First half of :meth:`to_rollout`: move the trainer state out (when configured)."""
        if self.offload:
            await self._set_trainer(False)

    async def free_trainer_grads(self) -> None:
        """Before a push that reads the trainer's weights: free only its grad buffers (with
        ``trainer.offload_during_rollout``: the reload before training restores them), so the
        engines' woken weights and the push staging have their room."""
        if self.offload and self.trainer_is_resident and not self.trainer_grads_freed:
            self.log.append("trainer.free_grads")
            await self.policy.free_grad_buffers()
            self.trainer_grads_freed = True

    async def wake_engine_weights(self) -> None:
        """Only the engines' weights back (vLLM ``wake_up(tags=["weights"])``), for a weight push
        or reload; :meth:`wake_engines` brings the KV cache after it."""
        if self.sleep and not self.engine_weights_awake:
            self.log.append("engine.wake_up(weights)")
            await self.engine.wake_up(["weights"])
            self.engine_weights_awake = True

    async def wake_engines(self) -> None:
        """Second half of :meth:`to_rollout`: the engines get their memory back (when asleep):
        everything, or the KV cache when :meth:`wake_engine_weights` came first."""
        if self.sleep and not self.engines_awake:
            if self.engine_weights_awake:
                self.log.append("engine.wake_up(kv_cache)")
                await self.engine.wake_up(["kv_cache"])
            else:
                self.log.append("engine.wake_up")
                await self.engine.wake_up()
            self.engines_awake = self.engine_weights_awake = True

    # ------------------------------------------------------------------ between steps
    @contextlib.asynccontextmanager
    async def trainer_resident(self) -> AsyncIterator[None]:
        """The trainer state in device memory for the duration, as it was afterwards (the
        engines must not be generating: e.g. an elastic-TP export with the old engines shut down)."""
        was = self.trainer_is_resident
        await self._set_trainer(True)
        try:
            yield
        finally:
            await self._set_trainer(was)

    @contextlib.asynccontextmanager
    async def training_side(self) -> AsyncIterator[None]:
        """Trainer resident for the duration (a checkpoint save), the engines asleep first when it
        has to come back; then the state before restored in the reverse order. Free when the
        trainer never leaves (no ``trainer.offload_during_rollout``)."""
        if self.trainer_is_resident:
            yield
            return
        was_resident, was_awake = self.trainer_is_resident, self.engines_awake
        await self.to_training(level=1)  # no push follows: the engines must keep their weights
        try:
            yield
        finally:
            await self._set_trainer(was_resident)
            if was_awake:
                await self.wake_engines()

    # ------------------------------------------------------------------ during a round
    async def lend_engines(self, engines: list[int], ranks: list[int] | None = None,
                           train_threads: int = 0) -> dict[str, float]:
        """Hand ``engines`` (pool members) to the trainer mid-round: their requests migrate to the others
        and they sleep at level 2 (``RolloutEngine.release_engines``; the weight push after the step
        refills them); then the trainer ranks on their GPUs (``ranks``; None: every rank, the trainer
        shares no GPU with the engines) come back, and on CPU get ``train_threads`` torch threads (the
        freed cores). Returns the release figures."""
        figures = dict(await self.engine.release_engines(len(engines), members=list(engines), level=2))
        self.log.append(f"engine.release({','.join(map(str, engines))})")
        await self.make_trainer_resident(ranks)
        if self.on_cpu and train_threads:
            await self._threads(train_threads, ranks)
            self.lent_threads, self.lent_ranks = train_threads, None if ranks is None else list(ranks)
        return figures

    async def return_engines(self) -> None:
        """Undo :meth:`lend_engines`: the trainer's threads back to one, the engines routed to
        again (asleep while the whole pool sleeps through training, see ``engine_pool``)."""
        await self.engine.restore_engines()
        self.log.append("engine.restore")
        if self.lent_threads:
            await self._threads(1, self.lent_ranks)
            self.lent_threads, self.lent_ranks = 0, None

    async def make_trainer_resident(self, ranks: list[int] | None = None) -> None:
        """The trainer is about to compute during a round (streamed chunks) or load a checkpoint: bring back
        ``ranks`` (None: every rank) if offloaded; free when they already are."""
        await self._set_trainer(True, ranks)

    async def _threads(self, n: int, ranks: list[int] | None) -> None:
        if ranks is None:
            await self.policy.set_num_threads(n)
        else:
            await self.policy.set_num_threads(n, ranks=list(ranks))
        self.log.append(f"trainer.threads({n})" + ("" if ranks is None else f" ranks {','.join(map(str, ranks))}"))

    # ------------------------------------------------------------------ the moves themselves
    async def _sleep_engines(self, level: int) -> None:
        if self.engines_awake:
            self.log.append("engine.sleep" if level == 1 else f"engine.sleep(level {level})")
            await self.engine.sleep(level)
            self.engines_awake = self.engine_weights_awake = False

    async def _set_trainer(self, resident: bool, ranks: list[int] | None = None) -> None:
        if resident and ranks is not None and not self.trainer_is_resident:
            missing = sorted(set(ranks) - self.resident_ranks)  # some ranks only: a lent engine's replicas
            if missing:
                self.log.append(f"trainer.reload(ranks {','.join(map(str, missing))})")
                await self.policy.reload_for_training(ranks=missing)
                self.resident_ranks = self.resident_ranks | frozenset(missing)
            return
        if resident and self.trainer_is_resident and not self.trainer_grads_freed:
            return
        if not resident and not self.trainer_is_resident and not self.resident_ranks:
            return
        if resident:  # every rank (those already back reload nothing)
            self.log.append("trainer.reload")
            await self.policy.reload_for_training()
        else:
            self.log.append("trainer.offload")
            await self.policy.offload_for_rollout()
        self.trainer_is_resident, self.trainer_grads_freed, self.resident_ranks = resident, False, frozenset()

    async def _timed(self, move: Callable[[], Awaitable[None]]) -> float:
        start = self.clock()
        await move()
        return self.clock() - start
