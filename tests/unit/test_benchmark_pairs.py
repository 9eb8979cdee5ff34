"""``rollpacker-benchmark`` (baseline vs tail batching) end to end with the training runs faked: the
interleaved order, the summary's figures and last line, benchmark.json (with the command the
priced rows name) and the results file. The real runs: docs/tail_batching.md (the command)."""
from __future__ import annotations

import json
from pathlib import Path

from rollpacker.benchmarks import benchmark

STEP_S = {"baseline": 6.0, "tail_batching": 4.0}


def _rows(name: str, steps: int) -> list[dict]:
    kinds = ["baseline"] * steps if name == "baseline" else (["short"] * 4 + ["long"]) * (steps // 5)
    return [{"step": s, "round_type": kind, "time/step": STEP_S[name] * (2.0 if kind == "long" else 1.0),
             "time/rollout": 3.0, "rollout/engine_occupancy": 0.5, "response_length/mean": 40.0,
             "response_length/max": 300.0, "batch/samples_trained": 32.0, "reward/mean": 0.3, "time/weight_sync": 0.1}
            for s, kind in enumerate(kinds)]


def test_two_run_comparison_reports_and_records(monkeypatch, tmp_path, capsys):
    import megatron_rl.runtime.metrics_logger
    import megatron_rl.train

    order = []

    def build_and_run(cfg):
        run_dir = Path(cfg.trainer.run_dir)
        order.append((cfg.trainer.seed, run_dir.name))
        run_dir.mkdir(parents=True)
        (run_dir / "rollout_timeline.jsonl").write_text(json.dumps({"step": 0, "response_lengths": [10, 30, 300]}) + "\n")
        return []

    monkeypatch.setattr(megatron_rl.train, "build_and_run", build_and_run)
    monkeypatch.setattr(megatron_rl.runtime.metrics_logger, "read_metrics",
                        lambda run_dir: _rows(Path(run_dir).name, 10))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")  # what the results file's model hash reads
    out = tmp_path / "out"
    record = tmp_path / "tb.json"
    assert benchmark.main(["--model", str(model), "--out", str(out), "--seeds", "2", "--seed", "7",
                           "--record", str(record)]) == 0
    assert order == [(7, "baseline"), (7, "tail_batching"), (8, "tail_batching"), (8, "baseline")]
    text = capsys.readouterr().out
    # Baseline 10 x 6 s; tail batching 8 short x 4 s + 2 long x 8 s.
    assert text.strip().splitlines()[-1] == f"speedup: {60.0 / 48.0:.2f}"
    assert "eta_P/eta_R=1.25/1.25" in text and "response lengths: median 30, max 300" in text
    summary = json.loads((out / "benchmark.json").read_text())
    assert summary["command"].startswith("rollpacker-benchmark --model") and summary["args"]["seeds"] == 2
    assert [r["seed"] for r in summary["runs"]["tail_batching"]] == [7, 8]
    recorded = json.loads(record.read_text())
    assert set(recorded["runs"]) == {"seed 7, pass 0", "seed 8, pass 0"}
