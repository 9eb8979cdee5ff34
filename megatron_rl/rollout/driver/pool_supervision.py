"""The supervising half of :class:`~megatron_rl.rollout.driver.engine_pool.EnginePool`: one member's death
replaces that member only.

A death is noticed by whichever comes first: the member's completion stream failing (vLLM reports
an engine core's exit within a second), a submit or abort to it failing, each followed by a
failed health check, or the periodic health check of members holding requests
(``rollout.engine_health_check_s``, each answer bounded by ``rollout.engine_health_timeout_s``).
Then (``engine_health`` names the states):

1. the member is ``dead``: its unfinished requests move to healthy members at once, each continued
   recompute-style from the tokens of its earlier parts (a request that never moved restarts from
   its prompt with its own seed, so it samples as if it had never run); requests the consumer had
   aborted end with their partial 'abort' completion; with no healthy member left they wait;
2. ``restarting``: the dead engine is shut down (its actor killed, its /dev/shm segments removed)
   and the factory starts a new one for the same member (same bundles, same start directory). A member
   lent to the stream trainer (``release_engines``) is not started while its GPUs train: its start waits
   until the pool generates again (restored and awake: the trainer has left those GPUs), so a GPU never
   holds a starting engine's whole pool beside the training trainer; meanwhile pushes and reloads go to
   the other members, and it joins the first one after its start;
3. ``stale``: the new engine holds the weights it started from; it rejoins routing with the next
   push or reload, which brings every member to the current version. When no healthy member is
   left to serve (a pool of one), the loop's restorer (``RolloutEngine.supervise``) brings it to
   the current weights at once and the waiting requests go to it.

Completions of the dead engine that arrive late are dropped (each member's pump carries the
generation it was started for). A death beyond ``rollout.max_engine_restarts`` in the run ends the
pool with :class:`~megatron_rl.rollout.driver.engine_health.EngineRestartsExhausted`, raised from
``completions()`` and every later call.
"""
from __future__ import annotations

import asyncio
import logging
import time

from megatron_rl.rollout.driver.engine_health import SHUTDOWN_WAIT_S, MemberHealth, RestartRecord, is_dead
from megatron_rl.rollout.engine import CUMULATIVE_COUNTERS, Completion, WeightsRestorer
from megatron_rl.runtime.aio import wait_for

log = logging.getLogger(__name__)

HEALTHY, DEAD, RESTARTING, STALE = MemberHealth.HEALTHY, MemberHealth.DEAD, MemberHealth.RESTARTING, MemberHealth.STALE


