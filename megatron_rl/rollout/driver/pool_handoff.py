"""The resource-handoff half of :class:`~megatron_rl.rollout.driver.engine_pool.EnginePool`: whole engines
lent to training mid-round and taken back, and the pool's sleep and wake-up.

For RollPacker's stream trainer the pool can shrink mid-round: :meth:`PoolHandoff.release_engines`
takes whole engines (one engine is one TP group, so a group is never split) out of routing,
migrates their running requests to the remaining engines recompute-style (``migration``) and puts
them to sleep so training can use their devices; :meth:`PoolHandoff.restore_engines` brings them
back. A member that dies while lent is replaced asleep and stays lent (``pool_supervision``).
"""
from __future__ import annotations

import asyncio
import logging
import time

from megatron_rl.rollout.driver.engine_health import MemberHealth
from megatron_rl.runtime.aio import wait_for

logger = logging.getLogger(__name__)


class PoolHandoff:
    """Mixin of :class:`EnginePool` (module docstring); uses the pool's members, entries and routing."""

    # ------------------------------------------------------------------ resource handoff

    async def release_engines(self, count: int, members: list[int] | None = None, level: int = 1) -> dict[str, float]:
        """Hand ``count`` whole engines over to training; the rest finish the round.

        Releases ``members`` (pool indices: the engines whose GPUs are whole trainer replicas,
        ``distributed.replica_release``), else the engines with the fewest of this pool's requests
        (ties: highest index); stops routing to them, aborts their requests and, as each partial
        comes back, continues it on the least-loaded remaining engine with the tokens generated so
        far re-prefilled (a request whose budget is used up ends with reason 'length'). Once the
        released engines hold nothing, they sleep at ``level`` (2: their weights are dropped, for a
        weight sync that refills them before they generate again). At least one engine must stay
        active.

        Returns: released_engines, migrated_requests, migrated_tokens (generated tokens
        re-prefilled instead of regenerated), ended_while_migrating (finished, aborted or out of
        budget instead of moving), release_s.
        """
        async with self._lock:
            active = self._active()
            if not isinstance(count, int) or not 1 <= count < len(active):
                raise ValueError(
                    f"release_engines({count!r}): can release 1..{len(active) - 1} of the {len(active)} "
                    f"active engine(s); at least one must stay active (health {[h.value for h in self.health]}, "
                    f"released {sorted(self._released)}, asleep {sorted(self._sleeping)})"
                )
            if members is not None and (len(members) != count or len(set(members)) != count
                                        or any(i not in active for i in members)):
                raise ValueError(f"release_engines({count}, members={members}): the members must be {count} distinct "
                                 f"active engines of {active}")
            if level not in (1, 2):
                raise ValueError(f"release_engines: sleep level must be 1 or 2, got {level!r}")
            self._ensure_pumps()
            start = time.monotonic()
            before = dict(self._totals)
            chosen = sorted(members) if members is not None else sorted(active, key=lambda i: (self._load[i], -i))[:count]
            self._released.update(chosen)
            self._roles_changed()
            by_engine: dict[int, list[str]] = {}
            for entry in self._entries.values():
                if entry.engine in chosen and not entry.aborted:
                    entry.migrating = True
                    if not entry.submitting:
                        by_engine.setdefault(entry.engine, []).append(entry.part_id)
            # A chosen member may have died unnoticed (its core killed after it took a launch, found
            # only now): its abort or sleep fails, and it is replaced (asleep: it stays lent) as a
            # failure anywhere else in the pool would have it; its requests move to the others.
            await self._abort_on(by_engine)
            await self._wait_drained(chosen)
            await self._on_members(chosen, lambda i: self._sleep_engine(i, level))
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
            dead = [i for i in indices if self._pumps[i].done()] if self._supervision is None else []
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
            await self._on_members(sorted(self._sleeping), self._wake_engine)
        self._released.clear()
        self._roles_changed()
        self._place_orphans()
        return {"restored_engines": float(restored), "wake_s": time.monotonic() - start}

    async def _sleep_engine(self, index: int, level: int = 1) -> None:
        if self.health[index] in (MemberHealth.HEALTHY, MemberHealth.STALE):
            await self.engines[index].sleep(level)
        # (a member being replaced: its replacement goes to sleep once it is up)
        self._sleeping.add(index)  # per engine: if another one fails, this state stays true

    async def _wake_engine(self, index: int) -> None:
        if self.health[index] in (MemberHealth.HEALTHY, MemberHealth.STALE):
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
            await self._settled()
            self._asleep, self._sleep_level = True, level
            self._roles_changed()
            awake = [i for i in range(len(self.engines)) if i not in self._sleeping]
            await self._on_members(awake, lambda i: self._sleep_engine(i, level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake every engine (released ones too) and route to all of them. ``["weights"]``
        wakes only the weights of every sleeping engine, so a push or reload can run without
        the KV caches' memory; routing resumes with the wake-up of the rest."""
        async with self._lock:
            await self._settled()
            if tags is not None and "kv_cache" not in tags:
                async def wake_weights(i: int) -> None:
                    await self.engines[i].wake_up(list(tags))

                await self._on_members(sorted(self._sleeping), wake_weights)
                self._weights_awake = True
                return
            self._asleep = self._weights_awake = False
            await self._restore()
