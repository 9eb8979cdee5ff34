"""Optional LLM-judge reward: a second model, served through the rollout engine interface,
decides whether a response answers the question correctly (off by default).

For open-ended answers no rule can grade. The judge sees the question, the reference answer and
the response in one chat turn and must reply YES or NO; the first of those words in its reply
decides (reward 1.0 / 0.0). A reply with neither scores 0 with status 'no_answer'. The judge is
greedy (temperature 0) with a small token budget, and its prompt is cut from the left of the
response when it would not fit the judge's context.

The judge engine is any :class:`~megatron_rl.rollout.engine.RolloutEngine` (a ``VLLMEngine`` in
process, or a Ray engine actor on a cluster) that nobody else reads completions from: the judge
owns the stream and matches completions to waiting calls by request id.
"""
from __future__ import annotations

import asyncio
import itertools
import re
import time
from typing import Any

from megatron_rl.reward.graders.result import RewardResult
from megatron_rl.rollout.engine import GenerationRequest, RolloutEngine
from megatron_rl.runtime.aio import wait_for

DEFAULT_TEMPLATE = (
    "You are grading an answer.\n\nQuestion:\n{question}\n\nReference answer:\n{reference}\n\n"
    "Candidate answer:\n{response}\n\nIs the candidate answer correct? Reply with YES or NO only."
)
_VERDICT_RE = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_verdict(text: str) -> bool | None:
    """True for a YES reply, False for NO (the first of the two words decides), None otherwise."""
    match = _VERDICT_RE.search(text)
    return None if match is None else match.group(1).lower() == "yes"


class LLMJudge:
    """Scores responses by asking a judge model through a :class:`RolloutEngine`."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, *, max_new_tokens: int = 16,
                 max_prompt_tokens: int = 1024, template: str = "", timeout_s: float = 120.0,
                 timeout_reward: float = 0.0) -> None:
        """``tokenizer`` is the judge model's (chat template); ``template`` needs the fields
        {question}, {reference} and {response} (default :data:`DEFAULT_TEMPLATE`)."""
        template = template or DEFAULT_TEMPLATE
        for key in ("{question}", "{reference}", "{response}"):
            if key not in template:
                raise ValueError(f"reward.judge_template must contain {key}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"judge tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat_template")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.template = template
        self.timeout_s = timeout_s
        self.timeout_reward = timeout_reward
        self._ids = itertools.count()
        self._waiting: dict[str, asyncio.Future] = {}
        self._pump: asyncio.Task | None = None

    def build_prompt(self, question: str, reference: str, response: str) -> list[int]:
        """Judge prompt tokens; the response is cut from the left until the prompt fits."""
        def encode(resp: str) -> list[int]:
            text = self.template.format(question=question, reference=reference, response=resp)
            chat = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
            return list(self.tokenizer.encode(chat, add_special_tokens=False))

        ids = encode(response)
        if len(ids) > self.max_prompt_tokens:
            # Binary search for the longest response tail that fits (the answer is at the end).
            low, high = 0, len(response)
            while low < high:
                mid = (low + high + 1) // 2
                if len(encode("..." + response[len(response) - mid:])) <= self.max_prompt_tokens:
                    low = mid
                else:
                    high = mid - 1
            ids = encode("..." + response[len(response) - low:])
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(f"judge prompt is {len(ids)} tokens without the response, more than "
                             f"reward.judge_max_prompt_tokens={self.max_prompt_tokens} (question too long)")
        return ids

    async def _read_completions(self) -> None:
        async for done in self.engine.completions():
            future = self._waiting.pop(done.request_id, None)
            if future is not None and not future.done():
                future.set_result(done)

    async def judge(self, question: str, reference: str, response: str) -> RewardResult:
        """Ask the judge once; never raises for a model reply, only for engine failures."""
        start = time.monotonic()
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._read_completions())
        rid = f"judge-{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        try:
            await self.engine.submit(GenerationRequest(
                request_id=rid, prompt_ids=self.build_prompt(question, reference, response),
                max_tokens=self.max_new_tokens, seed=0, temperature=0.0, return_logprobs=False))
            done = await wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            await self.engine.abort([rid])
            return RewardResult(self.timeout_reward, False, "", "timeout", f"judge took over {self.timeout_s} s",
                                time.monotonic() - start)
        except asyncio.CancelledError:
            await asyncio.shield(self.engine.abort([rid]))
            raise
        finally:
            self._waiting.pop(rid, None)
        reply = self.tokenizer.decode(done.token_ids, skip_special_tokens=True)
        verdict = parse_verdict(reply)
        if done.finish_reason == "abort" or verdict is None:
            return RewardResult(0.0, False, reply.strip()[:200], "no_answer", "judge reply has no YES/NO",
                                time.monotonic() - start)
        return RewardResult(1.0 if verdict else 0.0, verdict, reply.strip()[:200], "ok", "",
                            time.monotonic() - start)

    async def close(self) -> None:
        """Stop reading completions and shut the judge engine down."""
        if self._pump is not None:
            self._pump.cancel()
        await self.engine.shutdown()


def create_judge(reward_cfg: Any, rollout_cfg: Any, seed: int, *, use_ray: bool = True) -> LLMJudge:
    """An :class:`LLMJudge` on ``reward.judge_model``: a Ray engine actor (``use_ray``) or an
    in-process ``VLLMEngine`` (which must then be used on the loop that first calls it)."""
    import dataclasses

    from transformers import AutoTokenizer

    if not reward_cfg.judge_model:
        raise ValueError("reward.kind='judge' needs reward.judge_model (a Hugging Face model directory)")
    tokenizer = AutoTokenizer.from_pretrained(reward_cfg.judge_model)
    max_len = reward_cfg.judge_max_prompt_tokens + reward_cfg.judge_max_new_tokens
    # The judge batches like the policy engine but one engine is enough; it never reloads weights.
    engine_cfg = dataclasses.replace(rollout_cfg, num_engines=1, temperature=0.0)
    if use_ray:
        from megatron_rl.rollout.driver.ray_engine import RayEngineClient

        engine: RolloutEngine = RayEngineClient.create(reward_cfg.judge_model, engine_cfg, seed, max_len)
    else:
        from megatron_rl.rollout.actor.vllm_engine import VLLMEngine

        engine = VLLMEngine(reward_cfg.judge_model, engine_cfg, seed, max_len)
    return LLMJudge(engine, tokenizer, max_new_tokens=reward_cfg.judge_max_new_tokens,
                    max_prompt_tokens=reward_cfg.judge_max_prompt_tokens, template=reward_cfg.judge_template,
                    timeout_reward=reward_cfg.timeout_reward)
