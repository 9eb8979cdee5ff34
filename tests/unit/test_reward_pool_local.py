"""The reward pool's in-process path: dispatch, shaping and sample updates."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import AlgorithmConfig, RewardConfig
from megatron_rl.reward.workers import RewardPool
from megatron_rl.sample import Prompt, Sample


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from megatron_rl.model.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


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
    with pytest.raises(ValueError, match="reward.kind='code'"):
        RewardPool(RewardConfig(kind="code"), str(tokenizer_dir), 16, use_ray=False)
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        RewardPool(RewardConfig(), "/nonexistent/tokenizer", 16, use_ray=False)
    with pytest.raises(ValueError, match="overlong_buffer_tokens=32"):
        RewardPool(RewardConfig(), str(tokenizer_dir), 16,
                   AlgorithmConfig(overlong_buffer_tokens=32), use_ray=False)
