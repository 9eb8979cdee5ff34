"""The simulator's speculative engine model: expected tokens per step, cost per token, and that
speculating long rounds shortens them and nothing else in the policy table."""
from __future__ import annotations

import pytest

from rollpacker.simulator.engine_model import EngineModel
from rollpacker.simulator.speculation import SpeculativeEngine, expected_tokens_per_step

BASE = EngineModel(step_s=0.02, per_seq_s=1e-5, per_ctx_token_s=1e-9, prefill_token_s=1e-5,
                   kv_capacity_tokens=10**6, max_num_seqs=256)


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(0.5, 1) == pytest.approx(1.5)
    # Geometric sum 1 + a + ... + a^k, checked by brute force over the acceptance events.
    a, k = 0.59, 4
    assert expected_tokens_per_step(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))
    with pytest.raises(ValueError, match="acceptance"):
        expected_tokens_per_step(1.0, 4)


def test_memory_bound_decode_gets_faster_and_compute_bound_can_get_slower():
    spec = SpeculativeEngine.wrap(BASE, 0.6, 4)
    small, huge = 4, 100_000
    # Few sequences (a long round's tail): the weight read dominates; fewer steps win.
    assert spec.decode_time(small, 1000, 500) < BASE.decode_time(small, 1000, 500) / 1.8
    # Very many sequences: compute dominates and verifying k+1 tokens each costs more than it saves.
    assert spec.decode_time(huge, 1000, 10) > BASE.decode_time(huge, 1000, 10)
    # No drafts: identical to the plain model.
    none = SpeculativeEngine.wrap(BASE, 0.0, 0)
    assert none.decode_time(7, 300, 50) == pytest.approx(BASE.decode_time(7, 300, 50))


def test_policy_table_speculates_long_rounds_only():
    from rollpacker.simulator.lengths import LogNormalLengths
    from rollpacker.simulator.runner import cumulative
    from tests.helpers.simulator_cluster import small_cluster

    cl = small_cluster(LogNormalLengths(100, 0.9, 0.7, 4000, 32))
    plain = cumulative(cl, 10, 0, 1.25, 1.25)
    spec = cumulative(cl, 10, 0, 1.25, 1.25, spec=(0.6, 4))
    assert [s.name for s in spec] == [s.name for s in plain] + ["+ speculation (long)"]
    last, full = spec[-1], plain[-1]
    assert last.mean_of("long") < full.mean_of("long")
    assert last.mean_of("short") == pytest.approx(full.mean_of("short"))
