"""rollpacker-price-benchmark on benchmark outputs written here (synthetic traces, tests/helpers/pricing_runs.py):
the arms and runs found from each summary file and without one, the two-run comparison's column labels, the
per-seed speedup, a run cut short left out, and the results file that joins the benchmark's table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.tools.results_tables import load_results, render
from rollpacker.benchmarks import price_benchmark
from tests.helpers.pricing_runs import TRUE, write_run


def _run(out: Path, seed: int, arm: str, samples: int, steps: int = 4) -> Path:
    d = write_run(out / "pass0" / f"seed{seed}" / arm, TRUE, seed=seed, steps=steps, samples=samples)
    cfg = json.loads((d / "config.json").read_text())
    cfg["trainer"]["steps"] = 4  # a run with fewer metrics rows than this was cut short
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_pairs_are_labelled_as_their_table_and_priced_per_seed(tmp_path, capsys):
    out = tmp_path / "bench"
    runs = {"baseline": [], "tail_batching": []}
    for seed in (1, 2):
        for arm, samples in (("baseline", 16), ("tail_batching", 8)):  # half the samples: faster
            runs[arm].append({"seed": seed, "run": 0, "run_dir": str(_run(out, seed, arm, samples))})
    (out / "benchmark.json").write_text(json.dumps({"runs": runs, "command": "rollpacker-benchmark --seeds 2",
                                                    "labels": {"baseline": "baseline", "tail_batching": "RollPacker"}}))
    arms, priced = price_benchmark.price_benchmark(out, "h800", "qwen2.5-7b")
    assert arms == ["baseline", "RollPacker"] and list(priced) == ["seed 1, pass 0", "seed 2, pass 0"]
    for cols in priced.values():
        base, tb = cols["baseline"], cols["RollPacker"]
        assert base["priced_speedup"] == 1.0
        assert tb["priced_speedup"] == pytest.approx(base["priced_step_s"] / tb["priced_step_s"]) and tb["priced_speedup"] > 1
        assert 0 < tb["packing_iterations"] <= 1 and 0 < tb["packing_time"] <= 1.01
        # Across the run the slots could have been kept fuller than step by step.
        assert 0 < tb["run_packing_iterations"] <= tb["packing_iterations"]
        assert tb["trace_cost_pct"] is None  # these runs logged no engine_trace/cost_s

    record = tmp_path / "results" / "demo_priced.json"
    assert price_benchmark.main([str(out), "--record", str(record)]) == 0
    data = json.loads(record.read_text())
    assert data["joins"] == "demo" and data["benchmark_command"] == "rollpacker-benchmark --seeds 2"
    assert data["columns"] == ["baseline", "RollPacker"] and set(data["runs"]) == set(priced)
    base = {"name": "demo", "command": "c", "columns": ["baseline", "RollPacker"], "hardware": "h", "runs": {"s": {
        "baseline": {"x": 1.0}, "RollPacker": {"x": 2.0}}}, "rows": [{"title": "x", "key": "x", "format": "{:.1f}"}]}
    table = render(base, joined=[data])
    assert "| H800-priced speedup vs baseline | 1.00x |" in table and "packing-limit fraction, whole run, decode" in table
    (tmp_path / "results" / "demo.json").write_text(json.dumps(base))
    assert load_results(tmp_path / "results")["demo_priced"]["joins"] == "demo"


def test_without_a_summary_the_finished_runs_are_found_and_a_cut_run_left_out(tmp_path, capsys):
    out = tmp_path / "bench"
    _run(out, 3, "baseline", 16)
    _run(out, 3, "tail_batching", 8)
    _run(out, 4, "baseline", 16, steps=2)  # cut short: two of its four steps
    arms, priced = price_benchmark.price_benchmark(out, "h800", "qwen2.5-7b")
    assert arms == ["baseline", "RollPacker"] and list(priced) == ["seed 3, pass 0"]
    assert price_benchmark.main([str(tmp_path / "nothing")]) == 2
    assert "engine trace" in capsys.readouterr().err
