"""A minimal tail-batching driver on the fake engine (cursor + scorer + rollout context, like the
trainer's), with prompts whose responses are short or long by index: shared by the tail-batching
and rollout-history unit tests."""
from __future__ import annotations

import asyncio

from megatron_rl.config.schema import RunConfig
from megatron_rl.data.cursor import PromptCursor
from megatron_rl.loop.hooks import RolloutContext
from megatron_rl.sample import Prompt

P0, R0 = 4, 4


def make_prompts(n: int, long_every: int = 5) -> list[Prompt]:
    """Prompt i is 'long' (its responses need 200 ticks) when i % long_every == long_every - 1."""
    return [Prompt(prompt_id=f"p{i}", token_ids=[7, i], answer=str(i)) for i in range(n)]


def lengths(long_every: int = 5):
    def length_fn(req):
        idx = req.prompt_ids[1]
        base = 200 if idx % long_every == long_every - 1 else 5
        return base + req.seed % 7  # responses of a prompt differ a little

    return length_fn


class Harness:
    """A minimal driver: cursor + scorer + context, like the trainer's."""

    def __init__(self, prompts, engine, dapo=False, reward_fn=None, max_refills=4, eta_p=1.25, eta_r=1.25):
        self.cfg = RunConfig()
        self.cfg.data.prompts_per_step, self.cfg.data.responses_per_prompt = P0, R0
        self.cfg.rollout.max_new_tokens = 1000
        self.cfg.tail_batching.eta_prompts, self.cfg.tail_batching.eta_responses = eta_p, eta_r
        self.cfg.tail_batching.max_refills = max_refills
        self.cfg.algorithm.filter_zero_variance = dapo
        self.prompts, self.engine = prompts, engine
        self.cursor = PromptCursor(len(prompts), seed=0, shuffle=False)
        self.reward_fn = reward_fn or (lambda s: float(len(s.response_ids) % 2))
        self.cancelled: list[str] = []
        self.scored: list[str] = []
        self.loop = asyncio.new_event_loop()  # one loop for the engine's whole life, like the trainer

    async def score(self, sample):
        await asyncio.sleep(0)
        sample.reward = self.reward_fn(sample)
        self.scored.append(sample.request_id)
        return sample

    def ctx(self, step: int) -> RolloutContext:
        return RolloutContext(cfg=self.cfg, engine=self.engine, score=self.score,
                              cancel_scores=lambda ss: self.cancelled.extend(s.request_id for s in ss),
                              next_prompts=lambda n: [self.prompts[i] for i in self.cursor.take(n)],
                              policy_version=0, step=step)

    def run(self, sched, step):
        return self.loop.run_until_complete(asyncio.wait_for(sched.next_batch(self.ctx(step)), timeout=60))
