"""A rollout engine that is replaced when it dies, with its unfinished requests submitted again.

:class:`RestartingEngine` wraps the run's engines (one engine, or a pool: a death anywhere in it
replaces the whole pool) and keeps every request it was given until that request's completion
came back. When the engines die (an engine-core process killed, out of memory, its Ray actor
lost), the death is noticed by whichever comes first: the completion stream failing (vLLM
reports an engine core's exit within a second), a submit or abort failing on an engine that then
also fails its health check, or the periodic health check that runs while requests are in flight
(``rollout.engine_health_check_s``, each answer bounded by ``rollout.engine_health_timeout_s``).

The replacement: the dead engines are shut down (their actor killed, the shared memory their
processes left in /dev/shm removed, see ``ray_engine``), ``start()`` builds new ones on the same
placement, ``restore_weights(new)`` brings them to the current policy version (the loop sets it:
a push, or a reload of the weight directory), and every request without a completion is
submitted again from its prompt with its own seed. Completions that already came back are kept,
so a step loses only the unfinished work; the new engine's completions carry the same policy
version, so the step stays on-policy. Requests the consumer had aborted end with an empty 'abort'
completion instead of running again. After ``max_restarts`` replacements the next death is
raised from ``completions()`` (the run stops, naming the cause).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from megatron_rl.aio import wait_for
from megatron_rl.rollout.engine import (
    CUMULATIVE_COUNTERS,
    Completion,
    EngineStats,
    GenerationRequest,
    RolloutEngine,
    read_completions,
)
from megatron_rl.rollout.engine_wrapper import ForwardingEngine

log = logging.getLogger(__name__)

EngineStarter = Callable[[], Awaitable[RolloutEngine]]
"""``start()``: new engines like the dead ones (same TP, count and placement)."""

WeightsRestorer = Callable[[RolloutEngine], Awaitable[dict]]
"""``restore(new_engines)``: bring freshly started engines to the current policy version."""

_SHUTDOWN_WAIT_S = 30.0
"""Longest wait for a dead engine's shutdown (its actor is killed either way)."""


class EngineRestartsExhausted(RuntimeError):
    """The engines died more often than ``rollout.max_engine_restarts`` allows."""


@dataclass
class RestartRecord:
    """One replacement of the engines."""

    cause: str
    """The error that revealed the death."""
    detected_at: float
    """time.monotonic() when the death was noticed."""
    restart_s: float = 0.0
    """From noticing the death until the new engines held the resubmitted requests."""
    resubmitted: int = 0
    """Requests submitted again from their prompts."""
    aborted: int = 0
    """Requests the consumer had aborted, ended with an empty 'abort' completion instead."""


