"""The reward pool's in-process path: dispatch, shaping and sample updates."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config.schema import AlgorithmConfig, RewardConfig
from megatron_rl.reward.pool.reward_pool import RewardPool
from megatron_rl.sample import Prompt, Sample


def make_sample(tokenizer, prompt_id: str, index: int, text: str, answer: str) -> Sample:
    """A finished response whose tokens spell ``text`` (byte-level: one token per byte) + EOS."""
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return Sample(prompt=Prompt(prompt_id=prompt_id, token_ids=[1, 2, 3], answer=answer),
                  response_index=index, response_ids=ids, finish_reason="stop")


def test_local_pool_scores_shapes_and_round_robins(tokenizer_dir: Path, tokenizer) -> None:
    cfg = RewardConfig(num_workers=2, timeout_s=5.0, timeout_reward=0.0)
    # max_new_tokens 20, buffer 10 -> responses longer than 10 tokens are punished.
    algo = AlgorithmConfig(overlong_buffer_tokens=10, overlong_penalty=1.0)
    pool = RewardPool(cfg, str(tokenizer_dir), max_new_tokens=20, algorithm_cfg=algo, use_ray=False)
    try:
        samples = [
            make_sample(tokenizer, "p", 0, "\\boxed{4}", "#### 4"),          # 9 bytes + EOS = 10 tokens
            make_sample(tokenizer, "p", 1, "#### 5", "#### 4"),              # 6 + 1 = 7 tokens
            make_sample(tokenizer, "p", 2, "so it is: \\boxed{4}", "#### 4"),  # 19 + 1 = 20 tokens
            make_sample(tokenizer, "q", 0, "no idea", "2/3"),                # 7 + 1 = 8 tokens
        ]
        handles = [pool.submit(s) for s in samples]
        assert [h.worker for h in handles] == [0, 1, 0, 1]   # nothing in flight in-process
        done = pool.wait(handles, timeout_s=60)
        assert done == samples
        assert [s.raw_reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
        assert [s.correct for s in samples] == [True, False, True, False]
        # 10 tokens: no penalty; 20 tokens = max_new_tokens: full penalty -> 1.0 - 1.0
        assert [s.reward for s in samples] == pytest.approx([1.0, 0.0, 0.0, 0.0])
        assert handles[3].outcome.status == "no_answer"
        assert pool.status_counts == {"ok": 3, "no_answer": 1}
        assert all("reward_done" in s.timings and "reward_s" in s.timings for s in samples)
        assert pool.poll(handles) == (handles, [])
        pool.cancel(handles)  # already scored: a no-op
        assert not any(h.cancelled for h in handles)
    finally:
        pool.shutdown()


def test_pool_rejects_bad_config(tokenizer_dir: Path) -> None:
    with pytest.raises(ValueError, match="reward.num_workers=0"):
        RewardPool(RewardConfig(num_workers=0), str(tokenizer_dir), 16, use_ray=False)
    with pytest.raises(ValueError, match="reward.kind='regex'"):
        RewardPool(RewardConfig(kind="regex"), str(tokenizer_dir), 16, use_ray=False)
    with pytest.raises(ValueError, match="needs a judge"):
        RewardPool(RewardConfig(kind="judge"), str(tokenizer_dir), 16, use_ray=False)
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        RewardPool(RewardConfig(), "/nonexistent/tokenizer", 16, use_ray=False)
    with pytest.raises(ValueError, match="overlong_buffer_tokens=32"):
        RewardPool(RewardConfig(), str(tokenizer_dir), 16,
                   AlgorithmConfig(overlong_buffer_tokens=32), use_ray=False)


def test_mixed_pool_routes_by_format_and_learns_timeouts(tokenizer_dir: Path, tokenizer) -> None:
    cfg = RewardConfig(kind="mixed", num_workers=1, timeout_s=5.0, code_timeout_min_s=2.0, code_timeout_max_s=20.0)
    pool = RewardPool(cfg, str(tokenizer_dir), max_new_tokens=512, use_ray=False)
    try:
        tests = "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"
        code_prompt = Prompt("kod:0", [1], tests, metadata={"format": "kodcode", "tests": tests})
        math_prompt = Prompt("gsm:0", [1], "3", metadata={"format": "gsm8k"})

        def sample(prompt: Prompt, i: int, text: str) -> Sample:
            ids = tokenizer.encode(text, add_special_tokens=False)
            return Sample(prompt=prompt, response_index=i, request_id=f"{prompt.prompt_id}-{i}", response_ids=ids)

        assert pool.timeouts.timeout_s("kod:0") == 20.0   # no anchor yet: T_max
        good = pool.submit(sample(code_prompt, 0, "```python\ndef add(a, b):\n    return a + b\n```"))
        bad = pool.submit(sample(code_prompt, 1, "```python\ndef add(a, b):\n    return a - b\n```"))
        maths = pool.submit(sample(math_prompt, 0, "\\boxed{3}"))
        assert (good.outcome.source, good.sample.reward) == ("code", 1.0)
        assert (bad.outcome.source, bad.sample.reward) == ("code", 0.0)
        assert (maths.outcome.source, maths.sample.reward) == ("math", 1.0)
        # One correct run (well under a second) anchors the problem: the timeout drops to T_min.
        assert 0 < good.outcome.run_s < 2.0
        assert pool.timeouts.timeout_s("kod:0") == 2.0
        metrics = pool.step_metrics([good.sample, bad.sample, maths.sample])
        assert metrics["reward/scored"] == 3.0 and metrics["reward/adaptive_anchors"] == 1.0
        assert metrics["reward/worker_time_s"] > 0
    finally:
        pool.shutdown()
