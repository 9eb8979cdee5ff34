"""megatron_rl/tools/make_tiny_model.py (megatron-rl-make-tiny-model): output loads in transformers, same seed gives the same weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_tool():
    from megatron_rl.tools import make_tiny_model

    return make_tiny_model


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_tiny_model_is_deterministic_and_loads(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tool = _load_tool()
    kwargs = dict(seed=3, sft_steps=3, batch_size=4, eval_prompts=2, num_threads=1, progress=False)
    threads_before = torch.get_num_threads()
    first = tool.make_tiny_model(tmp_path / "a", **kwargs)
    second = tool.make_tiny_model(tmp_path / "b", **kwargs)
    assert torch.get_num_threads() == threads_before  # global torch state restored

    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert first.final_loss == second.final_loss
    # SFT changed the random init (built with the same seed).
    from megatron_rl.model.tiny import build_tiny_qwen2

    shape = tool.ModelShape()
    init_dir = build_tiny_qwen2(
        tmp_path / "init", seed=3, hidden_size=shape.hidden_size, num_layers=shape.num_layers,
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size, max_position_embeddings=shape.max_position_embeddings,
    )
    init = load_file(init_dir / "model.safetensors")
    assert not torch.equal(init["model.embed_tokens.weight"], a["model.embed_tokens.weight"])

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 320)
    assert cfg.hidden_size // cfg.num_attention_heads >= 32 and cfg.tie_word_embeddings
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    report = json.loads((tmp_path / "a" / "make_tiny_model.json").read_text())
    assert report["sft_steps"] == 3 and report["seed"] == 3
    assert 0.0 <= report["greedy_accuracy"] <= 1.0
    # Atomic write: no temporary siblings left; a rerun replaces the directory in place.
    tool.make_tiny_model(tmp_path / "a", **{**kwargs, "seed": 4})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "init"]
    assert json.loads((tmp_path / "a" / "make_tiny_model.json").read_text())["seed"] == 4


def test_micro_batches_respect_budget_and_keep_every_example():
    tool = _load_tool()
    examples = [([0] * n, [0] * n) for n in (5, 50, 3, 20, 8)]
    batches = tool._micro_batches(examples, token_budget=40)
    assert [[len(e[0]) for e in b] for b in batches] == [[3, 5, 8], [20], [50]]


def test_lr_schedule():
    tool = _load_tool()
    # 100 steps: warm-up over 5, hold until 80, then linear to 10% of the peak at step 100.
    assert tool._lr_at(0, 100, 1.0) == pytest.approx(0.2)
    assert tool._lr_at(4, 100, 1.0) == pytest.approx(1.0)
    assert tool._lr_at(79, 100, 1.0) == pytest.approx(1.0)
    assert tool._lr_at(90, 100, 1.0) == pytest.approx(0.55)
    assert tool._lr_at(100, 100, 1.0) == pytest.approx(0.1)


def test_recheck_style_makes_a_random_minority_of_targets_long_within_the_budget():
    import statistics

    from megatron_rl.data import arithmetic

    tool = _load_tool()
    problems = arithmetic.make_problems(2000, seed=0, start=1_000_000)
    assert all(tool.RecheckStyle().solution(p, 0) == p.solution for p in problems[:50])  # rate 0: unchanged
    style = tool.RecheckStyle(rate=0.08, continue_prob=0.9, max_response_tokens=736)
    targets = [style.solution(p, 0) for p in problems]
    assert targets == [style.solution(p, 0) for p in problems]  # a function of (seed, problem)
    verbose = [t for t in targets if arithmetic.RECHECK_LINE in t]
    assert 0.06 <= len(verbose) / len(targets) <= 0.10
    assert max(len(t) for t in targets) <= 736
    for problem, target in zip(problems, targets):  # still solves the problem
        assert arithmetic.score(target, problem.answer)
    plain = statistics.median(len(p.solution) for p in problems)
    # The style is independent of the problem: verbose targets are long whatever the step count.
    assert statistics.median(len(t) for t in verbose) >= 5 * plain
