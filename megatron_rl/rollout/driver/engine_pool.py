"""EnginePool: several rollout engines behind one :class:`RolloutEngine`, with resource handoff.

Routing is least-loaded by this pool's own request count. For the stream trainer the pool can shrink
mid-round (``pool_handoff``: release whole engines, migrate their requests, sleep them; restore them). The
pool can also sleep as a whole; restored engines rejoin routing asleep and wake with the rest, so the
order of restore and sleep does not matter to the caller.

Two id spaces: the consumer's request ids, and the ids of the *parts* running on engines. A
request that never moved has one part under its own id; each migration starts a new part under
a fresh id. Completions of parts are handled by one pump task per engine, independently of the
consumer, so a migration proceeds even while nobody reads ``completions()``; the consumer only
ever sees one merged Completion per request id.

Supervised (built by ``engine_factory.EngineFactory``, with a member starter): each member's health
is watched and a dead member alone is replaced, its requests continued on the others
(``pool_supervision``).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from megatron_rl.rollout.driver.engine_health import MemberHealth, MemberStarter, Supervision
from megatron_rl.rollout.driver.migration import MigrationRecord
from megatron_rl.rollout.driver.pool_handoff import PoolHandoff
from megatron_rl.rollout.driver.pool_supervision import PoolSupervision
from megatron_rl.rollout.engine import (
    CUMULATIVE_COUNTERS,
    Completion,
    EngineStats,
    GenerationRequest,
    RolloutEngine,
    forward_completions,
    read_completions,
)

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


class EnginePool(PoolHandoff, PoolSupervision, RolloutEngine):
    """Several engines behind one :class:`RolloutEngine`: least-loaded routing by request count.

    Each request goes to the active engine with the fewest of this pool's requests in flight
    (ties to the lowest index); aborts go to wherever the request currently runs; weights reload
    on all engines at once (released ones are woken first).

    Args:
        engines: the engines; each is one whole TP group.
        drain_timeout_s: how long :meth:`release_engines` waits for the released engines'
            aborted requests to come back before giving up.
        start_member: ``start(index)`` builds a replacement for member ``index``; given, the pool
            supervises its members (``pool_supervision``); None: a member's failure is the consumer's.
        supervision: the run's shared restart budget, records and weight restorer (a fresh one when
            None).
    """

    def __init__(self, engines: Sequence[RolloutEngine], drain_timeout_s: float = 300.0, *,
                 start_member: MemberStarter | None = None, supervision: Supervision | None = None) -> None:
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
        # Supervision (pool_supervision): per-member health and what replacing a member needs.
        self._start_member = start_member
        self._supervision = (supervision or Supervision()) if start_member is not None else None
        self.health = [MemberHealth.HEALTHY] * len(self.engines)
        self._generation = [0] * len(self.engines)  # bumped per replacement: late output of the dead is dropped
        self._replacing: dict[int, asyncio.Task] = {}
        self._deferred: set[int] = set()  # died while lent: the replacement waits for the rollout to resume
        self._roles = asyncio.Event()  # set at every release, restore, sleep and wake-up (deferred ones recheck)
        self._deferring = asyncio.Event()  # set when a replacement starts to wait (who waits for it stops)
        self._orphans: dict[str, GenerationRequest] = {}  # moved off a dead member, no healthy one to take them
        self._failed: Exception | None = None
        self._closed = False
        self._monitor: asyncio.Task | None = None
        self._version = 0  # the weights' version: tags the abort completions the pool makes itself
        self._sleep_level = 1
        self._last_counts: list[dict[str, int]] = [{} for _ in self.engines]
        self._lost_counts = dict.fromkeys(CUMULATIVE_COUNTERS, 0)

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
        return [i for i in range(len(self.engines))
                if i not in self._released and i not in self._sleeping and self.health[i] is MemberHealth.HEALTHY]

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
        if self._monitor is None and self._watch_needed():
            self._monitor = asyncio.create_task(self._watch())

    # ------------------------------------------------------------------ requests

    @property
    def tensor_parallel_size(self) -> int:
        return self.engines[0].tensor_parallel_size

    async def submit(self, request: GenerationRequest) -> None:
        """Route to the least-loaded active engine."""
        rid = request.request_id
        if rid in self._entries or rid in self._by_part:
            raise ValueError(f"request_id {rid!r} is already in flight")
        if self._failed is not None:
            raise self._failed
        self._ensure_pumps()
        entry = _Entry(MigrationRecord(request), engine=-1, part_id=rid)
        self._entries[rid] = entry
        if self._waiting_for_member():
            self._orphans[rid] = request  # no healthy member until a replacement is up
            return
        try:
            self._place(entry, self._pick(), rid)
        except BaseException:
            del self._entries[rid]
            raise
        await self._send_share(entry.engine, [(entry, request)], launch=False)

    async def submit_all(self, requests: list[GenerationRequest]) -> None:
        """Place every request first, in order, by the pool's own counts (no submit has returned
        yet, so no completion moves them), then hand each engine its share at once."""
        ids = [r.request_id for r in requests]
        clash = sorted({rid for rid in ids if rid in self._entries or rid in self._by_part}
                       | {rid for rid in ids if ids.count(rid) > 1})
        if clash:
            raise ValueError(f"request_id(s) {clash} already in flight")
        if self._failed is not None:
            raise self._failed
        self._ensure_pumps()
        if self._waiting_for_member():  # no healthy member: each waits as a single submit does
            for request in requests:
                await self.submit(request)
            return
        shares: dict[int, list[tuple[_Entry, GenerationRequest]]] = {}
        try:
            for request in requests:
                index, entry = self._pick(), _Entry(MigrationRecord(request), engine=-1, part_id=request.request_id)
                self._entries[request.request_id] = entry
                self._place(entry, index, request.request_id)
                shares.setdefault(index, []).append((entry, request))
        except BaseException:  # no active engine: nothing was sent
            self._drop_unsent([part for share in shares.values() for part in share])
            raise
        await asyncio.gather(*(self._send_share(index, share) for index, share in shares.items()))

    async def _send_share(self, index: int, share: list[tuple["_Entry", GenerationRequest]], launch: bool = True) -> None:
        """Send placed requests to member ``index``: a launch's share in one submit_all, else one
        submit. A failure that was the member's death is not the caller's: the requests moved with
        its others (before the error came back, or now); any other failure unplaces and raises."""
        requests = [request for _, request in share]
        try:
            if launch:
                await self.engines[index].submit_all(requests)
            else:
                await self.engines[index].submit(requests[0])
        except Exception as exc:
            moved = any(not self._is_current(entry, r.request_id) for entry, r in share)
            if moved and self._supervision is not None:
                return
            if await self._dead_after(index, exc):
                return
            self._drop_unsent(share)
            raise
        except BaseException:
            self._drop_unsent(share)
            raise
        for entry, request in share:
            await self._submitted(entry, request.request_id)

    def _drop_unsent(self, share: list[tuple["_Entry", GenerationRequest]]) -> None:
        for entry, request in share:
            if self._is_current(entry, request.request_id):
                del self._entries[request.request_id]
                self._unplace(entry)

    async def _submitted(self, entry: _Entry, part_id: str) -> None:
        """A part's submit returned: send the abort that arrived (or a release that began) meanwhile."""
        if not self._is_current(entry, part_id):
            return  # already finished; its id may even be reused by a new request
        entry.submitting = False
        if entry.aborted or entry.migrating:
            index = entry.engine
            try:
                await self.engines[index].abort([part_id])
            except Exception as exc:
                if not await self._dead_after(index, exc):
                    raise

    async def _resubmit(self, entry: _Entry, request: GenerationRequest) -> None:
        index = entry.engine
        try:
            await self.engines[index].submit(request)
        except Exception as exc:
            # That member died too: the request moved again (before this error came back, or now).
            if self._supervision is not None and (not self._is_current(entry, request.request_id)
                                                  or await self._dead_after(index, exc)):
                return
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
        generation = self._generation[index]

        def deliver(part: Completion) -> None:
            if generation == self._generation[index]:  # else: late output of a replaced engine
                self._on_part(part, index)

        def failed(exc: Exception) -> None:
            if self._supervision is not None:
                self._member_stream_failed(index, generation, exc)
            else:  # the consumer gets the error; a release waiting on it notices (see _wait_drained)
                self._merged.put_nowait(exc)
                self._changed.set()

        await forward_completions(self.engines[index], deliver, failed)

    def _on_part(self, part: Completion, index: int) -> None:
        """One part ended on engine ``index``. Synchronous, so no other state change interleaves."""
        rid = self._by_part.get(part.request_id)
        if rid is None:
            self._merged.put_nowait(part)  # not routed by this pool: pass it on untouched
            return
        entry = self._entries[rid]
        if entry.engine != index:
            return  # that part moved off a dead engine: its continuation answers
        self._version = part.weight_version
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
            # Under its own id: a request moved off a dead member ran its only part under a part id.
            final = part if not entry.record.parts and part.request_id == rid else self._merge(entry, part, None)
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
        # The pool's own end (restart budget spent) is put back: every reader, now or later, sees it.
        async for completion in read_completions(self._merged, keep_failure=lambda exc: exc is self._failed):
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
            if self._orphans.pop(rid, None) is not None:  # waiting for a member: it ends here
                del self._entries[rid]
                self._merged.put_nowait(self._merge(entry, None, "abort") if entry.record.parts
                                        else Completion(rid, [], [], "abort", self._version))
                continue
            # A pending submit sends the abort when it returns; a pending migration abort ends it.
            if not entry.submitting and not entry.migrating:
                by_engine.setdefault(entry.engine, []).append(entry.part_id)
        await self._abort_on(by_engine)

    async def check_health(self) -> None:
        """Every engine's health check; the first failure is raised, naming the engine. Supervised:
        a failing member is also replaced, and a member being replaced counts as not healthy (a
        push waiting on it must stop)."""
        if self._failed is not None:
            raise self._failed
        up = [i for i, h in enumerate(self.health) if h in (MemberHealth.HEALTHY, MemberHealth.STALE)]
        results = await asyncio.gather(*(self.engines[i].check_health() for i in up), return_exceptions=True)
        for index, result in zip(up, results):
            if isinstance(result, BaseException):
                self._died(index, result)
                raise RuntimeError(f"engine {index} of the pool is not healthy: {result!r}") from result
        # A lent member's deferred replacement (pool_supervision) joins the push after the next one.
        down = [f"engine {i} is {h.value}" for i, h in enumerate(self.health) if i not in up and not self._held_back(i)]
        if down:
            raise RuntimeError(f"the pool cannot take a push now: {', '.join(down)}")

    async def reload_weights(self, weights_dir: str, version: int) -> dict | None:
        """Restore released engines and wake every sleeping one (a sleeping pool too: an engine
        cannot reload asleep), then reload every engine concurrently, so all serve ``version``.
        Returns the slowest engine's figures."""
        async with self._lock:
            await self._ready_for_weights()
            up = self._up()
            figures = await asyncio.gather(*(self.engines[i].reload_weights(weights_dir, version) for i in up))
            self._version = version
            self._mark_current(up)
        figures = [f for f in figures if f]
        return {k: max(f.get(k, 0.0) for f in figures) for k in figures[0]} if figures else None

    async def _ready_for_weights(self) -> None:
        await self._settled()  # every member up (a replacement under way joins this push)
        if self._weights_awake:
            return  # every engine's weights are awake for this push; the KV caches wake after it
        self._asleep = False
        if self._released or self._sleeping:
            await self._restore()
        await self._settled()  # a lent member's deferred replacement, started by the wake-up, joins too

    def _up(self) -> list[int]:
        """Members that take weights: healthy or stale (a lent member's deferred replacement is not up)."""
        return [i for i, h in enumerate(self.health) if h in (MemberHealth.HEALTHY, MemberHealth.STALE)]

    async def weight_receivers(self) -> list[tuple[str, str]]:
        """Every engine's replicas, engine by engine."""
        await self._settled()
        return [r for i in self._up() for r in await self.engines[i].weight_receivers()]

    async def open_weight_receiver(self, init_infos: list[dict]) -> None:
        """Hand each engine its replicas' init infos (in :meth:`weight_receivers` order)."""
        engines = [self.engines[i] for i in self._up()]
        counts = [len(await e.weight_receivers()) for e in engines]
        if sum(counts) != len(init_infos):
            raise ValueError(f"EnginePool: {len(init_infos)} init infos for {sum(counts)} replicas")
        starts = list(itertools.accumulate([0] + counts))
        await asyncio.gather(*(e.open_weight_receiver(init_infos[a:b]) for e, a, b in zip(engines, starts, starts[1:])))

    async def receive_weights(self, sync_id: int, version: int) -> list[dict]:
        """Like :meth:`reload_weights`: released engines back and sleeping ones woken first (every
        replica must take the push the trainer ranks are sending), then all at once."""
        async with self._lock:
            await self._ready_for_weights()
            up = self._up()
            per_engine = await asyncio.gather(*(self.engines[i].receive_weights(sync_id, version) for i in up))
            self._version = version
            self._mark_current(up)
        return [f for figures in per_engine for f in figures]

    async def close_weight_receiver(self) -> None:
        await asyncio.gather(*(self.engines[i].close_weight_receiver() for i in self._up()))

    # ------------------------------------------------------------------ stats and shutdown

    async def drain_trace(self) -> list[dict]:
        """Every live member's iterations since the last drain, each tagged with its member index
        (a dead member's undrained rows went with it; its replacement starts a fresh trace)."""
        live = [i for i, h in enumerate(self.health) if h in (MemberHealth.HEALTHY, MemberHealth.STALE)]
        results = await asyncio.gather(*(self.engines[i].drain_trace() for i in live), return_exceptions=True)
        out = []
        for index, part in zip(live, results):
            if isinstance(part, Exception):
                if not await self._dead_after(index, part):
                    raise part
                continue
            out += [{"engine": index, **replica} for replica in part]
        return out

    async def stats(self) -> EngineStats:
        """Sums over engines; capacity and KV usage (mean) count active engines only, since
        released ones take no requests; per-engine stats and handoff state are in ``extra``."""
        up = [h in (MemberHealth.HEALTHY, MemberHealth.STALE) for h in self.health]
        results = await asyncio.gather(*(e.stats() for e, ok in zip(self.engines, up) if ok), return_exceptions=True)
        answers = iter(results)
        parts = [next(answers) if ok else EngineStats() for ok in up]
        for index, part in enumerate(parts):
            if isinstance(part, Exception):
                if not await self._dead_after(index, part):
                    raise part
                parts[index] = EngineStats()  # dead: its counts so far are kept in _lost_counts
            else:
                self._last_counts[index] = {key: getattr(part, key) for key in CUMULATIVE_COUNTERS}
        active = self._active() or list(range(len(self.engines)))
        totals = self.supervision_figures()
        return EngineStats(
            running=sum(p.running for p in parts),
            waiting=sum(p.waiting for p in parts),
            **{key: sum(getattr(p, key) for p in parts) + self._lost_counts[key] for key in CUMULATIVE_COUNTERS},
            restarts=int(totals.get("restarts", 0)), restart_s=float(totals.get("restart_s", 0.0)),
            resubmitted=int(totals.get("resubmitted", 0)),
            kv_cache_usage=sum(parts[i].kv_cache_usage for i in active) / len(active),
            capacity=sum(parts[i].capacity for i in active),
            extra={
                "per_engine": parts,
                "routed_in_flight": list(self._load),
                "active_engines": self.active_engines,
                "released": sorted(self._released),
                "sleeping": sorted(self._sleeping),
                "health": totals["health"],
                **self._totals,
            },
        )

    async def shutdown(self) -> None:
        """Shut every engine down (replacements under way are stopped), then stop merging."""
        self._closed = True
        self._roles.set()  # a deferred replacement stops waiting
        for task in [self._monitor, *self._replacing.values()]:
            if task is not None:
                task.cancel()
        deferred = set(self._deferred)  # their dead engines were shut down before the wait
        await asyncio.gather(*(e.shutdown() for i, e in enumerate(self.engines) if i not in deferred),
                             return_exceptions=True)
        for task in [*self._pumps, *self._resubmits]:
            task.cancel()
