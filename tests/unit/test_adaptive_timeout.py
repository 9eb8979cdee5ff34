"""Adaptive timeout: min(max(T_min, lambda * T_anchor), T_max) with online and dataset anchors."""
import pytest

from megatron_rl.reward.pool.adaptive_timeout import AdaptiveTimeouts, TimeoutPolicy, dataset_anchor


def test_clamp_matches_the_formula() -> None:
    policy = TimeoutPolicy()  # lambda 1.5, T_min 2 s, T_max 30 s
    assert policy.clamp(0.1) == 2.0
    assert policy.clamp(4.0) == pytest.approx(6.0)
    assert policy.clamp(100.0) == 30.0
    with pytest.raises(ValueError, match="min_s <= max_s"):
        TimeoutPolicy(min_s=5, max_s=1)


def test_online_anchor_is_the_slowest_correct_run() -> None:
    t = AdaptiveTimeouts()
    assert t.timeout_s("p") == 30.0                      # no anchor yet: T_max
    t.observe("p", 4.0, correct=False)                   # wrong runs never set the anchor
    assert t.timeout_s("p") == 30.0
    t.observe("p", 3.0, correct=True)
    assert t.timeout_s("p") == pytest.approx(4.5)
    t.observe("p", 2.0, correct=True)                    # faster correct run: anchor stays 3 s
    assert t.timeout_s("p") == pytest.approx(4.5)
    t.observe("p", 5.0, correct=True)
    assert t.timeout_s("p") == pytest.approx(7.5)
    assert t.timeout_s("q") == 30.0                      # per problem
    restored = AdaptiveTimeouts()
    restored.load_state_dict(t.state_dict())
    assert restored.timeout_s("p") == pytest.approx(7.5) and len(restored) == 1


def test_dataset_anchor_until_an_online_one_exists() -> None:
    t = AdaptiveTimeouts()
    meta = {"time_anchor_s": 8.0}
    assert dataset_anchor(meta) == 8.0 and dataset_anchor({"time_anchor_s": True}) is None
    assert t.timeout_s("p", meta) == pytest.approx(12.0)
    t.observe("p", 1.0, correct=True)
    assert t.timeout_s("p", meta) == 2.0                 # online anchor wins
