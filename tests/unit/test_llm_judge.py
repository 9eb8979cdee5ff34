"""LLM judge: verdict parsing, prompt building, and the pool's judge route (scripted engine)."""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.config.schema import RewardConfig
from megatron_rl.reward.graders.llm_judge import LLMJudge, parse_verdict
from megatron_rl.reward.pool.reward_pool import RewardPool
from megatron_rl.rollout.engine import Completion, EngineStats, GenerationRequest, RolloutEngine
from megatron_rl.sample import Prompt, Sample


class ScriptedJudgeEngine(RolloutEngine):
    """Replies 'YES' when the prompt contains the reference answer's digits after 'Candidate', else 'No.'"""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests: list[GenerationRequest] = []

    tensor_parallel_size = 1
    """A fake engine holds no model shards; it stands for one TP-1 engine."""

    async def submit(self, request: GenerationRequest) -> None:
        self.requests.append(request)
        text = self.tok.decode(request.prompt_ids)
        candidate = text.split("Candidate answer:")[1]
        reply = "YES" if "42" in candidate else "No."
        ids = self.tok.encode(reply, add_special_tokens=False)
        self.queue.put_nowait(Completion(request.request_id, ids, [], "stop", 0))

    async def completions(self):
        while True:
            yield await self.queue.get()

    async def abort(self, request_ids):
        pass

    async def reload_weights(self, weights_dir, version):
        pass

    async def stats(self):
        return EngineStats()

    async def shutdown(self):
        pass




def test_parse_verdict() -> None:
    assert parse_verdict("YES") is True
    assert parse_verdict("  no, it is wrong") is False
    assert parse_verdict("Yes. But no.") is True          # the first word decides
    assert parse_verdict("nothing useful") is None
    assert parse_verdict("yesterday") is None             # whole words only


def test_prompt_fits_by_cutting_the_response(tokenizer) -> None:
    judge = LLMJudge(ScriptedJudgeEngine(tokenizer), tokenizer, max_prompt_tokens=400)
    ids = judge.build_prompt("What is 6*7?", "42", "blah " * 500 + "so 42")
    assert 390 <= len(ids) <= 400                          # the longest tail that fits
    assert "blah so 42" in tokenizer.decode(ids)
    with pytest.raises(ValueError, match="judge_template must contain"):
        LLMJudge(ScriptedJudgeEngine(tokenizer), tokenizer, template="no fields")
    with pytest.raises(ValueError, match="question too long"):
        LLMJudge(ScriptedJudgeEngine(tokenizer), tokenizer, max_prompt_tokens=20).build_prompt("q" * 100, "1", "x")


def test_pool_routes_judge_kind_to_the_judge(tokenizer_dir, tokenizer) -> None:
    engine = ScriptedJudgeEngine(tokenizer)
    judge = LLMJudge(engine, tokenizer)
    pool = RewardPool(RewardConfig(kind="judge", judge_model="unused"), str(tokenizer_dir), 64,
                      use_ray=False, judge=judge)

    def sample(i: int, text: str) -> Sample:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return Sample(prompt=Prompt("q", [1], "42", text="What is 6*7?"), response_index=i,
                      request_id=f"r{i}", response_ids=ids)

    async def main():
        return await asyncio.gather(pool.score(sample(0, "It is 42.")), pool.score(sample(1, "It is 41.")))

    right, wrong = asyncio.run(main())
    assert (right.reward, right.correct) == (1.0, True)
    assert (wrong.reward, wrong.correct) == (0.0, False)
    assert all(r.temperature == 0.0 and r.max_tokens == 16 for r in engine.requests)
    assert pool.status_counts == {"ok": 2}
    with pytest.raises(ValueError, match="await score"):
        pool.submit(sample(2, "x"))
    pool.shutdown()
