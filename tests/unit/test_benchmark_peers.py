"""``rollpacker-benchmark --compare peers`` end to end with the training runs faked: each column's
run config (scheduler, same prompts and evaluation, the interleaved order), the figures read
back from metrics rows (off-policy fraction and staleness weighted by tokens, the rollout the
step waited for, one-step-off's wait included), the report's lines and its last line, the JSON
and the curves PNG. The real runs: docs/peers.md (the command) and
tests/integration/test_peers_vllm_loop.py (the arms in the real loop)."""
from __future__ import annotations

import json
import re

import pytest

from rollpacker.benchmarks import benchmark, benchmark_peers
from tests.helpers.fake_loop_runs import fake_loop_runs

LOOP_TIME = {"baseline": 10.0, "partial_rollout": 8.0, "one_step_off": 6.0, "tail": 5.0, "tail+spec+hist": 4.0}
"""Seconds per step of each column (seed 0); later seeds are 10 % slower."""


def fake_rows(name: str, seed_offset: int, steps: int) -> list[dict]:
    slow = 1.0 + 0.1 * seed_offset
    rows = []
    for step in range(steps):
        row = {"step": step, "time/step": LOOP_TIME[name] * slow, "time/rollout": 2.0, "time/train": 1.0,
               "reward/mean": 0.1 * step + (0.5 if name == "one_step_off" else 0.0),
               "batch/response_tokens_trained": 100.0 * (step + 1), "rollout/wasted_tokens": 0.0,
               "rollout/aborted_tokens": 0.0}
        if name == "partial_rollout" and step > 0:
            row.update({"off_policy/token_fraction": 0.5, "off_policy/staleness_mean": 0.5,
                        "off_policy/staleness_max": 2.0, "off_policy/tis_weight_mean": 0.9})
        if name == "one_step_off":
            row["time/rollout_wait"] = 0.5
            row["rollout/generation_s"] = 2.5
            if step > 0:
                row.update({"off_policy/token_fraction": 1.0, "off_policy/staleness_mean": 1.0,
                            "off_policy/staleness_max": 1.0, "off_policy/tis_weight_mean": 0.95})
        if step in (0, steps - 1):
            row["val/pass@1"] = 0.2 + 0.01 * step
        rows.append(row)
    return rows


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    return fake_loop_runs(monkeypatch, tmp_path, list(LOOP_TIME), fake_rows)


def test_peers_benchmark_runs_five_columns_per_seed_and_ends_with_tail_vs_best_peer(fake_runs, tmp_path, capsys):
    configs, model = fake_runs
    out = tmp_path / "out"
    rc = benchmark.main(["--compare", "peers", "--model", str(model), "--seeds", "2", "--seed", "5", "--periods", "1",
                         "--eval-prompts", "8", "--out", str(out)])
    assert rc == 0
    # Two seeds x five columns, interleaved: as listed, then reversed.
    names = [c.scheduler.name for c in configs]
    assert names == ["baseline", "partial_rollout", "one_step_off", "tail_batching", "tail_batching",
                     "tail_batching", "tail_batching", "one_step_off", "partial_rollout", "baseline"]
    assert [c.trainer.seed for c in configs] == [5] * 5 + [6] * 5
    spec = [c for c in configs if c.trainer.run_dir.endswith("tail_spec_hist")]
    assert all(c.rollout.speculative.method == "suffix" and c.tail_batching.history_routing for c in spec)
    # The same workload in every column: steps, prompt set, evaluation.
    assert len({(c.trainer.steps, c.data.builtin_num_prompts, c.data.eval_num_prompts, c.data.eval_every)
                for c in configs}) == 1
    assert configs[0].data.eval_num_prompts == 8
    steps = configs[0].trainer.steps
    assert steps == 5 and configs[0].data.builtin_num_prompts * 2 == steps * configs[0].data.prompts_per_step

    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "speedup (tail batching vs best peer): 1.20"  # one_step_off 6 s / tail 5 s
    assert "best peer: one_step_off" in lines
    assert any(line.startswith("speedup vs baseline tail: 2.00 (range 2.00-2.00, 2 runs") for line in lines)
    # A peer that beats tail batching on a figure is named with it.
    assert any(line.startswith("peer wins one_step_off: train_reward") for line in lines)
    assert "peer wins partial_rollout: none (tail batching is ahead on loop time, wasted tokens, train reward " \
           "and pass@1)" in lines
    # Staleness: token-weighted over the steps (step 0 on-policy, 100 tokens; the rest off-policy).
    fraction = sum(100.0 * (s + 1) for s in range(1, steps)) / sum(100.0 * (s + 1) for s in range(steps))
    assert f"staleness one_step_off: off-policy token fraction {fraction:.3f}, mean {fraction:.3f}, max 1" in lines

    result = json.loads((out / "peers.json").read_text())
    assert result["best_peer"] == "one_step_off" and result["tail_vs_best_peer"] == [pytest.approx(1.2)] * 2
    run = result["runs"]["seed 5, pass 0"]
    # One-step-off's wait for the overlapped generation counts as rollout the step waited for.
    assert run["one_step_off"]["split"]["rollout"] == pytest.approx(steps * 2.5)
    assert run["one_step_off"]["generation_time"] == pytest.approx(steps * 2.5)
    assert run["baseline"]["speedup"] == 1.0 and run["tail"]["speedup"] == pytest.approx(50.0 / 25.0)
    assert run["partial_rollout"]["staleness_max"] == 2.0 and run["tail"]["off_policy_fraction"] == 0.0
    assert (out / "curves.png").stat().st_size > 0


def test_peers_benchmark_refuses_a_missing_model_and_bad_counts(tmp_path, capsys):
    assert benchmark_peers.main(["--model", str(tmp_path / "none")]) == 2
    assert "no model at" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert benchmark_peers.main(["--model", str(tmp_path), "--seeds", "0"]) == 2


def test_peers_benchmark_records_the_docs_results_file(fake_runs, tmp_path):
    from megatron_rl.tools.results_tables import render

    configs, model = fake_runs
    (model / "model.safetensors").write_bytes(b"weights")
    path = tmp_path / "results" / "peers.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"title": "kept", "views": {"readme": ["speedup vs baseline"]}, "summary": {"old": {}}}))
    assert benchmark.main(["--compare", "peers", "--model", str(model), "--seeds", "2", "--periods", "1",
                           "--eval-prompts", "8", "--out", str(tmp_path / "out"), "--record", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["command"].startswith("rollpacker-benchmark --compare peers --model ") and "--record" in record["command"]
    assert record["model"]["weights_sha256"] and record["hardware"] and record["date"] and "summary" not in record
    assert record["title"] == "kept" and record["views"] == {"readme": ["speedup vs baseline"]}  # presentation kept
    assert len(record["runs"]) == 2 and "curves" not in record["runs"]["seed 1234, pass 0"]["tail"]
    assert record["runs"]["seed 1234, pass 0"]["tail"]["speedup_vs_best_peer"] == pytest.approx(1.2)
    table = re.sub(r" \[[^\]]*\]", "", render(record))  # medians only: the ranges hold float noise
    assert "| speedup vs baseline | 1.00 | 1.25 | 1.67 | 2.00 | 2.50 |" in table  # the benchmark's own medians
    assert "| speedup vs the best peer | 0.60 | 0.75 | - | 1.20 | 1.50 |" in table
