"""megatron_rl/benchmarks/speculative_engine_check.py: argument checks and the report's figures (the engine part
runs the real vLLM engine: `megatron-rl-benchmark speculative_engine_check`, docs/speculation.md
"Benchmarks")."""
from __future__ import annotations

import pytest

from megatron_rl.benchmarks import speculative_engine_check as check


def _model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_bad_arguments_name_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        check.parse_args(["--model", str(tmp_path / "absent")])
    assert "--model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check.parse_args(["--model", _model(tmp_path), "--narrow-tokens", "0"])
    assert "--narrow-tokens must be positive" in capsys.readouterr().err


def _run(seconds, steps, tokens, drafted=0, accepted=0):
    return {"seconds": seconds, "decode_steps": steps, "tokens": tokens, "ms_per_token": 1e3 * seconds / tokens,
            "ms_per_step": 1e3 * seconds / steps, "draft_tokens": drafted, "accepted_tokens": accepted}


def test_report_gives_medians_ranges_acceptance_and_the_ratio():
    summary = {"runs": {
        "wide": {"off": [_run(4.0, 100, 2000), _run(6.0, 100, 2000)], "on": [_run(10.0, 80, 2000, 400, 100)] * 2},
        "narrow": {"off": [_run(3.0, 300, 1000)] * 2, "on": [_run(1.5, 150, 1000, 600, 450), _run(2.1, 150, 1000, 600, 450)]},
    }}
    summary["ratio_ms_per_token"] = {"wide": 5.0 / 2.5, "narrow": 0.9}
    text = check.report(summary)
    assert "| wide | off | 5.0 [4.0-6.0] | 100 [100-100] | 2000 [2000-2000] | 2.50 [2.00-3.00] |" in text
    assert "| narrow | on |" in text and "| 0.75 |" in text  # 900 accepted of 1200 drafted
    assert "| wide | off |" in text and text.splitlines()[2].endswith("| - |")  # no drafts: no acceptance
    assert text.splitlines()[-1] == "drafts on / off, time per generated token: wide 2.00, narrow 0.90"


def test_report_adds_the_plain_engine_arm_and_first_calls(tmp_path):
    summary = {"runs": {
        "wide": {"off": [_run(6.0, 100, 2000)], "on": [_run(6.0, 90, 2000, 100, 10)], "plain": [_run(5.0, 100, 2000)]},
        "narrow": {"off": [_run(3.0, 300, 1000)], "on": [_run(2.0, 150, 1000, 600, 450)], "plain": [_run(2.5, 300, 1000)]},
    }, "ratio_ms_per_token": {"wide": 1.0, "narrow": 2 / 3}, "first_call_s": {"spec": 0.51, "plain": 9.25},
        "ratio_off_vs_plain": {"wide": 1.2, "narrow": 1.2}}
    text = check.report(summary)
    assert "| wide | plain | 5.0 [5.0-5.0] |" in text
    assert "first call (plain engine): 9.25 s" in text
    assert "undrafted steps on the speculative engine / plain engine, time per token: narrow 1.20" in text
    assert text.splitlines()[-1] == "drafts on / off, time per generated token: wide 1.00, narrow 0.67"
    args = check.parse_args(["--model", _model(tmp_path), "--plain-engine", "--torch-compile"])
    assert args.plain_engine and args.torch_compile

