"""The LLM judge on the real vLLM engine with the tiny model (a second engine as the judge)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.reward.graders.llm_judge import LLMJudge, parse_verdict

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def test_tiny_judge_scores_through_the_engine(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    from megatron_rl.rollout.actor.vllm_engine import VLLMEngine

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(str(tiny_model_dir), RolloutConfig(max_num_seqs=8, cpu_kv_cache_gib=0.125), seed=0,
                        max_model_len=512)  # default runtime dir: ZMQ socket paths must stay short
    judge = LLMJudge(engine, tokenizer, max_new_tokens=8, max_prompt_tokens=400)
    try:
        async def main():
            calls = [judge.judge("What is 6*7?", "42", "It is 42."),
                     judge.judge("What is 6*7?", "42", "long answer " * 100 + "so 41"),
                     judge.judge("What is 6*7?", "42", "It is 42.")]
            return await asyncio.gather(*calls)

        first, long_one, repeat = loop.run_until_complete(asyncio.wait_for(main(), 300))
        for result in (first, long_one, repeat):
            # A random tiny model says anything: the reward must follow its reply's verdict.
            assert result.status in ("ok", "no_answer")
            verdict = parse_verdict(result.extracted)
            assert result.reward == (1.0 if verdict else 0.0)
            assert result.status == ("no_answer" if verdict is None else "ok")
            assert result.elapsed_s > 0
        # Greedy: the same question and response get the same reply.
        assert first.extracted == repeat.extracted
    finally:
        loop.run_until_complete(asyncio.wait_for(judge.close(), 60))
        loop.close()
