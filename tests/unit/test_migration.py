"""Recompute-style migration: continuation budgets, seeds and the merge of a request's parts."""
from __future__ import annotations

import pytest

from megatron_rl.rollout.driver.migration import (
    MigrationRecord,
    continuation_request,
    continuation_seed,
    merge_completions,
)
from megatron_rl.rollout.engine import Completion, GenerationRequest

ORIGINAL = GenerationRequest("r", [1, 2, 3], max_tokens=10, seed=7, temperature=0.7, top_p=0.9, return_logprobs=True)


def part(rid: str, tokens: list[int], reason: str = "abort", version: int = 0, t0: float = 0.0, t1: float = 0.0):
    return Completion(rid, tokens, [-0.1 * (i + 1) for i in range(len(tokens))], reason, version, t0, t1)


def test_continuation_budget_prompt_and_sampling():
    cont = continuation_request(ORIGINAL, [50, 51, 52, 53], "r#m1")
    assert cont.request_id == "r#m1"
    assert cont.prompt_ids == [1, 2, 3, 50, 51, 52, 53]
    assert cont.max_tokens == 6  # 10 - 4 already generated
    assert (cont.temperature, cont.top_p, cont.return_logprobs) == (0.7, 0.9, True)
    assert ORIGINAL.prompt_ids == [1, 2, 3]  # the original is not modified
    # A fresh but reproducible RNG stream: not the original seed, same every time.
    assert cont.seed != ORIGINAL.seed
    assert cont.seed == continuation_request(ORIGINAL, [9, 9, 9, 9], "x").seed == continuation_seed(7, 4)
    assert continuation_seed(7, 5) != continuation_seed(7, 4) != continuation_seed(8, 4)
    assert 0 <= cont.seed < 2**31


def test_budget_used_up_and_over():
    assert continuation_request(ORIGINAL, list(range(10)), "r#m1") is None
    last = continuation_request(ORIGINAL, list(range(9)), "r#m1")
    assert last.max_tokens == 1 and len(last.prompt_ids) + last.max_tokens == len(ORIGINAL.prompt_ids) + 10
    with pytest.raises(ValueError, match="exceed its budget"):
        continuation_request(ORIGINAL, list(range(11)), "r#m1")


def test_empty_partial_keeps_the_seed():
    # Aborted before its first token: it samples exactly as if it had never moved.
    cont = continuation_request(ORIGINAL, [], "r#m1")
    assert (cont.prompt_ids, cont.max_tokens, cont.seed) == ([1, 2, 3], 10, 7)


def test_migrated_twice_budget_and_merge():
    record = MigrationRecord(ORIGINAL)
    record.parts.append(part("r", [50, 51, 52], t0=1.0, t1=2.0))
    first = record.continuation("r#m1")
    assert first.max_tokens == 7
    record.parts.append(part("r#m1", [60, 61], t0=2.5, t1=3.0))
    second = record.continuation("r#m2")
    assert second.prompt_ids == [1, 2, 3, 50, 51, 52, 60, 61]
    assert second.max_tokens == 5 == ORIGINAL.max_tokens - 3 - 2
    assert record.migrations == 2
    # Chaining from the previous continuation gives the same prompt and budget.
    chained = continuation_request(first, [60, 61], "r#m2")
    assert (chained.prompt_ids, chained.max_tokens) == (second.prompt_ids, second.max_tokens)

    final = part("r#m2", [70, 71, 72, 73, 74], reason="length", t0=3.5, t1=9.0)
    merged = record.merged(final)
    assert merged.request_id == "r"
    assert merged.token_ids == [50, 51, 52, 60, 61, 70, 71, 72, 73, 74]
    assert len(merged.token_ids) == ORIGINAL.max_tokens
    assert merged.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.1, -0.2, -0.1, -0.2, -0.3, -0.4, -0.5])
    assert (merged.finish_reason, merged.submit_time, merged.finish_time) == ("length", 1.0, 9.0)
    assert record.parts[-1].request_id == "r#m1"  # merging does not add the final part to the record


def test_merge_with_empty_parts_and_reason_override():
    parts = [part("r", []), part("r#m1", [5, 6], t1=4.0)]
    merged = merge_completions("r", parts, finish_reason="length")
    assert (merged.token_ids, merged.finish_reason, merged.finish_time) == ([5, 6], "length", 4.0)
    assert merge_completions("r", [part("r", [])]).token_ids == []
    with pytest.raises(ValueError, match="no parts"):
        merge_completions("r", [])


def test_merge_refuses_mixed_weight_versions():
    with pytest.raises(ValueError, match="off-policy"):
        merge_completions("r", [part("r", [1], version=1), part("r#m1", [2], reason="stop", version=2)])
