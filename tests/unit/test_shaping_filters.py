"""DAPO overlong punishment and the zero-variance group filter, against hand-computed values."""
from __future__ import annotations

import pytest

from megatron_rl.algorithms.filters import filter_zero_variance, is_zero_variance
from megatron_rl.algorithms.shaping import overlong_penalty, shaped_reward
from megatron_rl.sample import Prompt, Sample


@pytest.mark.parametrize(
    "length, expected",
    [
        (10, 0.0),     # far below the buffer
        (80, 0.0),     # exactly at Lmax - B = 100 - 20: still free
        (81, -0.05),   # -(81 - 80) / 20 * 1
        (90, -0.5),    # -(90 - 80) / 20 * 1
        (99, -0.95),   # -(99 - 80) / 20 * 1
        (100, -1.0),   # at Lmax: full penalty
        (130, -1.0),   # beyond Lmax (should not happen, still capped)
    ],
)
def test_overlong_penalty_piecewise(length: int, expected: float) -> None:
    assert overlong_penalty(length, max_length=100, buffer=20, penalty=1.0) == pytest.approx(expected)


def test_overlong_penalty_scales_with_penalty_and_disables_with_zero_buffer() -> None:
    # -(90 - 80) / 20 * 0.5 = -0.25
    assert overlong_penalty(90, 100, 20, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0
    # raw 1.0 + (-(95 - 90) / 10 * 1.0) = 0.5
    assert shaped_reward(1.0, 95, 100, 10, 1.0) == pytest.approx(0.5)


def test_overlong_penalty_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="overlong_buffer_tokens"):
        overlong_penalty(5, 10, 11, 1.0)
    with pytest.raises(ValueError, match="overlong_penalty"):
        overlong_penalty(5, 10, 5, -1.0)


def _group(prompt_id: str, rewards: list[float | None]) -> list[Sample]:
    prompt = Prompt(prompt_id=prompt_id, token_ids=[1, 2], answer="1")
    return [Sample(prompt=prompt, response_index=i, reward=r) for i, r in enumerate(rewards)]


def test_filter_zero_variance_splits_groups_in_order() -> None:
    groups = [
        _group("a", [1.0, 1.0, 1.0]),   # all right: filtered
        _group("b", [0.0, 1.0, 0.0]),   # spread: kept
        _group("c", [0.0, 0.0]),        # all wrong: filtered
        _group("d", [0.5]),             # single response: filtered
        _group("e", [-0.25, 0.0]),      # shaped rewards with spread: kept
    ]
    result = filter_zero_variance(groups)
    assert [g[0].prompt.prompt_id for g in result.kept] == ["b", "e"]
    assert [g[0].prompt.prompt_id for g in result.filtered] == ["a", "c", "d"]
    assert result.num_filtered == 3
    assert result.num_kept == 2


def test_zero_variance_looks_at_the_rule_reward_not_the_shaped_one() -> None:
    """DAPO filters on accuracy: an all-wrong group whose lengths differ inside the overlong
    buffer has shaped rewards with spread but nothing to learn about correctness."""
    all_wrong = _group("w", [-0.1, -0.6, 0.0])
    for sample in all_wrong:
        sample.raw_reward = 0.0
    mixed = _group("m", [1.0, -0.6])
    mixed[0].raw_reward, mixed[1].raw_reward = 1.0, 0.0
    all_right_shaped = _group("r", [1.0, 0.7])  # right, one of them punished for length
    for sample in all_right_shaped:
        sample.raw_reward = 1.0
    result = filter_zero_variance([all_wrong, mixed, all_right_shaped])
    assert [g[0].prompt.prompt_id for g in result.kept] == ["m"]
    assert [g[0].prompt.prompt_id for g in result.filtered] == ["w", "r"]


def test_zero_variance_tolerance_and_missing_reward() -> None:
    assert is_zero_variance(_group("a", [1.0, 1.0 + 1e-12]))
    assert not is_zero_variance(_group("a", [1.0, 1.0 + 1e-3]))
    with pytest.raises(ValueError, match="b#1 has no reward"):
        filter_zero_variance([_group("b", [1.0, None])])
    with pytest.raises(ValueError, match="empty group"):
        filter_zero_variance([[]])
