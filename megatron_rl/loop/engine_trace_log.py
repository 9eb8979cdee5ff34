"""``engine_trace.jsonl`` (``rollout.engine_trace``): the engines' iterations of each step's rollout.

The engines record every iteration (``megatron_rl.rollout.actor.engine_trace``); the loop drains
them around the work that is not the rollout, so each step's lines hold its rollout only:

* before the first step: the warm-up and the first validation ran on the engines: dropped;
* around each validation: what ran before it is kept for the next step (a generation a
  scheduler overlaps with training, one-step-off's, is the next step's rollout), what ran during
  it is dropped (including overlapped generation in that window: a validation step's trace
  misses those iterations);
* after each rollout: kept and written with the step, one line per engine (an engine drained
  twice in a step has its rows joined).
"""
from __future__ import annotations

import os
import time

from megatron_rl.loop.step_log import StepLog
from megatron_rl.rollout.engine import RolloutEngine


class EngineTraceLog:
    def __init__(self, run_dir: str | os.PathLike, enabled: bool) -> None:
        self.enabled = enabled
        self.log = StepLog(run_dir, "engine_trace.jsonl")
        self._pending: dict[tuple[int, int], dict] = {}
        """(engine index, TP) -> its drained rows not yet written."""
        self._cost_s = 0.0

    async def collect(self, engine: RolloutEngine, keep: bool) -> None:
        """Drain the engines' iterations so far; ``keep`` them for the next step's lines or drop them."""
        if not self.enabled:
            return
        start = time.perf_counter()
        for replica in await engine.drain_trace():
            self._cost_s += replica.get("record_s", 0.0)
            if not keep:
                continue
            key = (int(replica.get("engine", 0)), int(replica["tp"]))
            if key in self._pending:
                held = self._pending[key]
                held["rows"] += replica["rows"]
                held["record_s"] = held.get("record_s", 0.0) + replica.get("record_s", 0.0)
            else:
                self._pending[key] = {"engine": key[0], **replica}
        self._cost_s += time.perf_counter() - start

    def write(self, step: int, round_type: str) -> dict[str, float]:
        """Write what was kept as ``step``'s lines; returns the trace's metrics (its cost since the last write)."""
        if not self.enabled:
            return {}
        start = time.perf_counter()
        pending, self._pending = self._pending, {}
        for key in sorted(pending):
            self.log.append(step, kind="engine", round=round_type, **pending[key])
        cost, self._cost_s = self._cost_s + time.perf_counter() - start, 0.0
        return {"engine_trace/cost_s": cost,
                "engine_trace/iterations": float(sum(len(r["rows"]) for r in pending.values()))}

    def truncate(self, first_dropped_step: int) -> None:
        self.log.truncate(first_dropped_step)
