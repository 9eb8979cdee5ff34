"""Small helpers shared by the engine tests (VLLMEngine, its Ray client)."""
from __future__ import annotations

import asyncio

import torch

from megatron_rl.rollout.actor.vllm_engine import VLLMEngine
from megatron_rl.rollout.engine import Completion, GenerationRequest, RolloutEngine


class LongRequestsIgnoreEOS(VLLMEngine):
    """Requests named 'long-*' ignore EOS, so they are guaranteed to run long (tests only: abort
    and migration need a request that is still running when the test acts)."""

    def _sampling_params(self, request):
        params = super()._sampling_params(request)
        if request.request_id.startswith("long-"):
            params.ignore_eos = True
        return params


def model_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """A transformers model's fp32 logprob of each response token given the prompt and earlier tokens."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float):
    """Run ``coro`` on the module's loop with a hard timeout (a hung engine fails the test)."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout=timeout))


async def collect(engine: RolloutEngine, ids: set[str]) -> dict[str, Completion]:
    """Read completions until every id in ``ids`` arrived (others are an error)."""
    got: dict[str, Completion] = {}
    async for completion in engine.completions():
        assert completion.request_id in ids, f"unexpected completion {completion.request_id}"
        got[completion.request_id] = completion
        if len(got) == len(ids):
            return got
    raise AssertionError("completions() ended early")


async def generate(engine: RolloutEngine, requests: list[GenerationRequest]) -> dict[str, Completion]:
    """Submit ``requests`` and wait for all their completions."""
    await asyncio.gather(*(engine.submit(r) for r in requests))
    return await collect(engine, {r.request_id for r in requests})
