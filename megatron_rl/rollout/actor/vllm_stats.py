"""vLLM's per-step scheduler statistics into the rollout engine's ``EngineStats`` (a custom stat
logger of ``AsyncLLM``)."""
from __future__ import annotations

import time
from typing import Any

from megatron_rl.rollout.actor.engine_trace import IterationTrace
from megatron_rl.rollout.actor.speculative import SpecCounters


class StatsSink:
    """Receives vLLM scheduler/iteration stats via the stat-logger hook of AsyncLLM.

    AsyncLLM's output handler calls ``record`` after every engine step with the step's
    ``SchedulerStats`` (running/waiting/KV usage) and ``IterationStats`` (preemption events).
    """

    def __init__(self, trace: IterationTrace | None = None) -> None:
        self.trace = trace
        """Per-iteration rows (``rollout.engine_trace``); None when off."""
        self.running = 0
        self.waiting = 0
        self.skipped_waiting = 0
        self.kv_cache_usage = 0.0
        self.preemptions = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.updated_at = 0.0
        self.spec = SpecCounters()
        """Decode steps and draft/accept counts (speculative decoding)."""

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """Fold one engine step's stats into the running totals."""
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.skipped_waiting = scheduler_stats.num_skipped_waiting_reqs
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            prefix = scheduler_stats.prefix_cache_stats
            self.prefix_cache_queries += int(getattr(prefix, "queries", 0))
            self.prefix_cache_hits += int(getattr(prefix, "hits", 0))
            self.updated_at = time.monotonic()
        self.spec.record(scheduler_stats, iteration_stats)
        if self.trace is not None:
            self.trace.record(scheduler_stats, iteration_stats)
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
            self.generation_tokens += iteration_stats.num_generation_tokens


def stat_logger_factory(sink: StatsSink):
    """A per-engine StatLoggerFactory (``(vllm_config, engine_index) -> StatLoggerBase``)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SinkLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._sink = sink

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            self._sink.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _SinkLogger