class RestartingEngine(ForwardingEngine):
    """The run's engines, replaced when they die (see the module docstring). Contract members not
    defined here (weights, sleep, health, pool handoff) go to the engines running now, once a
    replacement under way is up (``ForwardingEngine``, through :meth:`_forward_target`).

    Args:
        engine: the engines now running.
        start: builds replacements (``EngineStarter``).
        max_restarts: replacements allowed within the run (``rollout.max_engine_restarts``).
        health_check_s: health-check period while requests are in flight.
    """

    def __init__(self, engine: RolloutEngine, start: EngineStarter, *, max_restarts: int = 3,
                 health_check_s: float = 2.0) -> None:
        super().__init__(engine)
        self._start = start
        self.max_restarts = max_restarts
        self.health_check_s = health_check_s
        self.restore_weights: WeightsRestorer | None = None
        """Set by the loop; None leaves new engines with the weights they start from."""
        self._requests: dict[str, GenerationRequest] = {}  # submitted, no completion yet
        self._aborted: set[str] = set()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._generation = 0  # bumped per replacement: a dead engine's late output is dropped
        self._pump: asyncio.Task | None = None
        self._monitor: asyncio.Task | None = None
        self._recovery: asyncio.Task | None = None
        self._failed: Exception | None = None
        self._closed = False
        self._last_version = 0
        self._last_stats = EngineStats()
        self._counts_before = dict.fromkeys(CUMULATIVE_COUNTERS, 0)
        self.restarts: list[RestartRecord] = []
        self._reported_s = 0.0

    # ------------------------------------------------------------------ supervision
    def _ensure_tasks(self) -> None:
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._forward(self._engine, self._generation))
        if self._monitor is None and self.health_check_s > 0:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def _forward(self, engine: RolloutEngine, generation: int) -> None:
        try:
            async for completion in engine.completions():
                if generation != self._generation:
                    return
                if self._requests.pop(completion.request_id, None) is None:
                    continue  # a dead engine's duplicate of a request already answered
                self._aborted.discard(completion.request_id)
                self._last_version = completion.weight_version
                self._queue.put_nowait(completion)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if generation != self._generation:
                return
            if await self._is_dead(engine, tries=3):
                self._died(exc, generation)
            elif generation == self._generation:  # a failure of the engine's own (a rejected request): the consumer's error
                self._queue.put_nowait(exc)

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_check_s)
            if not self._requests or self._recovering() or self._failed is not None:
                continue
            generation = self._generation
            try:
                await self._engine.check_health()
            except Exception as exc:
                self._died(exc, generation)

    def _recovering(self) -> bool:
        return self._recovery is not None and not self._recovery.done()

    def _died(self, exc: BaseException, generation: int) -> None:
        """The engines of ``generation`` are dead: start their replacement, once per death (a
        late report about engines already replaced is ignored)."""
        if generation != self._generation or self._closed or self._recovering() or self._failed is not None:
            return
        record = RestartRecord(cause=f"{type(exc).__name__}: {exc}"[:300], detected_at=time.monotonic())
        log.warning("rollout engine died (%s) with %d request(s) unfinished", record.cause, len(self._requests))
        self._recovery = asyncio.get_running_loop().create_task(self._replace(record))

    @staticmethod
    async def _is_dead(engine: RolloutEngine, tries: int = 1) -> bool:
        """Whether ``engine`` fails its health check (``tries`` times half a second apart: a
        stream that just failed may be ahead of the engine marking itself dead)."""
        for attempt in range(tries):
            try:
                await engine.check_health()
            except Exception:
                return True
            if attempt + 1 < tries:
                await asyncio.sleep(0.5)
        return False

    async def _replace(self, record: RestartRecord) -> None:
        if len(self.restarts) >= self.max_restarts:
            self._fail(EngineRestartsExhausted(
                f"the rollout engine died again ({record.cause}) after {len(self.restarts)} restart(s) in this run "
                f"(rollout.max_engine_restarts={self.max_restarts}): stopping"))
            return
        self._generation += 1
        old = self._engine
        for key in CUMULATIVE_COUNTERS:  # keep the counters monotonic for whoever diffs them
            self._counts_before[key] += getattr(self._last_stats, key)
        self._last_stats = EngineStats()
        try:
            await wait_for(old.shutdown(), timeout=_SHUTDOWN_WAIT_S)
        except Exception as exc:  # it is dead: its shutdown may fail, its actor is killed anyway
            log.info("shutdown of the dead engine: %r", exc)
        try:
            new = await self._start()
            if self.restore_weights is not None:
                await self.restore_weights(new)
        except Exception as exc:
            self._fail(RuntimeError(f"replacing the dead rollout engine ({record.cause}) failed: {exc!r}"))
            return
        self._engine = new
        self._pump = asyncio.get_running_loop().create_task(self._forward(new, self._generation))
        # Taken and submitted with no await in between the snapshot and the hand-over: a submit
        # that arrives from now on goes straight to the new engine.
        pending = [r for rid, r in self._requests.items() if rid not in self._aborted]
        for rid in sorted(self._aborted):
            if self._requests.pop(rid, None) is not None:
                self._queue.put_nowait(Completion(rid, [], [], "abort", self._last_version))
                record.aborted += 1
        self._aborted.clear()
        self.restarts.append(record)
        self._recovery = None
        results = await asyncio.gather(*(new.submit(r) for r in pending), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._fail(RuntimeError(f"resubmitting {len(errors)} request(s) to the new rollout engine failed: "
                                    f"{errors[0]!r}"))
            return
        record.resubmitted = len(pending)
        record.restart_s = time.monotonic() - record.detected_at
        log.warning("rollout engine replaced in %.1f s (restart %d of at most %d): %d request(s) resubmitted, "
                    "%d aborted ones ended", record.restart_s, len(self.restarts), self.max_restarts,
                    record.resubmitted, record.aborted)

    async def recover_if_dead(self, exc: BaseException) -> bool:
        """After a call through this engine failed with ``exc`` (e.g. a weight push, which a
        replacement cannot retry from inside): replace the engines when they are dead and return
        True once the new ones are up (restored to the current weights); False when they are
        healthy (``exc`` was not a death). Raises when replacing failed or the budget is spent."""
        if self._failed is not None:
            raise self._failed
        if not self._recovering():
            if not await self._is_dead(self._engine, tries=3):
                return False
            self._died(exc, self._generation)
        await self._settled()
        return True

    def _fail(self, exc: Exception) -> None:
        self._failed = exc
        self._queue.put_nowait(exc)

    async def _settled(self) -> RolloutEngine:
        """The engine to call: waits for a replacement under way; raises once replacing failed."""
        if self._recovery is not None:
            await asyncio.shield(self._recovery)
        if self._failed is not None:
            raise self._failed
        return self._engine

    async def _forward_target(self) -> RolloutEngine:
        """Where ``ForwardingEngine`` sends a forwarded call: the settled engine."""
        return await self._settled()

    def step_metrics(self) -> dict[str, float]:
        """``fault/engine_restarts`` (in the run so far) and ``fault/seconds_lost`` (restart time
        since the last call: the time the step waited for replacements)."""
        total = sum(r.restart_s for r in self.restarts)
        lost, self._reported_s = total - self._reported_s, total
        return {"fault/engine_restarts": float(len(self.restarts)), "fault/seconds_lost": lost}

    # ------------------------------------------------------------------ requests
    async def submit(self, request: GenerationRequest) -> None:
        if self._failed is not None:
            raise self._failed
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self._ensure_tasks()
        self._requests[request.request_id] = request
        if self._recovering():
            return  # the replacement submits it with the rest
        engine, generation = self._engine, self._generation
        try:
            await engine.submit(request)
        except Exception as exc:
            # Kept in _requests: the replacement (started now, or since the call began) submits it.
            if generation != self._generation:
                return
            if await self._is_dead(engine):
                self._died(exc, generation)
                return
            self._requests.pop(request.request_id, None)
            raise

    def completions(self) -> AsyncIterator[Completion]:
        return self._read()

    async def _read(self) -> AsyncIterator[Completion]:
        self._ensure_tasks()
        async for completion in read_completions(self._queue, keep_failure=True):  # every reader sees a failure
            yield completion

    async def abort(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._requests]
        self._aborted.update(ids)
        if not ids or self._recovering():
            return  # the replacement ends them
        engine, generation = self._engine, self._generation
        try:
            await engine.abort(ids)
        except Exception as exc:
            if generation != self._generation:
                return  # the replacement ends them
            if await self._is_dead(engine):
                self._died(exc, generation)
                return
            raise

    # ------------------------------------------------------------------ stats
    async def stats(self) -> EngineStats:
        engine, generation = await self._settled(), self._generation
        try:
            st = await engine.stats()
        except Exception as exc:  # e.g. the first call of a step on engines that died while idle
            if generation == self._generation:
                if not await self._is_dead(engine):
                    raise
                self._died(exc, generation)
            engine = await self._settled()  # the replacement (raises when replacing failed)
            st = await engine.stats()
        if engine is self._engine:
            self._last_stats = EngineStats(**{k: getattr(st, k) for k in CUMULATIVE_COUNTERS})
        for key, before in self._counts_before.items():
            setattr(st, key, getattr(st, key) + before)
        st.extra = dict(st.extra, engine_restarts=len(self.restarts))
        return st

    async def shutdown(self) -> None:
        self._closed = True
        for task in (self._monitor, self._pump, self._recovery):
            if task is not None and not task.done():
                task.cancel()
        await self._engine.shutdown()
