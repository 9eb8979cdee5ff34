"""Dynamic batching: DP balance, token-budget microbatches, padded tensor layout."""
from __future__ import annotations

import random

import pytest
import torch

from megatron_rl.training.packing import (
    balance_across_ranks,
    build_microbatch,
    pack_microbatches,
    response_values,
)


def test_pack_respects_budget_and_uses_each_sequence_once() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(5, 120) for _ in range(200)]
    budget = 512
    bins = pack_microbatches(lengths, budget)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(200))
    for b in bins:
        assert len(b) * max(lengths[i] for i in b) <= budget
    # Deterministic.
    assert pack_microbatches(lengths, budget) == bins


def test_pack_hand_example() -> None:
    # Longest first: 10 opens bin 0 (cost 10); 8 -> 2*10=20 > 16 opens bin 1; 6 -> 2*8 fits bin 1;
    # 3 -> bin 0 would cost 20, bin 1 would cost 24 -> bin 2.
    assert pack_microbatches([3, 10, 6, 8], 16) == [[1], [3, 2], [0]]
    # Oversized sequences stand alone.
    assert pack_microbatches([50, 2, 2], 16) == [[0], [1, 2]]
    assert pack_microbatches([4, 4, 4], 1000) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_microbatches([1], 0)


def test_balance_quality_and_coverage() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(10, 1000) for _ in range(64)]
    parts = balance_across_ranks(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(64))
    loads = [sum(lengths[i] for i in p) for p in parts]
    # LPT is within 4/3 of optimal; the optimum is at least the mean load.
    assert max(loads) <= (4 / 3) * (sum(lengths) / 4) + max(lengths)
    assert max(loads) - min(loads) <= max(lengths)
    # Hand example: 9 -> r0, 7 -> r1, 5 -> r1 (7<9), 4 -> r0 (9<12), 1 -> r0 (13 vs 12 -> r1).
    assert balance_across_ranks([5, 9, 1, 7, 4], 2) == [[1, 4], [0, 2, 3]]
    with pytest.raises(ValueError, match="data_parallel_size"):
        balance_across_ranks([3], 2)


def test_build_microbatch_layout() -> None:
    seqs = [([1, 2, 3], [4, 5]), ([7, 8], [9, 10, 11, 12])]
    mb = build_microbatch(
        seqs, sample_indices=[5, 2],
        token_fields={"old_logprobs": [[-0.1, -0.2], [-1.0, -2.0, -3.0, -4.0]]},
        seq_fields={"advantage": [0.5, -1.5]},
    )
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 5, 0], [7, 8, 9, 10, 11, 12]]
    assert mb.labels.tolist() == [[2, 3, 4, 5, 0, 0], [8, 9, 10, 11, 12, 0]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5]] * 2
    assert mb.segment_ids.tolist() == [[5, 5, 5, 5, 5, -1], [2] * 6]
    assert mb.seq_ids.tolist() == [5, 2]
    assert mb.num_response_tokens == 6
    assert torch.allclose(mb.fields["old_logprobs"][0], torch.tensor([0, 0, -0.1, -0.2, 0, 0]))
    assert mb.fields["advantage"][1].tolist() == [0, -1.5, -1.5, -1.5, -1.5, 0]
    # The label at every masked position is the response token it scores.
    assert mb.labels[mb.loss_mask.bool()].tolist() == [4, 5, 9, 10, 11, 12]
    got = response_values(mb.fields["old_logprobs"], mb)
    assert got[0] == pytest.approx([-0.1, -0.2]) and got[1] == [-1, -2, -3, -4]


def test_build_microbatch_rejects_mismatched_field() -> None:
    with pytest.raises(ValueError, match="sample 3: field 'old_logprobs'"):
        build_microbatch([([1], [2, 3])], [3], token_fields={"old_logprobs": [[0.0]]})
