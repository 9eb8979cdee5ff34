"""rollpacker.benchmarks.benchmark_speculative (``--compare speculative``) end to end on recorded
metrics: the loop runs are replaced by rows whose figures are known (the real runs are
``tests/integration``'s loop tests), so the speedups, the ratio lines and the curves can be checked."""
from __future__ import annotations

import json

import pytest

from rollpacker.benchmarks import benchmark
from tests.helpers.fake_loop_runs import fake_loop_runs

STEP_TIME = {"baseline": 10.0, "tail": 5.0, "tail+spec+hist": 4.0}
LONG_ROLLOUT = {"baseline": 2.0, "tail": 3.0, "tail+spec+hist": 2.0}
"""Per column: seconds of every step, and of the rollout of a long round."""


def fake_row(name: str, step: int, steps: int) -> dict:
    """Step ``step`` of a column: the last step of a tail-batching column is its long round;
    validation at the first and the last step; the speculative column drafts 40, accepts 30."""
    long = name != "baseline" and step == steps - 1
    row = {"step": step, "round_type": "long" if long else "short", "time/step": STEP_TIME[name],
           "time/rollout": LONG_ROLLOUT[name] if long else 1.0, "time/train": 1.0, "reward/mean": 0.1 * step,
           **({"val/pass@1": 0.2 + 0.01 * step} if step in (0, steps - 1) else {})}
    if name == "tail+spec+hist":
        row.update({"rollout/spec/draft_tokens": 40.0, "rollout/spec/accepted_tokens": 30.0})
    return row


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    return fake_loop_runs(monkeypatch, tmp_path, list(STEP_TIME),
                          lambda name, seed_offset, steps: [fake_row(name, i, steps) for i in range(steps)])


def test_three_columns_per_seed_and_the_speedups_of_tail_batching_and_speculation(fake_runs, tmp_path, capsys):
    configs, model = fake_runs
    out = tmp_path / "out"
    rc = benchmark.main(["--compare", "speculative", "--model", str(model), "--seeds", "2", "--seed", "5",
                         "--runs", "1", "--periods", "1", "--out", str(out)])
    assert rc == 0
    # Interleaved: as listed for seed 5, reversed for seed 6.
    assert [c.trainer.run_dir.rsplit("/", 1)[1] for c in configs] == [
        "baseline", "tail", "tail_spec_hist", "tail_spec_hist", "tail", "baseline"]
    assert [c.scheduler.name for c in configs] == ["baseline", "tail_batching", "tail_batching",
                                                   "tail_batching", "tail_batching", "baseline"]
    assert [c.trainer.seed for c in configs] == [5] * 3 + [6] * 3
    spec = [c for c in configs if c.trainer.run_dir.endswith("tail_spec_hist")]
    assert len(spec) == 2 and all(c.rollout.speculative.method == "suffix" for c in spec)
    # Two validations per run, the same workload in every column.
    steps = configs[0].trainer.steps
    assert {c.data.eval_every for c in configs} == {max(1, steps // 2)}
    assert len({(c.trainer.steps, c.data.builtin_num_prompts) for c in configs}) == 1

    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3] == "tail batching speedup (baseline / tail): 2.00 (range 2.00-2.00, 2 runs: 2.00, 2.00)"
    assert lines[-2] == "long-round rollout speedup (speculation): 1.50 (range 1.50-1.50, 2 runs: 1.50, 1.50)"
    assert lines[-1] == "speedup: 2.50"
    result = json.loads((out / "speculative.json").read_text())
    assert result["speedups"] == [pytest.approx(2.5)] * 2
    assert result["runs"]["seed 5, pass 0"]["tail+spec+hist"]["acceptance"] == pytest.approx(0.75)
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_recorded_results_file_keeps_the_pages_rows_and_renders_the_runs(fake_runs, tmp_path):
    from megatron_rl.tools.results_tables import render

    configs, model = fake_runs
    (model / "model.safetensors").write_bytes(b"weights")
    path = tmp_path / "speculative.json"
    rows = [{"title": "loop (s)", "key": "loop_time", "format": "{:.1f}"},
            {"title": "train (s, whole run)", "key": ["split", "train"], "format": "{:.1f}"}]
    path.write_text(json.dumps({"rows": rows, "source": "transcribed from docs", "summary": {}}))
    assert benchmark.main(["--compare", "speculative", "--model", str(model), "--seeds", "2", "--runs", "1",
                           "--periods", "1", "--out", str(tmp_path / "out"), "--record", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["rows"] == rows and record["source"] == "recorded by the command" and "summary" not in record
    assert record["long_round_speedups"] == [pytest.approx(1.5)] * 2 and record["model"]["weights_sha256"]
    steps = configs[0].trainer.steps
    assert f"| loop (s) | {10.0 * steps:.1f} | {5.0 * steps:.1f} | {4.0 * steps:.1f} |" in render(record)
