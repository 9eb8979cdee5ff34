"""Health of each engine in a pool, and what replacing a dead one needs.

A pool member is in one of four states (:class:`MemberHealth`):

* ``healthy``: routed to, takes pushes;
* ``dead``: its death was noticed (its completion stream failed and it failed its health check,
  a call to it failed likewise, or the periodic check found it); its unfinished requests already
  moved to healthy members;
* ``restarting``: its replacement is starting on the same placement (the same GPU bundles);
* ``stale``: the replacement is up but holds the weights it started from; it rejoins routing once
  a push or reload brought it to the current policy version (the loop's next push, or at once
  when no healthy member is left to serve: a pool of one waits for its replacement).

:class:`Supervision` is shared by every pool one engine factory builds (the first engines, the
pools an elastic TP switch builds, the replacements), so the restart budget
(``rollout.max_engine_restarts``), the record of replacements and the loop's weight restorer hold
for the whole run.
"""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from megatron_rl.rollout.engine import RolloutEngine, WeightsRestorer

MemberStarter = Callable[[int], Awaitable[RolloutEngine]]
"""``start(index)``: a new engine for member ``index`` of the pool, started like the first one
(same TP, placement and start directory)."""

SHUTDOWN_WAIT_S = 30.0
"""Longest wait for a dead engine's shutdown (its actor is killed either way)."""


class MemberHealth(str, enum.Enum):
    """Where a pool member stands (module docstring)."""

    HEALTHY = "healthy"
    DEAD = "dead"
    RESTARTING = "restarting"
    STALE = "stale"


class EngineRestartsExhausted(RuntimeError):
    """Engines died more often than ``rollout.max_engine_restarts`` allows."""


@dataclass
class RestartRecord:
    """One replacement of one pool member."""

    member: int
    """Index of the member in its pool."""
    cause: str
    """The error that revealed the death."""
    detected_at: float
    """time.monotonic() when the death was noticed."""
    restart_s: float = 0.0
    """From noticing the death until the replacement was up (stale)."""
    resubmitted: int = 0
    """Requests moved off the dead member and continued on others (or on its replacement)."""
    aborted: int = 0
    """Requests the consumer had aborted, ended with their partial 'abort' completion instead."""


@dataclass
class Supervision:
    """What every supervised pool of a run shares (module docstring)."""

    max_restarts: int = 3
    """Replacements allowed within the run (``rollout.max_engine_restarts``)."""
    health_check_s: float = 2.0
    """Health-check period of each member while requests are in flight (0: only failures reveal a
    death)."""
    restore: WeightsRestorer | None = None
    """The loop's way to bring new engines to the current weights (``RolloutEngine.supervise``);
    None leaves them with the weights they start from."""
    records: list[RestartRecord] = field(default_factory=list)
    """Every replacement of the run, in order."""

    def budget_left(self) -> bool:
        return len(self.records) < self.max_restarts

    def exhausted(self, cause: str) -> EngineRestartsExhausted:
        return EngineRestartsExhausted(
            f"a rollout engine died again ({cause}) after {len(self.records)} restart(s) in this run "
            f"(rollout.max_engine_restarts={self.max_restarts}): stopping")

    def totals(self) -> dict[str, float]:
        """``restarts``, ``restart_s`` and ``resubmitted`` of the run so far (``EngineStats`` fields)."""
        return {"restarts": len(self.records), "restart_s": sum(r.restart_s for r in self.records),
                "resubmitted": sum(r.resubmitted for r in self.records)}


async def is_dead(engine: RolloutEngine, tries: int = 1) -> bool:
    """Whether ``engine`` fails its health check (``tries`` times half a second apart: a stream
    that just failed may be ahead of the engine marking itself dead)."""
    for attempt in range(tries):
        try:
            await engine.check_health()
        except Exception:
            return True
        if attempt + 1 < tries:
            await asyncio.sleep(0.5)
    return False
