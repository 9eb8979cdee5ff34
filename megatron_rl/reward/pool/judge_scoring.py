"""The LLM-judge path of the reward pool (``reward.kind='judge'``): scored on the driver.

Contract of :class:`JudgeScorer`: a judge response is decoded with the policy tokenizer (loaded
from the pool's tokenizer path on the first judge response), the judge
(:class:`~megatron_rl.reward.graders.llm_judge.LLMJudge`) is awaited on the driver's event loop with the
question, the reference answer and the decoded response, and its verdict is shaped by length like
every rule reward (:func:`~megatron_rl.reward.pool.worker.make_outcome`, source 'judge'). The outcome
goes to the pool's ``collect`` unless the handle was cancelled meanwhile. No worker, queue or
retry is involved: judge outcomes add no queue wait to the pool's stats. :meth:`close` stops the
judge engine.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from megatron_rl.config.schema import AlgorithmConfig
from megatron_rl.reward.pool.handles import RewardHandle
from megatron_rl.reward.pool.worker import RewardOutcome, make_outcome


class JudgeScorer:
    """Scores judge-routed responses with ``judge`` (see the module docstring)."""

    def __init__(self, judge: Any, tokenizer_path: str, max_new_tokens: int, algorithm_cfg: AlgorithmConfig,
                 collect: Callable[[RewardHandle, RewardOutcome], None]) -> None:
        self._judge = judge
        self._tokenizer_path = tokenizer_path
        self._tokenizer: Any = None  # the policy tokenizer on the driver, only for judge responses
        self._max_new_tokens = max_new_tokens
        self._algo = algorithm_cfg
        self._collect = collect

    async def score(self, handle: RewardHandle) -> None:
        """Judge the handle's response and collect the outcome (unless cancelled by then)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        sample = handle.sample
        sample.timings["reward_submitted"] = start = time.monotonic()
        text = self._tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        result = await self._judge.judge(sample.prompt.text, sample.prompt.answer, text)
        outcome = make_outcome(result, "judge", len(sample.response_ids), self._max_new_tokens, self._algo,
                               time.monotonic() - start)
        if not handle.cancelled:
            self._collect(handle, outcome)

    def close(self) -> None:
        """Stop the judge engine (from sync code; a task when a loop is already running)."""
        if self._judge is not None:
            _run_coroutine(self._judge.close())
            self._judge = None


def _run_coroutine(coro) -> None:
    """Run ``coro`` to completion from sync code (a task when a loop is already running)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
    else:
        loop.create_task(coro)
