"""GRPO / Dr.GRPO group advantages against hand-computed values."""
from __future__ import annotations

import pytest

from megatron_rl.algorithms.advantages import compute_advantages, group_advantages, group_by_prompt
from megatron_rl.sample import Prompt, Sample


def test_grpo_uses_unbiased_std() -> None:
    # mean 0.5, centred [.5, -.5, -.5, .5], var = 4 * 0.25 / 3 = 1/3, std = 0.577350
    # A = 0.5 / (0.577350 + 1e-6) = 0.866024
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], "grpo")
    assert adv == pytest.approx([0.866024, -0.866024, -0.866024, 0.866024], abs=1e-6)
    # mean 1.5, centred [1.5, -1.5], var = 2 * 2.25 / 1 = 4.5, std = 2.121320 -> A = +-0.707107
    assert group_advantages([3.0, 0.0], "grpo") == pytest.approx([0.707107, -0.707107], abs=1e-6)


def test_drgrpo_is_mean_centred_only() -> None:
    # mean of [1, 0, 0, 0] is 0.25
    assert group_advantages([1.0, 0.0, 0.0, 0.0], "drgrpo") == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_degenerate_groups_get_zero_advantage() -> None:
    assert group_advantages([1.0, 1.0, 1.0], "grpo") == [0.0, 0.0, 0.0]
    assert group_advantages([0.7], "grpo") == [0.0]
    assert group_advantages([0.7], "drgrpo") == [0.0]
    assert group_advantages([], "grpo") == []


def test_unknown_kind_is_an_error() -> None:
    with pytest.raises(ValueError, match="algorithm.advantage='ppo'"):
        group_advantages([1.0, 0.0], "ppo")


def _sample(prompt_id: str, index: int, reward: float | None) -> Sample:
    return Sample(prompt=Prompt(prompt_id=prompt_id, token_ids=[1], answer="1"),
                  response_index=index, reward=reward)


def test_compute_advantages_groups_interleaved_samples_by_prompt() -> None:
    samples = [_sample("p", 0, 1.0), _sample("q", 0, 2.0), _sample("p", 1, 0.0), _sample("q", 1, 2.0)]
    assert [[s.response_index for s in g] for g in group_by_prompt(samples)] == [[0, 1], [0, 1]]
    compute_advantages(samples, "drgrpo")
    # p: mean 0.5 -> [0.5, -0.5]; q: identical rewards -> [0, 0]
    assert [s.advantage for s in samples] == pytest.approx([0.5, 0.0, -0.5, 0.0])
    compute_advantages(samples, "grpo")
    # p: std of [1, 0] (n - 1) = 0.707107 -> 0.5 / 0.707108 = 0.707106
    assert [s.advantage for s in samples] == pytest.approx([0.707106, 0.0, -0.707106, 0.0], abs=1e-6)


def test_compute_advantages_names_an_unscored_sample() -> None:
    with pytest.raises(ValueError, match="p#1 has no reward"):
        compute_advantages([_sample("p", 0, 1.0), _sample("p", 1, None)])
