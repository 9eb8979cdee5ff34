"""Shared checks of a running vLLM engine against transformers (imported by engine tests)."""
from __future__ import annotations

import asyncio

import torch

from megatron_rl.rollout.engine import GenerationRequest
from tests.helpers.engine_io import model_logprobs
from tests.helpers.engine_io import run as run_with_timeout

PROMPT = [5, 17, 42, 99, 7, 3]


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float = 180.0):
    """Run ``coro`` on ``loop`` (the engine's loop) with a timeout."""
    return run_with_timeout(loop, coro, timeout)


async def sample(engine, rid: str, max_tokens: int = 16) -> tuple[list[int], list[float], int]:
    """One seeded request on ``engine``: its tokens, logprobs and weight version."""
    await engine.submit(GenerationRequest(rid, PROMPT, max_tokens=max_tokens, seed=11))
    async for completion in engine.completions():
        assert completion.request_id == rid
        return completion.token_ids, completion.logprobs, completion.weight_version
    raise AssertionError("no completion")


def hf_logprobs(model_dir, response: list[int]) -> torch.Tensor:
    """transformers' logprobs of ``response`` after PROMPT (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model_logprobs(model, PROMPT, response)
