"""The burst of code responses megatron_rl.tools.reward_burst scores: its mix and expected verdicts."""
from __future__ import annotations

from pathlib import Path

from megatron_rl.tools.reward_burst import build_burst


def test_burst_mixes_attacks_and_honest_answers_with_their_verdicts(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    burst = build_burst(tok, 200, 0.25)
    assert len(burst) == 200
    kinds = [kind for *_, kind in burst]
    assert kinds.count("attack") == 50
    assert all(expected is False for _, expected, kind in burst if kind == "attack")
    honest = [expected for _, expected, kind in burst if kind == "honest"]
    assert True in honest and False in honest  # correct and wrong solutions both
    assert len({s.prompt.prompt_id for s, *_ in burst}) == 200
    assert all("```python" in tok.decode(s.response_ids) and s.prompt.metadata for s, *_ in burst)
    assert kinds[:50] != ["attack"] * 50  # shuffled, not attacks first
