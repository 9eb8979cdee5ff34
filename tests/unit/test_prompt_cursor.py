"""PromptCursor: exactly-once per epoch, seeded order, resume from state."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_rl.data.cursor import PromptCursor


def test_each_epoch_visits_every_prompt_once():
    cursor = PromptCursor(10, seed=3)
    first = cursor.take(4) + cursor.take(4) + cursor.take(2)
    assert sorted(first) == list(range(10))
    assert cursor.epoch == 0 and cursor.position == 10
    second = cursor.take(10)
    assert sorted(second) == list(range(10))
    assert first != second  # reshuffled by seed + epoch
    assert cursor.consumed == 20


def test_order_is_seed_plus_epoch_permutation():
    cursor = PromptCursor(7, seed=11)
    assert cursor.take(7) == np.random.default_rng(11).permutation(7).tolist()
    assert cursor.take(7) == np.random.default_rng(12).permutation(7).tolist()
    assert PromptCursor(7, seed=11).take(7) != PromptCursor(7, seed=99).take(7)


def test_no_shuffle_is_sequential():
    cursor = PromptCursor(5, seed=0, shuffle=False)
    assert cursor.take(3) == [0, 1, 2]
    assert cursor.take(3) == [3, 4, 0]
    assert cursor.take(4) == [1, 2, 3, 4]


def test_straddling_batch_has_no_duplicates_and_epochs_stay_exact():
    cursor = PromptCursor(10, seed=0)
    batches = [cursor.take(4) for _ in range(10)]  # 40 prompts = 4 epochs, boundaries mid-batch
    for batch in batches:
        assert len(set(batch)) == 4
    flat = [i for b in batches for i in b]
    for epoch in range(4):
        assert sorted(flat[epoch * 10 : (epoch + 1) * 10]) == list(range(10))


def test_resume_continues_exactly():
    reference = PromptCursor(13, seed=5)
    expected = [reference.take(5) for _ in range(8)]

    cursor = PromptCursor(13, seed=5)
    got = [cursor.take(5) for _ in range(3)]  # stops mid-epoch, right after a straddle
    state = json.loads(json.dumps(cursor.state_dict()))  # survives a JSON checkpoint
    resumed = PromptCursor(13, seed=5)
    resumed.load_state_dict(state)
    got += [resumed.take(5) for _ in range(5)]
    assert got == expected


def test_load_state_refuses_other_dataset_or_seed():
    state = PromptCursor(10, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_prompts"):
        PromptCursor(11, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptCursor(10, seed=2).load_state_dict(state)


def test_edge_cases():
    assert PromptCursor(3, seed=0).take(0) == []
    big = PromptCursor(3, seed=0).take(7)  # larger than an epoch: wraps twice
    assert sorted(big[:3]) == sorted(big[3:6]) == [0, 1, 2]
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptCursor(0, seed=0)
    with pytest.raises(ValueError, match="n >= 0"):
        PromptCursor(3, seed=0).take(-1)
