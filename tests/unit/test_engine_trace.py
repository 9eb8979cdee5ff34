"""The engine's per-iteration trace (rollout.engine_trace), fed vLLM's own stats objects as its stat
logger receives them: rows in COLUMNS order, handed over once, the pool tags its members."""
from __future__ import annotations

import asyncio

from vllm.v1.metrics.stats import IterationStats, SchedulerIterationDetails, SchedulerStats, SpecDecodingStats

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.actor.engine_trace import COLUMNS, IterationTrace
from megatron_rl.rollout.actor.vllm_engine_args import engine_args
from megatron_rl.rollout.actor.vllm_stats import StatsSink


def _step(ctx_reqs: int, ctx_tokens: int, gen_reqs: int, gen_tokens: int, usage: float, waiting: int = 0,
          preempted: int = 0, drafts: tuple[int, ...] | None = None) -> tuple[SchedulerStats, IterationStats]:
    sched = SchedulerStats(num_running_reqs=ctx_reqs + gen_reqs, num_waiting_reqs=waiting, kv_cache_usage=usage)
    sched.iteration_details = SchedulerIterationDetails(iteration_index=0, num_ctx_requests=ctx_reqs,
                                                        num_ctx_tokens=ctx_tokens, num_generation_requests=gen_reqs,
                                                        num_generation_tokens=gen_tokens, elapsed_ms=2.5)
    if drafts is not None:
        spec = SpecDecodingStats.new(num_spec_tokens=4)
        for accepted in drafts:  # one request's draft of four tokens each
            spec.observe_draft(num_draft_tokens=4, num_accepted_tokens=accepted)
        sched.spec_decoding_stats = spec
    it = IterationStats()
    it.num_preempted_reqs = preempted
    return sched, it


def test_rows_follow_vllm_stats_and_drain_hands_them_over_once():
    version = [3]
    trace = IterationTrace(lambda: version[0])
    trace.kv_capacity_tokens, trace.block_size = 10_000, 16
    sink = StatsSink(trace)
    sink.record(*_step(4, 400, 0, 0, 0.04, waiting=2))           # prefill of four prompts
    version[0] = 4                                                # a push between iterations
    sink.record(*_step(0, 0, 4, 12, 0.05, preempted=1, drafts=(3, 2)))
    sink.record(None, IterationStats())                          # no scheduler stats: no iteration
    no_details = SchedulerStats(num_running_reqs=4)
    sink.record(no_details, None)                                 # details off: not traced
    out = trace.drain(tensor_parallel_size=2, max_num_seqs=64)
    assert out["columns"] == list(COLUMNS) and (out["tp"], out["max_num_seqs"]) == (2, 64)
    assert (out["kv_capacity_tokens"], out["block_size"]) == (10_000, 16)
    assert 0 < out["record_s"] < 0.1  # its own cost, handed over (and reset) with the rows
    rows = [dict(zip(COLUMNS, r)) for r in out["rows"]]
    assert len(rows) == 2
    first, second = rows
    assert (first["running"], first["waiting"], first["prefill_tokens"], first["decode_tokens"]) == (4, 2, 400, 0)
    assert (first["context_tokens"], first["version"], first["elapsed_ms"]) == (400, 3, 2.5)
    assert (second["decode_tokens"], second["context_tokens"], second["preempted"]) == (12, 500, 1)
    assert (second["drafted"], second["accepted"], second["version"]) == (8, 5, 4)
    assert second["t"] >= first["t"]
    again = trace.drain(2, 64)
    assert (again["rows"], again["record_s"]) == ([], 0.0)  # handed over once
    assert sink.preemptions == 1  # the sink's own counters still run beside the trace


def test_engine_args_turn_vllm_iteration_details_on_only_with_the_trace(tmp_path):
    cfg = RolloutConfig()
    off = engine_args(cfg, str(tmp_path), 512, False, "auto", 0, "processed_logprobs", None)
    cfg.engine_trace = True
    on = engine_args(cfg, str(tmp_path), 512, False, "auto", 0, "processed_logprobs", None)
    assert (off.enable_logging_iteration_details, on.enable_logging_iteration_details) == (False, True)


def test_pool_tags_each_live_member_and_skips_a_dead_one():
    from megatron_rl.rollout.driver.engine_health import MemberHealth
    from megatron_rl.rollout.driver.engine_pool import EnginePool
    from tests.helpers.fake_engine import FakeEngine

    class Traced(FakeEngine):
        def __init__(self, tag: int):
            super().__init__(lambda r: 4)
            self.tag = tag

        async def drain_trace(self) -> list[dict]:
            return [{"tp": 1, "rows": [[self.tag]]}]

    async def main():
        pool = EnginePool([Traced(10), Traced(11), Traced(12)])
        pool.health[1] = MemberHealth.DEAD
        return await pool.drain_trace()

    assert asyncio.run(main()) == [{"engine": 0, "tp": 1, "rows": [[10]]}, {"engine": 2, "tp": 1, "rows": [[12]]}]


def test_the_loop_keeps_rollout_iterations_and_drops_warm_up_and_validation(tmp_path):
    from megatron_rl.loop.engine_trace_log import EngineTraceLog
    from megatron_rl.loop.step_log import StepLog
    from tests.helpers.fake_engine import FakeEngine

    class Scripted(FakeEngine):
        def __init__(self, drains: list[list[dict]]):
            super().__init__(lambda r: 4)
            self.drains = drains

        async def drain_trace(self) -> list[dict]:
            return self.drains.pop(0)

    def replica(engine: int, tag: str, n: int = 1) -> dict:
        return {"engine": engine, "tp": 1, "record_s": 0.5, "columns": ["tag"], "rows": [[tag]] * n}

    engine = Scripted([[replica(0, "warm-up", 3)],                          # start-up: dropped
                       [replica(0, "rollout0"), replica(1, "rollout0")],   # step 0's rollout
                       [replica(0, "overlap")],                            # before validation: kept
                       [replica(0, "validation", 5)],                      # during validation: dropped
                       [replica(0, "rollout1", 2)]])                       # step 1's rollout
    log = EngineTraceLog(tmp_path, enabled=True)

    async def main():
        await log.collect(engine, keep=False)
        await log.collect(engine, keep=True)
        first = log.write(0, "short")
        await log.collect(engine, keep=True)
        await log.collect(engine, keep=False)
        await log.collect(engine, keep=True)
        return first, log.write(1, "long")

    first, second = asyncio.run(main())
    lines = StepLog(tmp_path, "engine_trace.jsonl").read()
    assert [(t["step"], t["engine"], t["round"], [r[0] for r in t["rows"]]) for t in lines] == [
        (0, 0, "short", ["rollout0"]), (0, 1, "short", ["rollout0"]), (1, 0, "long", ["overlap", "rollout1", "rollout1"])]
    assert first["engine_trace/iterations"] == 2 and second["engine_trace/iterations"] == 3
    # The cost counts every drain's recording, dropped ones included: warm-up + both rollout replicas.
    assert first["engine_trace/cost_s"] >= 1.5 and second["engine_trace/cost_s"] >= 1.5
    assert EngineTraceLog(tmp_path, enabled=False).write(2, "short") == {}
