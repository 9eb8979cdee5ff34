"""Rollout engines that can be rebuilt at another tensor-parallel size between rounds.

:class:`ElasticRollout` is a :class:`RolloutEngine` holding the engines of the current TP (one
engine, or a pool of ``devices / TP`` engines). :meth:`ElasticRollout.switch` shuts them down,
has the current weights written for the new TP (in the run: per-rank shards moved by the
resharder, tagged with the policy version, see ``megatron_rl.resharding.rollout_shards``) and
starts engines of the new TP on the same devices from them, so rollout stays on-policy across a
switch. Completions of every generation of engines flow through one queue, so a consumer's
``completions()`` iterator survives a switch.

Switching is only legal with no request in flight (between rounds); the engines are built by a
factory so the same class drives Ray/vLLM engines in the run and fakes in unit tests. In the run
the factory is the run's ``engine_factory.EngineFactory``: the new engines are a supervised pool
sharing the run's restart budget and weight restorer, so engines started by a switch are replaced
when they die exactly like the first ones (``supervise`` and ``recover`` reach the current pool
through this wrapper's forwards).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

from megatron_rl.rollout.engine import (
    CUMULATIVE_COUNTERS,
    Completion,
    EngineStats,
    GenerationRequest,
    RolloutEngine,
    forward_completions,
    read_completions,
)
from megatron_rl.rollout.engine_wrapper import ForwardingEngine

log = logging.getLogger(__name__)

EngineFactory = Callable[[int, str], Awaitable[RolloutEngine]]
"""``factory(tp, model_dir)``: the engines for a TP size on the rollout devices (``devices // tp``
engines), started from the weights in ``model_dir``."""

WeightsWriter = Callable[[int], Awaitable[tuple[str, dict[str, float]]]]
"""``write(tp)``: writes the current weights for engines of TP ``tp``; returns the directory to
start them from and figures for the switch's metrics."""

WeightsLoader = Callable[[RolloutEngine], Awaitable[dict[str, float]]]
"""``load(engines)``: brings freshly started engines to the current weights (a tensor push);
returns figures for the switch's metrics."""


class ElasticRollout(ForwardingEngine):
    """The current engines plus the ability to rebuild them at another TP (see module docstring).
    Every contract member not defined here (abort, weights, sleep, health, pool handoff) goes to
    the current engines (``ForwardingEngine``)."""

    def __init__(self, engine: RolloutEngine, tp: int, factory: EngineFactory) -> None:
        super().__init__(engine)
        self.tp = tp
        self._factory = factory
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pump: asyncio.Task | None = None
        self._in_flight: set[str] = set()
        self._counts_before = dict.fromkeys(CUMULATIVE_COUNTERS, 0)
        """Preemptions, decode steps and draft counts of engines that were shut down (stats stay
        cumulative)."""
        self.switches = 0

    @property
    def tensor_parallel_size(self) -> int:
        """The current engines' TP (changes with :meth:`switch`)."""
        return self.tp

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            # An engine failure goes onto the same queue, so the consumer's iterator raises it.
            self._pump = asyncio.get_running_loop().create_task(
                forward_completions(self._engine, self._queue.put_nowait, self._queue.put_nowait))

    async def submit(self, request: GenerationRequest) -> None:
        await self._tracked([request.request_id], lambda: self._engine.submit(request))

    async def submit_all(self, requests: list[GenerationRequest]) -> None:
        await self._tracked([r.request_id for r in requests], lambda: self._engine.submit_all(requests))

    async def _tracked(self, ids: list[str], send: Callable[[], Awaitable[None]]) -> None:
        """``await send()`` with ``ids`` counted in flight from before it (a completion can come back
        before the send returns); a send that fails takes them off again."""
        self._ensure_pump()
        self._in_flight.update(ids)
        try:
            await send()
        except BaseException:
            self._in_flight.difference_update(ids)
            raise

    async def completions(self) -> AsyncIterator[Completion]:
        self._ensure_pump()
        async for completion in read_completions(self._queue):
            self._in_flight.discard(completion.request_id)
            yield completion

    async def stats(self) -> EngineStats:
        st = await self._engine.stats()
        for key, before in self._counts_before.items():
            setattr(st, key, getattr(st, key) + before)
        st.extra = dict(st.extra, tensor_parallel_size=self.tp, switches=self.switches)
        return st

    async def shutdown(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        await self._engine.shutdown()

    async def switch(self, tp: int, write_weights: WeightsWriter,
                     load_weights: WeightsLoader | None = None) -> dict[str, float]:
        """Rebuild the engines at ``tp`` from what ``write_weights(tp)`` writes, then, when given,
        ``load_weights(new_engines)`` (a tensor push into engines started without weights). The
        old engines are shut down first, so on a colocated GPU their memory is free while the
        trainer exports. Returns ``{'switch_s', 'old_tp', 'new_tp'}`` plus the writer's and the
        loader's figures."""
        if self._in_flight:
            raise RuntimeError(f"elastic rollout: cannot switch TP with {len(self._in_flight)} requests in flight "
                               f"(e.g. {sorted(self._in_flight)[:3]}); switch between rounds")
        start = time.monotonic()
        old_tp = self.tp
        # Keep the cumulative counts monotonic for whoever diffs them across rounds.
        old = await self._engine.stats()
        for key in CUMULATIVE_COUNTERS:
            self._counts_before[key] += getattr(old, key)
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        await self._engine.shutdown()
        model_dir, figures = await write_weights(tp)
        self._engine = await self._factory(tp, model_dir)
        self.tp = tp
        if load_weights is not None:
            figures = {**figures, **await load_weights(self._engine)}
        self.switches += 1
        elapsed = time.monotonic() - start
        log.info("rollout TP %d -> %d in %.1f s (engines started from %s)", old_tp, tp, elapsed, model_dir)
        return {**figures, "switch_s": elapsed, "old_tp": float(old_tp), "new_tp": float(tp)}