class PoolSupervision:
    """Mixin of :class:`EnginePool` (module docstring); uses the pool's members, entries, routing
    and merged queue. Unsupervised pools (no member starter) keep the old rule: a member's failure
    is the consumer's error."""

    # ------------------------------------------------------------------ detection
    def _watch_needed(self) -> bool:
        return self._supervision is not None and self._supervision.health_check_s > 0

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._supervision.health_check_s)
            if self._failed is not None:
                return
            busy = [i for i in range(len(self.engines)) if self.health[i] is HEALTHY and self._load[i] > 0]
            generations = [self._generation[i] for i in busy]
            results = await asyncio.gather(*(self.engines[i].check_health() for i in busy), return_exceptions=True)
            for i, gen, result in zip(busy, generations, results):
                if isinstance(result, Exception) and gen == self._generation[i]:
                    self._died(i, result)

    def _member_stream_failed(self, index: int, generation: int, exc: Exception) -> None:
        """Member ``index``'s completion stream failed: a death when it also fails its health check,
        else the consumer's error (e.g. a request the engine rejected)."""
        if generation != self._generation[index]:
            return  # a replaced engine's stream
        task = asyncio.get_running_loop().create_task(self._judge(index, generation, exc))
        self._resubmits.add(task)
        task.add_done_callback(self._resubmits.discard)

    async def _judge(self, index: int, generation: int, exc: Exception) -> None:
        if await is_dead(self.engines[index], tries=3):
            if generation == self._generation[index]:
                self._died(index, exc)
        elif generation == self._generation[index]:
            self._merged.put_nowait(exc)
            self._changed.set()

    async def _dead_after(self, index: int, exc: BaseException) -> bool:
        """A call to member ``index`` failed with ``exc``: True when that was its death (noticed
        now, its requests moved), False when the member is healthy (``exc`` is the caller's)."""
        if self._supervision is None:
            return False
        generation = self._generation[index]
        if self.health[index] in (HEALTHY, STALE):
            if not await is_dead(self.engines[index]):
                return False
            if generation == self._generation[index]:
                self._died(index, exc)
        return True  # dead now, or already being replaced

    # ------------------------------------------------------------------ replacement
    def _died(self, index: int, exc: BaseException, *, restore: bool = True) -> None:
        """Member ``index`` is dead: move its requests and start its replacement (once per death)."""
        if self._supervision is None or self._closed or self._failed is not None:
            return
        if self.health[index] not in (HEALTHY, STALE):
            return  # already being replaced
        cause = f"engine {index}: {type(exc).__name__}: {exc}"[:300]
        if not self._supervision.budget_left():
            self._fail(self._supervision.exhausted(cause))
            return
        record = RestartRecord(member=index, cause=cause, detected_at=time.monotonic())
        self._supervision.records.append(record)
        self.health[index] = DEAD
        self._generation[index] += 1
        if index < len(self._pumps):
            self._pumps[index].cancel()
        log.warning("rollout engine died (member %d of %d: %s) with %d request(s) unfinished on it", index,
                    len(self.engines), record.cause, self._load[index])
        self._move_off(index, record)
        self._replacing[index] = asyncio.get_running_loop().create_task(self._replace(index, record, restore))

    def _move_off(self, index: int, record: RestartRecord) -> None:
        """Every request on dead member ``index`` continues elsewhere (or waits for a member)."""
        for rid, entry in list(self._entries.items()):
            if entry.engine != index:
                continue
            self._unplace(entry)
            entry.migrating = False
            if entry.aborted:
                del self._entries[rid]
                self._merged.put_nowait(self._merge(entry, None, "abort") if entry.record.parts
                                        else Completion(rid, [], [], "abort", self._version))
                record.aborted += 1
                continue
            record.resubmitted += 1
            self._continue(entry)

    def _continue(self, entry) -> None:
        """Run ``entry``'s next part on the least-loaded healthy member; with none, keep it waiting
        (``_orphans``) for a replacement."""
        rid = entry.record.original.request_id
        continuation = entry.record.continuation(self._new_part_id(rid))
        if continuation is None:  # its budget was used up by earlier parts
            del self._entries[rid]
            self._merged.put_nowait(self._merge(entry, None, "length"))
            return
        if not self._active():
            entry.engine, entry.part_id, entry.submitting = -1, continuation.request_id, True
            self._orphans[rid] = continuation
            return
        self._place(entry, self._pick(), continuation.request_id)
        task = asyncio.get_running_loop().create_task(self._resubmit(entry, continuation))
        self._resubmits.add(task)
        task.add_done_callback(self._resubmits.discard)

    def _place_orphans(self) -> None:
        for rid in list(self._orphans):
            if not self._active():
                return
            request = self._orphans.pop(rid)
            entry = self._entries.get(rid)
            if entry is None:
                continue
            self._place(entry, self._pick(), request.request_id)
            task = asyncio.get_running_loop().create_task(self._resubmit(entry, request))
            self._resubmits.add(task)
            task.add_done_callback(self._resubmits.discard)

    async def _replace(self, index: int, record: RestartRecord, restore: bool) -> None:
        try:
            await self._bring_up(index, record, restore)
        finally:
            if self._replacing.get(index) is asyncio.current_task():
                del self._replacing[index]

    async def _bring_up(self, index: int, record: RestartRecord, restore: bool) -> None:
        self.health[index] = RESTARTING
        old = self.engines[index]
        try:
            await wait_for(old.shutdown(), timeout=SHUTDOWN_WAIT_S)
        except Exception as exc:  # it is dead: its shutdown may fail, its actor is killed anyway
            log.info("shutdown of dead engine %d: %r", index, exc)
        for key in CUMULATIVE_COUNTERS:  # keep the pool's counters monotonic for whoever diffs them
            self._lost_counts[key] += self._last_counts[index].get(key, 0)
        self._last_counts[index] = {}
        if index in self._released:
            await self._until_generating(index)
            if self._closed:
                return
        try:
            new = await self._start_member(index)
            if index in self._sleeping:  # released to the trainer, or the pool sleeps: so must it
                await new.sleep(self._sleep_level)
                if self._weights_awake:  # the pool's weights are awake for a push: so are its
                    await new.wake_up(["weights"])
        except Exception as exc:
            self._fail(RuntimeError(f"replacing dead rollout engine {index} ({record.cause}) failed: {exc!r}"))
            return
        self.engines[index] = new
        self.health[index] = STALE
        if self._pumps:  # (else they start with the first request, for every member)
            self._pumps[index] = asyncio.get_running_loop().create_task(self._pump(index))
        record.restart_s = time.monotonic() - record.detected_at
        log.warning("rollout engine replaced (member %d of %d) in %.1f s (restart %d of at most %d in the run): "
                    "%d request(s) resubmitted, %d aborted ones ended", index, len(self.engines), record.restart_s,
                    len(self._supervision.records), self._supervision.max_restarts, record.resubmitted, record.aborted)
        restorer = self._supervision.restore
        if restorer is None:
            self.health[index] = HEALTHY  # nothing to bring it to: it serves the weights it started from
        elif restore and not self._active() and index not in self._sleeping:
            await self._restore_member(index, restorer)  # nobody else serves: bring it up now
        self._place_orphans()

    async def _until_generating(self, index: int) -> None:
        """Lent member ``index`` died: wait until the pool generates again (the member restored, the pool
        awake) before its replacement starts (see the module docstring)."""
        log.warning("rollout engine %d died while lent to the trainer: its replacement starts when the rollout "
                    "resumes (pushes and reloads skip it until then)", index)
        self._deferred.add(index)
        self._deferring.set()
        try:
            while not self._closed and (index in self._released or self._asleep):
                self._roles.clear()
                await self._roles.wait()
        finally:
            self._deferred.discard(index)

    def _held_back(self, index: int) -> bool:
        """Member ``index``'s replacement waits for the rollout, and the rollout has not resumed."""
        return index in self._deferred and (index in self._released or self._asleep)

    def _roles_changed(self) -> None:
        """A release, restore, sleep or wake-up happened: deferred replacements look again."""
        self._roles.set()

    async def _restore_member(self, index: int, restorer: WeightsRestorer) -> None:
        try:
            await restorer(self.engines[index])
        except Exception as exc:
            self._fail(RuntimeError(f"bringing replacement engine {index} to the current weights failed: {exc!r}"))
            return
        self.health[index] = HEALTHY

    def _mark_current(self, reached: list[int]) -> None:
        """A push or reload reached the members ``reached``: stale ones among them rejoin routing."""
        for i in reached:
            if self.health[i] is STALE:
                self.health[i] = HEALTHY
        self._place_orphans()

    async def _abort_on(self, by_engine: dict[int, list[str]]) -> None:
        """Abort ``by_engine[i]`` (part ids) on each member ``i`` at once; a member that fails because
        it died is replaced (its requests move), any other failure is raised."""
        indices = list(by_engine)
        results = await asyncio.gather(*(self.engines[i].abort(by_engine[i]) for i in indices), return_exceptions=True)
        for index, result in zip(indices, results):
            if isinstance(result, BaseException) and (
                    not isinstance(result, Exception) or not await self._dead_after(index, result)):
                raise result

    async def _on_members(self, indices: list[int], call) -> None:
        """``await call(i)`` for each member of ``indices`` at once (a sleep or a wake-up). A member
        that fails because it died (e.g. killed while lent to the trainer, found when it is woken)
        is replaced and the call made once more on its replacement; any other failure is raised."""
        for attempt in range(2):
            results = await asyncio.gather(*(call(i) for i in indices), return_exceptions=True)
            retry = []
            for index, result in zip(indices, results):
                if isinstance(result, BaseException):
                    if attempt or not isinstance(result, Exception) or not await self._dead_after(index, result):
                        raise result
                    retry.append(index)
            if not retry:
                return
            await self._settled()
            indices = retry

    def _waiting_for_member(self) -> bool:
        """No member can take a request now, but one is being replaced (a new request waits)."""
        return not self._active() and (bool(self._replacing) or any(h in (DEAD, RESTARTING) for h in self.health))

    def _fail(self, exc: Exception) -> None:
        if self._failed is None:
            self._failed = exc
            self._merged.put_nowait(exc)
            self._changed.set()

    async def _settled(self) -> None:
        """Wait for replacements under way (not the deferred ones of lent members); raise once the pool
        failed (budget spent, a start failed)."""
        while True:  # each task leaves the dict as it ends; a death meanwhile adds one
            waiting = [task for index, task in self._replacing.items() if not self._held_back(index)]
            if not waiting:
                break
            # A replacement may reach its deferral only after this wait began (its dead engine shut down
            # first): stop waiting for it then, or a release waiting here would wait for its own end.
            self._deferring.clear()
            deferral = asyncio.ensure_future(self._deferring.wait())
            try:
                await asyncio.wait([waiting[0], deferral], return_when=asyncio.FIRST_COMPLETED)  # (wait cancels neither)
            finally:
                deferral.cancel()
            if waiting[0].done() and not waiting[0].cancelled() and waiting[0].exception() is not None:
                raise waiting[0].exception()
        if self._failed is not None:
            raise self._failed

    # ------------------------------------------------------------------ contract members
    async def supervise(self, restore: WeightsRestorer) -> None:
        """Keep the loop's restorer for every replacement (shared by the run's pools)."""
        if self._supervision is not None:
            self._supervision.restore = restore

    async def recover(self, error: BaseException) -> bool:
        """After a whole-pool call failed (a push): replace the dead members, then bring every
        member to the current weights (a failed push leaves the survivors' weights half new)."""
        if self._failed is not None:
            raise self._failed
        if self._supervision is None:
            return False
        candidates = [i for i, h in enumerate(self.health) if h in (HEALTHY, STALE)]
        dead = await asyncio.gather(*(is_dead(self.engines[i], tries=3) for i in candidates))
        for i, is_gone in zip(candidates, dead):
            if is_gone:
                self._died(i, error, restore=False)
        if not any(dead) and not self._replacing:
            return False
        await self._settled()
        for i in self._up():  # (a lent member's deferred replacement is not up yet)
            self.health[i] = STALE
        if self._supervision.restore is None:
            self._mark_current(self._up())
        else:
            await self._supervision.restore(self)  # a push or reload of every member: all current again
        return True

    def supervision_figures(self) -> dict:
        """``restarts``, ``restart_s``, ``resubmitted`` (run totals) and each member's health."""
        totals = self._supervision.totals() if self._supervision is not None else {}
        return {**totals, "health": [h.value for h in self.health]}
