"""EnginePool: several rollout engines behind one :class:`RolloutEngine`, with resource handoff.

Routing is least-loaded by this pool's own request count. For RollPacker's stream trainer the
pool can also shrink mid-round: :meth:`EnginePool.release_engines` takes whole engines (one engine
is one TP group, so a group is never split) out of routing, migrates their running requests to
the remaining engines recompute-style (see ``migration``) and puts them to sleep so training can
use their devices; :meth:`EnginePool.restore_engines` (implied by ``reload_weights``) brings them
back. The pool as a whole can also sleep (:meth:`EnginePool.sleep`, e.g. through training); while
it does, restored engines rejoin routing asleep and the pool's :meth:`EnginePool.wake_up` wakes
them with the rest, so the order of restore and sleep does not matter to the caller.

Two id spaces: the consumer's request ids, and the ids of the *parts* running on engines. A
request that never moved has one part under its own id; each migration starts a new part under
a fresh id. Completions of parts are handled by one pump task per engine, independently of the
consumer, so a migration proceeds even while nobody reads ``completions()``; the consumer only
ever sees one merged Completion per request id.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from megatron_rl.aio import wait_for
from megatron_rl.rollout.engine import (
    CUMULATIVE_COUNTERS,
    Completion,
    EngineStats,
    GenerationRequest,
    RolloutEngine,
    forward_completions,
    read_completions,
)
from megatron_rl.rollout.migration import MigrationRecord

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    """One consumer request in flight: its record and where its current part runs."""

    record: MigrationRecord
    engine: int
    """Index of the engine running the current part."""
    part_id: str
    """The current part's request id on that engine."""
    submitting: bool = True
    """The current part's submit() has not returned: aborts for it are sent once it does."""
    migrating: bool = False
    """Aborted on a released engine; its partial completion is awaited to continue elsewhere."""
    aborted: bool = False
    """The consumer aborted it: it is never resubmitted again."""


