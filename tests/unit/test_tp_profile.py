"""Rollout-TP profiles: built from earlier runs' metrics, read back with errors that name the
file and key, and used by the elastic-TP hook for each round type's first TP."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.config.validation import validate
from megatron_rl.config.values import ConfigError
from rollpacker.tp_profile import ProfileError, fastest_tp, load_profile, profile_from_runs, save_profile


def fake_run(root: Path, name: str, tp: int, rows: list[dict]) -> Path:
    run = root / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"rollout": {"tensor_parallel_size": tp}}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_profile_is_the_mean_rollout_time_per_round_type_and_tp(tmp_path):
    tp1 = fake_run(tmp_path, "tp1", 1, [{"round_type": "short", "time/rollout": 2.0},
                                        {"round_type": "short", "time/rollout": 4.0},
                                        {"round_type": "long", "time/rollout": 9.0}])
    # An elastic run: each row says the TP it ran at.
    elastic = fake_run(tmp_path, "elastic", 1, [{"round_type": "long", "time/rollout": 6.0, "planner/rollout_tp": 2.0},
                                                {"round_type": "short", "time/rollout": 5.0, "planner/rollout_tp": 2.0}])
    profile, counts = profile_from_runs([tp1, elastic])
    assert profile == {"short": {1: 3.0, 2: 5.0}, "long": {1: 9.0, 2: 6.0}}
    assert counts == {"short": {1: 2, 2: 1}, "long": {1: 1, 2: 1}}
    assert fastest_tp(profile, [1, 2]) == {"short": 1, "long": 2}
    assert fastest_tp(profile, [1]) == {"short": 1, "long": 1}  # TP 2 not legal here
    save_profile(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile


def test_cli_writes_the_profile_and_reports_bad_runs(tmp_path, capsys):
    from rollpacker.benchmarks import rollout_profile

    run = fake_run(tmp_path, "r", 2, [{"round_type": "long", "time/rollout": 7.5}])
    assert rollout_profile.main(["--run", str(run), "--out", str(tmp_path / "p.json")]) == 0
    assert "| long | 2 | 1 | 7.50 |" in capsys.readouterr().out
    assert load_profile(tmp_path / "p.json") == {"long": {2: 7.5}}
    bad = fake_run(tmp_path, "bad", 1, [{"round_type": "short"}])
    assert rollout_profile.main(["--run", str(bad), "--out", str(tmp_path / "q.json")]) == 2
    assert "metrics.jsonl:1" in capsys.readouterr().err
    assert rollout_profile.main(["--run", str(tmp_path / "none"), "--out", str(tmp_path / "q.json")]) == 2


@pytest.mark.parametrize("content, match", [
    ("{", "not valid JSON"),
    ('{"short": {"x": 1.0}}', "TP 'x'"),
    ('{"short": {"1": -2}}', "seconds must be a positive number"),
    ('{"short": []}', "'short'"),
])
def test_bad_profiles_name_the_file_and_key(tmp_path, content, match):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=match):
        load_profile(path)
    with pytest.raises(ConfigError, match="planner.profile"):
        validate(load_config(None, [f"planner.profile={path}"]), device="cpu")


def test_config_refuses_missing_file_and_unknown_round_types(tmp_path):
    with pytest.raises(ConfigError, match="planner.profile: .*no such profile file"):
        validate(load_config(None, [f"planner.profile={tmp_path / 'missing.json'}"]), device="cpu")
    (tmp_path / "p.json").write_text('{"medium": {"1": 1.0}}')
    with pytest.raises(ConfigError, match=r"unknown round types \['medium'\]"):
        validate(load_config(None, [f"planner.profile={tmp_path / 'p.json'}"]), device="cpu")


def test_the_hook_starts_each_round_type_at_its_fastest_profiled_tp(tmp_path):
    from megatron_rl.model.tiny import build_tiny_qwen2
    from rollpacker.elastic_tp import build_elastic_tp
    from tests.helpers.fake_engine import FakeEngine

    model = build_tiny_qwen2(tmp_path / "m", seed=0)  # 4 heads, 2 KV heads: TP 1 and 2 legal
    (tmp_path / "p.json").write_text(json.dumps({"short": {"1": 3.0, "2": 4.0}, "long": {"1": 9.0, "2": 6.0}}))
    overrides = [f"model.hf_path={model}", "rollout.num_engines=2", f"planner.profile={tmp_path / 'p.json'}"]
    hook = build_elastic_tp(load_config(None, overrides), FakeEngine(lambda r: 1), None, on_gpu=False)
    assert (hook.planner.tp_for("short"), hook.planner.tp_for("long")) == (1, 2)
    # An explicit planner.initial_tp entry wins over the profile.
    hook = build_elastic_tp(load_config(None, [*overrides, "planner.initial_tp=long:1"]), FakeEngine(lambda r: 1),
                            None, on_gpu=False)
    assert hook.planner.tp_for("long") == 1
