"""Validation on held-out prompts: pass@1 (greedy, one response per prompt) and mean length."""
from __future__ import annotations

import asyncio
import time

from megatron_rl.config.schema import RunConfig
from megatron_rl.rollout.engine import GenerationRequest, RolloutEngine
from megatron_rl.runtime.aio import awaited_elsewhere
from megatron_rl.sample import Prompt, Sample


async def validate(cfg: RunConfig, engine: RolloutEngine, rewards, prompts: list[Prompt],
                   policy_version: int) -> dict[str, float]:
    """Generate one greedy response per prompt with the current weights and score it."""
    if not prompts:
        return {}
    start = time.monotonic()
    pending: dict[str, Sample] = {}
    for i, prompt in enumerate(prompts[: cfg.data.eval_num_prompts]):
        rid = f"eval-v{policy_version}-{i}"
        pending[rid] = Sample(prompt=prompt, response_index=0, request_id=rid, round_type="eval",
                              policy_version=policy_version)
        await engine.submit(GenerationRequest(request_id=rid, prompt_ids=prompt.token_ids,
                                              max_tokens=cfg.rollout.max_new_tokens, seed=i, temperature=0.0,
                                              return_logprobs=False))
    stream = engine.completions()
    scoring = []
    done_count = len(pending)
    while pending:
        done = await stream.__anext__()
        sample = pending.pop(done.request_id, None)
        if sample is None:
            continue
        sample.response_ids = list(done.token_ids)
        sample.finish_reason = done.finish_reason
        scoring.append(awaited_elsewhere(rewards.score(sample)))
    scored = await asyncio.gather(*scoring)
    lengths = [len(s.response_ids) for s in scored]
    return {
        "val/pass@1": sum(bool(s.correct) for s in scored) / done_count,
        "val/reward_mean": sum(s.reward for s in scored) / done_count,
        "val/response_length_mean": sum(lengths) / done_count,
        "val/num_prompts": float(done_count),
        "val/time": time.monotonic() - start,
        "val/policy_version": float(policy_version),
    }