class EnginePool(RolloutEngine):
    """Several engines behind one :class:`RolloutEngine`: least-loaded routing by request count.

    Each request goes to the active engine with the fewest of this pool's requests in flight
    (ties to the lowest index); aborts go to wherever the request currently runs; weights reload
    on all engines at once (released ones are woken first).

    Args:
        engines: the engines; each is one whole TP group.
        drain_timeout_s: how long :meth:`release_engines` waits for the released engines'
            aborted requests to come back before giving up.
    """

    def __init__(self, engines: Sequence[RolloutEngine], drain_timeout_s: float = 300.0) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self.drain_timeout_s = drain_timeout_s
        self._entries: dict[str, _Entry] = {}  # consumer request id -> entry
        self._by_part: dict[str, str] = {}  # part id on an engine -> consumer request id
        self._load = [0] * len(self.engines)
        self._released: set[int] = set()  # not routed to
        self._sleeping: set[int] = set()
        self._asleep = False
        """The pool sleeps: :meth:`sleep` was called and :meth:`wake_up` not since."""
        self._weights_awake = False
        """``wake_up(["weights"])`` woke every sleeping engine's weights (for a push); the KV
        caches still sleep and nothing is routed until ``wake_up`` of the rest."""
        self._merged: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._resubmits: set[asyncio.Task] = set()
        self._changed = asyncio.Event()  # set whenever a part leaves an engine
        self._lock = asyncio.Lock()  # one release / restore / reload at a time
        self._part_ids = itertools.count(1)
        self._totals = {"migrated_requests": 0, "migrated_tokens": 0, "ended_while_migrating": 0}

    # ------------------------------------------------------------------ routing and bookkeeping

    @property
    def active_engines(self) -> int:
        """How many engines receive requests now (not released, not asleep)."""
        return len(self._active())

    @property
    def released_indices(self) -> list[int]:
        """Indices of the engines taken out of routing by :meth:`release_engines`."""
        return sorted(self._released)

    def _active(self) -> list[int]:
        return [i for i in range(len(self.engines)) if i not in self._released and i not in self._sleeping]

    def _pick(self) -> int:
        active = self._active()
        if not active:
            raise RuntimeError("EnginePool: no active engine (all released or asleep); wake_up() first")
        return min(active, key=lambda i: (self._load[i], i))

    def _place(self, entry: _Entry, index: int, part_id: str) -> None:
        entry.engine, entry.part_id, entry.submitting = index, part_id, True
        self._by_part[part_id] = entry.record.original.request_id
        self._load[index] += 1

    def _unplace(self, entry: _Entry) -> None:
        """The current part left its engine (finished, aborted, or never got there)."""
        if self._by_part.pop(entry.part_id, None) is not None:
            self._load[entry.engine] -= 1
        self._changed.set()

    def _is_current(self, entry: _Entry, part_id: str) -> bool:
        return self._entries.get(entry.record.original.request_id) is entry and entry.part_id == part_id

    def _new_part_id(self, request_id: str) -> str:
        while True:
            part_id = f"{request_id}#m{next(self._part_ids)}"
            if part_id not in self._by_part and part_id not in self._entries:
                return part_id

    def _ensure_pumps(self) -> None:
        # Started lazily: the pool is often built before an event loop runs.
        if not self._pumps:
            self._pumps = [asyncio.create_task(self._pump(i)) for i in range(len(self.engines))]

    # ------------------------------------------------------------------ requests

    @property
    def tensor_parallel_size(self) -> int:
        return self.engines[0].tensor_parallel_size

    async def submit(self, request: GenerationRequest) -> None:
        """Route to the least-loaded active engine."""
        rid = request.request_id
        if rid in self._entries or rid in self._by_part:
            raise ValueError(f"request_id {rid!r} is already in flight")
        self._ensure_pumps()
        entry = _Entry(MigrationRecord(request), engine=-1, part_id=rid)
        self._place(entry, self._pick(), rid)
        self._entries[rid] = entry
        try:
            await self.engines[entry.engine].submit(request)
        except BaseException:
            if self._is_current(entry, rid):
                del self._entries[rid]
                self._unplace(entry)
            raise
        await self._submitted(entry, rid)

    async def _submitted(self, entry: _Entry, part_id: str) -> None:
        """A part's submit returned: send the abort that arrived (or a release that began) meanwhile."""
        if not self._is_current(entry, part_id):
            return  # already finished; its id may even be reused by a new request
        entry.submitting = False
        if entry.aborted or entry.migrating:
            await self.engines[entry.engine].abort([part_id])

    async def _resubmit(self, entry: _Entry, request: GenerationRequest) -> None:
        try:
            await self.engines[entry.engine].submit(request)
        except Exception as exc:
            # The engine rejected a request it should accept: treat it as an engine failure.
            if self._is_current(entry, request.request_id):
                del self._entries[entry.record.original.request_id]
                self._unplace(entry)
            self._merged.put_nowait(RuntimeError(
                f"migrating request {entry.record.original.request_id!r} to engine {entry.engine} failed: {exc!r}"
            ))
            return
        await self._submitted(entry, request.request_id)

    async def _pump(self, index: int) -> None:
        await forward_completions(self.engines[index], self._on_part, self._pump_failed)

    def _pump_failed(self, exc: Exception) -> None:
        """An engine's completion stream died: the consumer gets the error; a release waiting on
        that engine must notice (its pump task is done, see ``_wait_drained``)."""
        self._merged.put_nowait(exc)
        self._changed.set()

    def _on_part(self, part: Completion) -> None:
        """One part ended on its engine. Synchronous, so no other state change interleaves."""
        rid = self._by_part.get(part.request_id)
        if rid is None:
            self._merged.put_nowait(part)  # not routed by this pool: pass it on untouched
            return
        entry = self._entries[rid]
        self._unplace(entry)
        final: Completion | Exception
        if entry.migrating and part.finish_reason == "abort" and not entry.aborted:
            entry.record.parts.append(part)
            continuation = entry.record.continuation(self._new_part_id(rid))
            if continuation is not None:
                entry.migrating = False
                self._place(entry, self._pick(), continuation.request_id)
                self._totals["migrated_requests"] += 1
                self._totals["migrated_tokens"] += len(continuation.prompt_ids) - len(entry.record.original.prompt_ids)
                task = asyncio.create_task(self._resubmit(entry, continuation))
                self._resubmits.add(task)
                task.add_done_callback(self._resubmits.discard)
                return
            final = self._merge(entry, None, "length")  # aborted exactly at the budget
        else:
            final = part if not entry.record.parts else self._merge(entry, part, None)
        if entry.migrating:
            self._totals["ended_while_migrating"] += 1
        del self._entries[rid]
        self._merged.put_nowait(final)

    @staticmethod
    def _merge(entry: _Entry, part: Completion | None, reason: str | None) -> Completion | Exception:
        try:
            return entry.record.merged(part, reason)
        except ValueError as exc:  # mixed weight versions: surface it, do not train on it
            return exc

    def completions(self) -> AsyncIterator[Completion]:
        """Completions of all engines in arrival order, one per submitted request id; a migrated
        request's parts arrive merged under its own id."""
        return self._read()

    async def _read(self) -> AsyncIterator[Completion]:
        self._ensure_pumps()
        async for completion in read_completions(self._merged):
            yield completion

    async def abort(self, request_ids: list[str]) -> None:
        """Abort each request wherever it runs now; unknown ids are ignored. A request caught in
        migration is not resubmitted: it ends with its merged partial and reason 'abort'."""
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            entry = self._entries.get(rid)
            if entry is None or entry.aborted:
                continue
            entry.aborted = True
            # A pending submit sends the abort when it returns; a pending migration abort ends it.
            if not entry.submitting and not entry.migrating:
                by_engine.setdefault(entry.engine, []).append(entry.part_id)
        await asyncio.gather(*(self.engines[i].abort(ids) for i, ids in by_engine.items()))

    async def check_health(self) -> None:
        """Every engine's health check; the first failure is raised, naming the engine."""
        results = await asyncio.gather(*(e.check_health() for e in self.engines), return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                raise RuntimeError(f"engine {index} of the pool is not healthy: {result!r}") from result

    # ------------------------------------------------------------------ resource handoff

    async def release_engines(self, count: int) -> dict[str, float]:
        """Hand ``count`` whole engines over to training; the rest finish the round.

        Picks the engines with the fewest of this pool's requests (ties: highest index), stops
        routing to them, aborts their requests and, as each partial comes back, continues it on
        the least-loaded remaining engine with the tokens generated so far re-prefilled (a
        request whose budget is used up ends with reason 'length'). Once the released engines
        hold nothing, they sleep. At least one engine must stay active.

        Returns: released_engines, migrated_requests, migrated_tokens (generated tokens
        re-prefilled instead of regenerated), ended_while_migrating (finished, aborted or out of
        budget instead of moving), release_s.
        """
        async with self._lock:
            active = self._active()
            if not isinstance(count, int) or not 1 <= count < len(active):
                raise ValueError(
                    f"release_engines({count!r}): can release 1..{len(active) - 1} of the {len(active)} "
                    "active engine(s); at least one must stay active"
                )
            self._ensure_pumps()
            start = time.monotonic()
            before = dict(self._totals)
            chosen = sorted(active, key=lambda i: (self._load[i], -i))[:count]
            self._released.update(chosen)
            by_engine: dict[int, list[str]] = {}
            for entry in self._entries.values():
                if entry.engine in chosen and not entry.aborted:
                    entry.migrating = True
                    if not entry.submitting:
                        by_engine.setdefault(entry.engine, []).append(entry.part_id)
            await asyncio.gather(*(self.engines[i].abort(ids) for i, ids in by_engine.items()))
            await self._wait_drained(chosen)
            await asyncio.gather(*(self._sleep_engine(i) for i in chosen))
            metrics = {key: float(self._totals[key] - before[key]) for key in self._totals}
            metrics.update(released_engines=float(count), release_s=time.monotonic() - start)
            logger.info("released engines %s: %s", chosen, metrics)
            return metrics

    async def _wait_drained(self, indices: list[int]) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while True:
            self._changed.clear()  # before the check, so a change after it is not lost
            if not any(self._load[i] for i in indices):
                break
            dead = [i for i in indices if self._pumps[i].done()]
            if dead:
                raise RuntimeError(f"release_engines: engine(s) {dead} failed while draining")
            try:
                await wait_for(self._changed.wait(), timeout=max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                left = {i: self._load[i] for i in indices if self._load[i]}
                raise TimeoutError(f"release_engines: requests still on released engines after "
                                   f"{self.drain_timeout_s} s: {left}") from None
        # Continuations are placed synchronously; wait for their submits so errors surface here.
        while self._resubmits:
            await asyncio.gather(*list(self._resubmits), return_exceptions=True)

    async def restore_engines(self) -> dict[str, float]:
        """Take the released engines back into routing.

        When the pool is awake they (and any other sleeping engine) are woken first. When the
        pool sleeps (:meth:`sleep` without :meth:`wake_up` since) they stay asleep like every
        other engine and :meth:`wake_up` wakes them; until then nothing is routed anywhere.

        Returns restored_engines (released engines brought back, plus, when awake, other
        sleeping ones woken) and wake_s. A no-op when there is nothing to restore.
        """
        async with self._lock:
            return await self._restore()

    async def _restore(self) -> dict[str, float]:
        start = time.monotonic()
        if self._asleep:
            restored = len(self._released)
        else:
            restored = len(self._released | self._sleeping)
            await asyncio.gather(*(self._wake_engine(i) for i in sorted(self._sleeping)))
        self._released.clear()
        return {"restored_engines": float(restored), "wake_s": time.monotonic() - start}

    async def _sleep_engine(self, index: int, level: int = 1) -> None:
        await self.engines[index].sleep(level)
        self._sleeping.add(index)  # per engine: if another one fails, this state stays true

    async def _wake_engine(self, index: int) -> None:
        await self.engines[index].wake_up()
        self._sleeping.discard(index)

    async def sleep(self, level: int = 1) -> None:
        """Put every engine to sleep (at ``level``, see RolloutEngine.sleep); refused while
        requests are in flight. Released engines (already asleep, at level 1) stay released
        until :meth:`restore_engines` or :meth:`wake_up`, and a restore while the pool sleeps
        leaves them asleep (see :meth:`restore_engines`)."""
        async with self._lock:
            if self._entries:
                raise RuntimeError(f"EnginePool.sleep refused: {len(self._entries)} request(s) in flight")
            self._asleep = True
            awake = [i for i in range(len(self.engines)) if i not in self._sleeping]
            await asyncio.gather(*(self._sleep_engine(i, level) for i in awake))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake every engine (released ones too) and route to all of them. ``["weights"]``
        wakes only the weights of every sleeping engine, so a push or reload can run without
        the KV caches' memory; routing resumes with the wake-up of the rest."""
        async with self._lock:
            if tags is not None and "kv_cache" not in tags:
                await asyncio.gather(*(self.engines[i].wake_up(list(tags)) for i in sorted(self._sleeping)))
                self._weights_awake = True
                return
            self._asleep = self._weights_awake = False
            await self._restore()

    async def reload_weights(self, weights_dir: str, version: int) -> dict | None:
        """Restore released engines and wake every sleeping one (a sleeping pool too: an engine
        cannot reload asleep), then reload every engine concurrently, so all serve ``version``.
        Returns the slowest engine's figures."""
        async with self._lock:
            await self._ready_for_weights()
            figures = await asyncio.gather(*(e.reload_weights(weights_dir, version) for e in self.engines))
        figures = [f for f in figures if f]
        return {k: max(f.get(k, 0.0) for f in figures) for k in figures[0]} if figures else None

    async def _ready_for_weights(self) -> None:
        if self._weights_awake:
            return  # every engine's weights are awake for this push; the KV caches wake after it
        self._asleep = False
        if self._released or self._sleeping:
            await self._restore()

    async def weight_receivers(self) -> list[tuple[str, str]]:
        """Every engine's replicas, engine by engine."""
        return [r for e in self.engines for r in await e.weight_receivers()]

    async def open_weight_receiver(self, init_infos: list[dict]) -> None:
        """Hand each engine its replicas' init infos (in :meth:`weight_receivers` order)."""
        counts = [len(await e.weight_receivers()) for e in self.engines]
        if sum(counts) != len(init_infos):
            raise ValueError(f"EnginePool: {len(init_infos)} init infos for {sum(counts)} replicas")
        starts = list(itertools.accumulate([0] + counts))
        await asyncio.gather(*(e.open_weight_receiver(init_infos[a:b])
                               for e, a, b in zip(self.engines, starts, starts[1:])))

    async def receive_weights(self, sync_id: int, version: int) -> list[dict]:
        """Like :meth:`reload_weights`: released engines back and sleeping ones woken first (every
        replica must take the push the trainer ranks are sending), then all at once."""
        async with self._lock:
            await self._ready_for_weights()
            per_engine = await asyncio.gather(*(e.receive_weights(sync_id, version) for e in self.engines))
        return [f for figures in per_engine for f in figures]

    async def close_weight_receiver(self) -> None:
        await asyncio.gather(*(e.close_weight_receiver() for e in self.engines))

    # ------------------------------------------------------------------ stats and shutdown

    async def stats(self) -> EngineStats:
        """Sums over engines; capacity and KV usage (mean) count active engines only, since
        released ones take no requests; per-engine stats and handoff state are in ``extra``."""
        parts = await asyncio.gather(*(e.stats() for e in self.engines))
        active = self._active() or list(range(len(self.engines)))
        return EngineStats(
            running=sum(p.running for p in parts),
            waiting=sum(p.waiting for p in parts),
            **{key: sum(getattr(p, key) for p in parts) for key in CUMULATIVE_COUNTERS},
            kv_cache_usage=sum(parts[i].kv_cache_usage for i in active) / len(active),
            capacity=sum(parts[i].capacity for i in active),
            extra={
                "per_engine": parts,
                "routed_in_flight": list(self._load),
                "active_engines": self.active_engines,
                "released": sorted(self._released),
                "sleeping": sorted(self._sleeping),
                **self._totals,
            },
        )

    async def shutdown(self) -> None:
        """Shut every engine down, then stop merging."""
        await asyncio.gather(*(e.shutdown() for e in self.engines), return_exceptions=True)
        for task in [*self._pumps, *self._resubmits]:
            task.cancel()
