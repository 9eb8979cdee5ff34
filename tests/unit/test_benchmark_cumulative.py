"""``rollpacker-benchmark --compare cumulative`` with the training runs faked: the options, the
ABCD / DCBA order, the columns differing exactly in their mechanism's keys (the last one being
tiny_cpu_full's mechanism set), the ratios and the recorded file; and docs/results/cumulative.md
against docs/results/cumulative.json. The real runs: docs/results/cumulative.md (the command)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_rl.config.loading import load_config
from rollpacker.benchmarks import benchmark, benchmark_cumulative, cumulative_table
from rollpacker.benchmarks.benchmark_cumulative import COLUMNS, NAMES, column_run_config, parse_args, run_order
from tests.helpers.fake_loop_runs import fake_loop_runs

REPO = Path(__file__).resolve().parents[2]
LOOP_TIME = {"tail": 10.0, "+planner": 12.5, "+stream": 10.0, "+spec": 8.0}
"""Seconds per step of each column (seed 0); later seeds are 10 % slower. +planner loses 0.8x."""


def flat(cfg) -> dict:
    """Every leaf of a config as {'section.key': value} (plugin sections under their own name)."""
    out = {}

    def walk(prefix, obj):
        items = obj.items() if isinstance(obj, dict) else ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
        for name, value in items:
            if dataclasses.is_dataclass(value) or isinstance(value, dict):
                walk("" if name == "extensions" else f"{prefix}{name}.", value)
            else:
                out[f"{prefix}{name}"] = value
    walk("", cfg)
    return out


def configs_by_column(tmp_path: Path) -> dict:
    args = parse_args(["--model", str(REPO / "artifacts/tiny-qwen2.5-rechecks")])
    return {n: flat(column_run_config(args, COLUMNS, n, 7, tmp_path / "run", 2)) for n in NAMES}


def test_options_defaults_and_bad_input() -> None:
    args = parse_args([])
    assert (args.seeds, args.runs, args.columns, args.record) == (3, 2, 4, False)
    assert args.model.endswith("artifacts/tiny-qwen2.5-rechecks")
    for bad in (["--seeds", "0"], ["--columns", "5"], ["--columns", "2", "--record"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_interleave_order_alternates_abcd_and_dcba() -> None:
    order = run_order(2, [1, 2, 3])
    assert [(p, s) for p, s, _ in order] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert [o for _, _, o in order] == [NAMES, NAMES[::-1]] * 3


def test_columns_differ_exactly_in_their_mechanisms_keys(tmp_path: Path) -> None:
    cfgs = configs_by_column(tmp_path)
    expected = [set(), {"planner.enabled", "planner.initial_tp"},
                {"stream.enabled", "stream.release_engines", "stream.train_threads"},
                {"rollout.speculative.method", "tail_batching.history_routing"}]
    for prev, name, keys in zip(NAMES, NAMES[1:], expected[1:]):
        diff = {k for k in cfgs[name] if cfgs[name][k] != cfgs[prev][k]}
        assert diff == keys, name
    # +spec carries tiny_cpu_full's mechanism and shared settings; tail has every mechanism off.
    full = flat(load_config(REPO / "examples/qwen2.5/tiny_cpu_full.yaml"))
    sections = ("planner.", "stream.", "rollout.speculative.", "tail_batching.")
    shared = ("rollout.num_engines", "rollout.sleep_during_train", "rollout.sleep_level", "trainer.offload_during_rollout")
    for key, value in full.items():
        if key.startswith(sections) or key in shared:
            assert cfgs["+spec"][key] == value, key
    tail = cfgs["tail"]
    assert not tail["planner.enabled"] and not tail["stream.enabled"] and not tail["tail_batching.history_routing"]
    assert tail["rollout.speculative.method"] == "off" and tail["scheduler.name"] == "tail_batching"


def fake_rows(name: str, seed_offset: int, steps: int) -> list[dict]:
    rows = []
    for step in range(steps):
        long = step % 5 == 4
        row = {"step": step, "round_type": "long" if long else "short", "time/step": LOOP_TIME[name] * (1 + 0.1 * seed_offset),
               "time/rollout": 3.0 if long else 1.0, "time/train": 1.0, "reward/mean": 0.5,
               "rollout/spec/decode_steps": 100.0}
        if name != "tail":
            row.update({"planner/switched": float(step % 5 in (0, 4)), "time/engine_switch": 2.0, "planner/preemptions": 0.0})
        if name in ("+stream", "+spec") and long:
            row.update({"stream/started": 1.0, "stream/released_engines": 1.0, "stream/hidden_train_s": 0.5})
        if name == "+spec" and long:
            row.update({"rollout/spec/draft_tokens": 40.0, "rollout/spec/accepted_tokens": 10.0})
        rows.append(row)
    return rows


def test_benchmark_records_the_runs_and_the_page_renders_them(monkeypatch, tmp_path, capsys) -> None:
    configs, model = fake_loop_runs(monkeypatch, tmp_path, NAMES, fake_rows)
    (model / "model.safetensors").write_bytes(b"weights")
    seen = {}

    def fake_simulated(acceptance, spec_tokens):
        seen["spec"] = (acceptance, spec_tokens)
        return {"r.yaml": [{"policy": "baseline (veRL)", "step_s": 20.0, "speedup": 1.0},
                           {"policy": "tail batching", "step_s": 10.0, "speedup": 2.0},
                           {"policy": "+ reward scheduler", "step_s": 8.0, "speedup": 2.5}]}
    monkeypatch.setattr(benchmark_cumulative, "simulated", fake_simulated)
    out = tmp_path / "out"
    argv = ["--compare", "cumulative", "--model", str(model), "--seeds", "2", "--runs", "1", "--seed", "5",
            "--periods", "1", "--out", str(out)]
    assert benchmark.main(argv) == 0
    assert [c.trainer.run_dir.rsplit("/", 1)[1] for c in configs] == ["tail", "_planner", "_stream", "_spec",
                                                                       "_spec", "_stream", "_planner", "tail"]
    assert seen["spec"] == (0.25, 4)  # the measured acceptance goes to the simulator
    result = json.loads((out / "cumulative.json").read_text())
    logged = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["column"], r["seed"]) for r in logged] == [(n, 5) for n in NAMES] + [(n, 6) for n in NAMES[::-1]]
    assert result["command"].endswith(" ".join(argv[2:])) and result["hardware"]["cores"] >= 1
    assert len(result["model"]["weights_sha256"]) == 64 and list(result["columns"]) == NAMES
    cols = result["runs"]["seed 6, pass 0"]
    assert cols["+planner"]["step_gain"] == pytest.approx(0.8) and cols["+spec"]["speedup"] == pytest.approx(1.25)
    assert cols["+planner"]["planner_switches"] == 2 and cols["+stream"]["released_engines"] == 1
    assert cols["+spec"]["acceptance"] == pytest.approx(0.25) and cols["tail"]["preemptions"] is None
    text = cumulative_table.render(result)
    assert "below 1): `+planner` 0.80x (0.94x [0.94x-0.95x] with TP switches excluded)." in text.replace("\n", " ") and "| speedup vs `tail` | 1.00 | 0.80 | 1.00 | 1.25 |" in text
    assert "**Simulated, not measured**" in text and "| tail batching | 10.0 s, x2.00 (x0.80) |" in text
    page = tmp_path / "p.md"
    page.write_text(f"intro\n{cumulative_table.START}\nold\n{cumulative_table.END}\nrest\n")
    assert cumulative_table.main([str(out / "cumulative.json"), str(page)]) == 0
    assert page.read_text() == f"intro\n{cumulative_table.START}\n{text}\n{cumulative_table.END}\nrest\n"
    with pytest.raises(ValueError, match="markers"):
        cumulative_table.update("no markers", result)


def test_docs_page_matches_the_recorded_result() -> None:
    result = json.loads((REPO / "docs/results/cumulative.json").read_text())
    page = (REPO / "docs/results/cumulative.md").read_text()
    assert cumulative_table.update(page, result) == page, \
        "docs/results/cumulative.md is stale: run python -m rollpacker.benchmarks.cumulative_table"
    assert list(result["columns"]) == NAMES and len(result["runs"]) >= 2
    assert all(set(cols) == set(NAMES) for cols in result["runs"].values())
