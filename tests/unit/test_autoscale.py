"""Pool autoscaling decisions and reward-scheduler metrics."""
import pytest

from megatron_rl.reward.pool.autoscale import ScalePolicy
from megatron_rl.reward.pool.metrics import RewardStats, reward_overlap
from megatron_rl.sample import Prompt, Sample


def test_grows_on_queue_depth_or_wait_one_at_a_time() -> None:
    p = ScalePolicy(min_workers=1, max_workers=3, up_queue_per_worker=2.0, up_wait_s=1.0, down_idle_s=10.0)
    idle = {0: None, 1: None}
    assert p.decide({0: 2, 1: 2}, 0, 0.0, idle, now=0.0) == (0, None)      # 4 <= 2 x 2
    assert p.decide({0: 3, 1: 3}, 0, 0.0, idle, now=0.0) == (1, None)      # 6 > 4
    assert p.decide({0: 2, 1: 1}, 0, 1.5, idle, now=0.0) == (1, None)      # slow queue
    assert p.decide({0: 1, 1: 1}, 0, 1.5, idle, now=0.0) == (0, None)      # ... but nothing queued now
    assert p.decide({0: 3, 1: 3}, 1, 5.0, idle, now=0.0) == (0, None)      # one is still starting
    assert p.decide({0: 9, 1: 9, 2: 9}, 0, 5.0, {0: None, 1: None, 2: None}, now=0.0) == (0, None)  # at max


def test_shrinks_the_longest_idle_worker_down_to_min() -> None:
    p = ScalePolicy(min_workers=1, max_workers=3, down_idle_s=10.0)
    loads = {0: 1, 1: 0, 2: 0}
    assert p.decide(loads, 0, 0.0, {0: None, 1: 5.0, 2: 2.0}, now=11.0) == (0, None)   # idle 6 s and 9 s
    assert p.decide(loads, 0, 0.0, {0: None, 1: 5.0, 2: 0.0}, now=11.0) == (-1, 2)
    assert p.decide({0: 0}, 0, 0.0, {0: 0.0}, now=100.0) == (0, None)                 # at min
    assert not ScalePolicy(2, 2).enabled
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        ScalePolicy(3, 2)


def test_stats_window() -> None:
    stats = RewardStats()
    stats.set_busy(2, now=stats._since)
    stats.record(0.5, 1.0)
    stats.record(1.5, 2.0)
    stats.scale_ups = 1
    m = stats.drain(num_workers=2, now=stats._since + 4.0)
    assert m["reward/queue_wait_mean"] == pytest.approx(1.0)
    assert m["reward/queue_wait_max"] == pytest.approx(1.5)
    assert m["reward/busy_workers_mean"] == pytest.approx(2.0)
    assert m["reward/worker_time_s"] == pytest.approx(3.0)
    assert (m["reward/scored"], m["reward/scale_ups"], m["reward/workers"]) == (2.0, 1.0, 2.0)
    assert stats.wait_ema == pytest.approx(0.3 * 1.5 + 0.7 * 0.5)
    again = stats.drain(num_workers=2)
    assert again["reward/scored"] == 0.0 and again["reward/scale_ups"] == 0.0


def test_reward_overlap_hidden_fraction_and_tail() -> None:
    def sample(finished: float, done: float) -> Sample:
        s = Sample(prompt=Prompt("p", [1], "1"), response_index=0)
        s.timings.update(finished=finished, reward_done=done)
        return s

    # Last response finishes at t=10: the first reward (1..3) is fully hidden, the second
    # (8..12) half, the last (10..11) not at all; the step waited 2 s after generation.
    m = reward_overlap([sample(1.0, 3.0), sample(8.0, 12.0), sample(10.0, 11.0)])
    assert m["reward/latency_s"] == pytest.approx(7.0)
    assert m["reward/hidden_s"] == pytest.approx(4.0)
    assert m["reward/hidden_fraction"] == pytest.approx(4.0 / 7.0)
    assert m["reward/tail_s"] == pytest.approx(2.0)
    assert reward_overlap([]) == {}
