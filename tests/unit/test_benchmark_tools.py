"""rollpacker/benchmarks: the period arithmetic and summaries, the --compare dispatch, the timeline picture."""
import argparse
import json

import pytest

from rollpacker.benchmarks import benchmark
from rollpacker.benchmarks.benchmark import summarize
from rollpacker.benchmarks.common import period_steps, spread
from rollpacker.benchmarks.plot_timeline import plot_timeline


@pytest.mark.parametrize("eta, p0, expected", [(1.25, 16, 5), (1.25, 4, 5), (1.5, 16, 3), (1.0, 16, 1),
                                                 (1.25, 128, 5), (1.1, 10, 11)])
def test_period_steps(eta, p0, expected):
    # eta 1.25, P0 16: 20 launched, 4 queued per short round -> 4 short rounds fill the queue -> long.
    assert period_steps(eta, p0) == expected


def _row(step, rt, t, rollout, occ, wasted=0.0, reward=0.5):
    return {"step": step, "round_type": rt, "time/step": t, "time/rollout": rollout, "time/weight_sync": t / 10,
            "rollout/engine_occupancy": occ,
            "response_length/mean": 10.0, "response_length/max": 50.0, "batch/samples_trained": 8.0,
            "rollout/wasted_tokens": wasted, "reward/mean": reward}


def test_summarize_splits_round_types():
    rows = [_row(0, "short", 2.0, 1.0, 0.5, 30), _row(1, "short", 4.0, 3.0, 0.7, 10), _row(2, "long", 9.0, 8.0, 0.2)]
    rows[0]["val/pass@1"], rows[-1]["val/pass@1"] = 0.25, 0.5
    s = summarize(rows)
    assert s["loop_time"] == 15.0 and s["rollout_time"] == 12.0 and s["steps"] == 3
    assert s["short"]["step_time_mean"] == 3.0 and s["short"]["occupancy_mean"] == pytest.approx(0.6)
    assert s["long"]["steps"] == 1 and s["wasted_tokens"] == 40.0
    assert s["initial_val_pass@1"] == 0.25 and s["final_val_pass@1"] == 0.5
    assert s["weight_sync_time_mean"] == pytest.approx(0.5)
    assert s["logprob_time_mean"] == 0.0  # absent (recompute_old_logprobs=false and no KL): no pass ran
    rows[0]["time/logprob"], rows[1]["time/logprob"], rows[2]["time/logprob"] = 0.3, 0.6, 0.9
    assert summarize(rows)["logprob_time_mean"] == pytest.approx(0.6)


def test_plot_timeline_writes_png(tmp_path):
    for name, rounds in (("base", ["baseline"] * 2), ("tb", ["short", "long"])):
        d = tmp_path / name
        d.mkdir()
        with open(d / "rollout_timeline.jsonl", "w") as f:
            for step, rt in enumerate(rounds):
                t0 = step * 10.0
                reqs = [[t0, t0 + 1 + i, "stop"] for i in range(5)] + [[t0, t0 + 2, "abort"]]
                f.write(json.dumps({"step": step, "round_type": rt, "window": [t0, t0 + 6], "requests": reqs,
                                    "response_lengths": [3, 4]}) + "\n")
    out = plot_timeline(tmp_path / "base", tmp_path / "tb", tmp_path / "t.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_timeline_missing_file_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="rollout_timeline.jsonl"):
        plot_timeline(tmp_path, tmp_path, tmp_path / "x.png")


def test_weight_sync_benchmark_splits_pushes_and_ends_with_speedup_and_bandwidth(capsys):
    from megatron_rl.benchmarks.benchmark_weight_sync import report, split

    # Files: transport = the push without the engine's load; the tensor push: without the tail
    # after the last byte reached the engine (its loaders' busy time may overlap the transport).
    assert split("sharded", 0.5, {"weight_sync/engine_load_s": 0.2}) == pytest.approx((0.3, 0.2))
    assert split("hf", 2.0, {"weight_sync/engine_s": 1.5}) == pytest.approx((0.5, 1.5))
    tensor = {"weight_sync/push_s": 0.25, "weight_sync/push_transport_s": 0.1, "weight_sync/push_load_s": 0.2}
    assert split("tensor", 0.26, tensor) == pytest.approx((0.11, 0.2))
    rows = lambda s, t, ld: [{"seconds": s * f, "transport_s": t * f, "load_s": ld * f} for f in (0.9, 1.0, 1.2)]  # noqa: E731
    summary = report({"sharded": {"rows": rows(0.5, 0.3, 0.2), "parity": 2e-6},
                      "tensor": {"rows": rows(0.25, 0.1, 0.15), "parity": 1e-6}}, int(1e9), (5.0, [4.0, 5.0, 6.0]))
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == "weight-sync speedup (tensor vs sharded): 2.00"
    assert out[-1] == "tensor bandwidth fraction of memcpy: 2.00"  # 1 GB in 0.1 s = 10 GB/s vs 5 GB/s
    assert summary["tensor"]["seconds"] == {"median": 0.25, "min": pytest.approx(0.225), "max": pytest.approx(0.3)}
    assert any(line.startswith("| memcpy") for line in out)


def test_speculative_benchmark_columns_from_metrics_rows():
    from rollpacker.benchmarks.benchmark_speculative import column_figures

    def row(step, rt, rollout, drafted=0.0, accepted=0.0, **extra):
        return {"step": step, "round_type": rt, "time/step": rollout + 1.0, "time/rollout": rollout, "time/train": 0.5,
                "time/logprob": 0.25, "time/weight_sync": 0.1, "time/reward": 0.05, "reward/mean": 0.5,
                "rollout/spec/draft_tokens": drafted, "rollout/spec/accepted_tokens": accepted,
                "rollout/spec/decode_steps": 10.0, "rollout/aborted_tokens": 3.0, "rollout/wasted_tokens": 5.0, **extra}

    rows = [row(0, "short", 2.0, **{"val/pass@1": 0.25, "rollout/history/true_long": 1.0}),
            row(1, "long", 4.0, drafted=10.0, accepted=4.0, **{"rollout/history/false_long": 1.0}),
            row(2, "short", 2.0, **{"val/pass@1": 0.5, "rollout/history/false_short": 1.0})]
    f = column_figures(rows)
    assert f["loop_time"] == pytest.approx(11.0)
    assert f["long_rollout_time"] == pytest.approx(4.0) and f["split"]["rollout_short"] == pytest.approx(4.0)
    # other = loop time minus every timed phase: 3 x (1.0 - 0.5 - 0.25 - 0.1 - 0.05)
    assert f["split"]["other"] == pytest.approx(0.3)
    assert f["acceptance"] == pytest.approx(0.4) and f["long_decode_steps"] == 10.0
    assert (f["pass@1_initial"], f["pass@1"]) == (0.25, 0.5)
    assert f["history"]["precision"] == pytest.approx(0.5) and f["history"]["recall"] == pytest.approx(0.5)
    assert f["aborted_tokens"] == 9.0 and f["wasted_tokens"] == 15.0
    no_long = column_figures([rows[0]])
    assert no_long["long_rollout_time"] is None and no_long["acceptance"] is None


def test_speculative_benchmark_speedups_are_per_run_and_runs_interleave():
    from rollpacker.benchmarks.benchmark_speculative import add_speedups, run_order

    runs = {"seed 1, pass 0": {"baseline": {"loop_time": 20.0}, "tail": {"loop_time": 12.0}, "tail+spec+hist": {"loop_time": 10.0}},
            "seed 2, pass 0": {"baseline": {"loop_time": 30.0}, "tail": {"loop_time": 20.0}, "tail+spec+hist": {"loop_time": 15.0}}}
    add_speedups(runs)
    assert runs["seed 1, pass 0"]["tail"]["speedup"] == pytest.approx(20 / 12)
    assert runs["seed 2, pass 0"]["tail+spec+hist"]["speedup"] == pytest.approx(2.0)  # against its own run's baseline
    assert runs["seed 1, pass 0"]["baseline"]["speedup"] == 1.0
    order = run_order(2, [1, 2])
    assert [(r, s) for r, s, _ in order] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert [cols[0] for _, _, cols in order] == ["baseline", "tail+spec+hist", "baseline", "tail+spec+hist"]


def test_arms_benchmark_parses_arms_and_sums_figures():
    import argparse

    from rollpacker.benchmarks.benchmark_arms import parse_arm, run_figures

    assert parse_arm("mp:rollout.cpu_executor=mp,rollout.max_num_seqs=8") == (
        "mp", ["rollout.cpu_executor=mp", "rollout.max_num_seqs=8"])
    for bad in ("no-colon", ":x=1", "a:novalue"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_arm(bad)
    rows = [{"round_type": "long", "time/step": 2.0, "time/rollout": 1.0, "time/train": 0.5, "rollout/spec/decode_steps": 100},
            {"round_type": "short", "time/step": 1.0, "time/rollout": 0.5, "time/train": 0.25}]
    f = run_figures(rows)
    assert f["loop_time"] == 3.0 and f["train"] == 0.75
    assert f["ms_per_step_long"] == pytest.approx(10.0) and "ms_per_step_short" not in f


def test_quantization_benchmark_summary_report_and_last_line(capsys):
    from megatron_rl.benchmarks.benchmark_quantization import print_report, speedup_line, summarize_curve

    rows = [{"step": s, "reward/mean": 0.1 * s, "reward/accuracy": 0.05 * s, "rollout/logprob_abs_diff_mean": 0.01,
             "rollout/logprob_abs_diff_max": 0.1 + s, "rollout/tokens_per_s": 100.0 + s, "time/step": 2.0,
             "time/weight_sync": 0.5, "train/tis_weight_mean": 1.0, "train/tis_weight_abs_dev": 0.01,
             "train/tis_clip_frac": 0.0} for s in range(12)]
    rows[0]["val/pass@1"], rows[9]["val/pass@1"] = 0.4, 0.5  # eval before step 0 and after step 9
    c = summarize_curve(rows, "int8 + TIS")
    assert c["reward_windows"] == pytest.approx([0.45, 1.05]) and c["steps"] == 12
    assert c["val_pass1"] == [(0, 0.4), (10, 0.5)] and c["gap_max"] == 11.1
    assert c["tokens_per_s_median"] == 105.5 and c["loop_time"] == 24.0
    full = dict(c, label="full precision", tis_weight_mean=None)
    tp = [{"model": "/x/small", "params_m": 70.0, "fp32_mb": 280.0, "speedup_median": 1.5,
           "speedup_per_repeat": {"median": 1.4, "min": 1.1, "max": 1.9},
           "full": {"median": 100.0, "min": 90.0, "max": 120.0, "gap_mean": 1e-6, "gap_max": 1e-5},
           "int8": {"median": 150.0, "min": 140.0, "max": 160.0, "gap_mean": 1e-2, "gap_max": 0.1}}]
    tp.append(dict(tp[0], model="/x/large", params_m=121.0, speedup_median=2.25))
    print_report(tp, {"full": full, "int8_tis": c}, argparse.Namespace(repeats=3, batch=8, tokens=16, model="tiny",
                                                                         prompts_per_step=4, responses=2,
                                                                         eval_prompts=8))
    out = capsys.readouterr().out
    assert "| small (70M, 280 MB fp32) | 100 [90-120] | 150 [140-160] | 1.50 (1.40 [1.10-1.90])" in out
    assert "| val pass@1 at step 10 | 0.500 | 0.500 |" in out and "| TIS weight mean | - | 1.0000 |" in out
    assert speedup_line(tp) == "rollout speedup (int8 vs full precision): 2.25"  # the largest model's


def test_spread_cells():
    assert spread([]) == "-" and spread([None, "x"]) == "-"
    assert spread([2.0]) == "2.00" and spread([1.0, 1.0], "{:.1f}") == "1.0"
    assert spread([3.0, None, 1.0, 2.0]) == "2.00 [1.00-3.00]"


def test_compare_dispatch_hands_the_rest_of_the_command_line_to_the_registered_module(monkeypatch):
    from megatron_rl.benchmarks import benchmark_quantization, benchmark_weight_sync
    from rollpacker.benchmarks import (
        benchmark,
        benchmark_arms,
        benchmark_cumulative,
        benchmark_peers,
        benchmark_speculative,
    )

    assert benchmark.OWN_COMPARISONS == {"weight_sync": benchmark_weight_sync.main,
                                         "speculative": benchmark_speculative.main,
                                         "quantization": benchmark_quantization.main, "arms": benchmark_arms.main,
                                         "peers": benchmark_peers.main, "cumulative": benchmark_cumulative.main}
    assert benchmark.split_compare(["--periods", "2"]) == ("schedulers", ["--periods", "2"])
    assert benchmark.split_compare(["--seeds", "3", "--compare", "speculative", "x=1"]) == ("speculative",
                                                                                          ["--seeds", "3", "x=1"])
    assert benchmark.split_compare(["--compare=arms", "--arm", "a:k=v"]) == ("arms", ["--arm", "a:k=v"])
    calls = []
    for name in benchmark.OWN_COMPARISONS:
        monkeypatch.setitem(benchmark.OWN_COMPARISONS, name, lambda argv, name=name: calls.append((name, argv)) or 7)
    assert benchmark.main(["--compare", "quantization", "--repeats", "3"]) == 7
    assert benchmark.main(["--runs", "2", "--compare=speculative"]) == 7
    assert calls == [("quantization", ["--repeats", "3"]), ("speculative", ["--runs", "2"])]
    assert benchmark.main(["--compare", "nonsense"]) == 2


def test_benchmark_modules_import_no_circle():
    """common is a leaf and the benchmarks' imports form no cycle (the --compare dispatch imports
    the modules it runs; none of them imports it back)."""
    import grimp

    graph = grimp.build_graph("rollpacker", include_external_packages=False, cache_dir=None)
    package = "rollpacker.benchmarks"
    modules = {m for m in graph.modules if m.startswith(package + ".")}
    assert not {m for m in graph.find_modules_directly_imported_by(f"{package}.common") if m in modules}
    for module in modules:
        upstream = graph.find_upstream_modules(module) & modules
        assert module not in upstream and not any(
            module in graph.find_upstream_modules(other) for other in upstream), module


def test_training_benchmark_replays_the_recorded_shapes(tmp_path, tiny_model_dir):
    import json as _json
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.benchmarks.benchmark_training import step_shapes, torch_step

    (tmp_path / "trained_prompts.jsonl").write_text(
        _json.dumps({"step": 0, "prompt_ids": ["a"], "lengths": [[5, 3], [5, 7]]}) + "\n"
        + _json.dumps({"step": 1, "prompt_ids": ["b"]}) + "\n")  # a record without shapes is skipped
    assert step_shapes(tmp_path) == [[(5, 3), (5, 7)]]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    assert torch_step(model, opt, [(5, 3), (5, 7)], budget=64, vocab=model.config.vocab_size,
                      rng=random.Random(0)) > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it really trained


def test_a_two_run_comparison_records_each_runs_table_figures(tmp_path):
    from megatron_rl.tools.results_tables import render

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")

    def run(seed: int, loop: float) -> dict:
        return {"seed": seed, "run": 0, "loop_time": loop, "rollout_time": loop / 2, "steps": 10, "logprob_time_mean": 0.0,
                "train_time_mean": 1.0, "weight_sync_time_mean": 0.1, "occupancy_mean": 0.5, "wasted_tokens": 0,
                "train_reward_mean": 0.3, "initial_val_pass@1": 0.4, "final_val_pass@1": 0.5}

    path = tmp_path / "tail.json"
    benchmark.record_pairs(str(path), ["rollpacker-benchmark", "--seeds", "2"], [run(1, 60.0), run(2, 80.0)],
                           [run(1, 40.0), run(2, 40.0)], [(29, 736), (31, 700)], str(model))
    record = json.loads(path.read_text())
    assert record["command"] == "rollpacker-benchmark --seeds 2" and list(record["runs"]) == ["seed 1, pass 0", "seed 2, pass 0"]
    titles = [r["title"] for r in record["rows"]]
    assert "step time, short rounds (s)" not in titles and "baseline response length, max (tokens)" in titles  # no empty rows
    table = render(record)
    assert "| training-loop time (s) | 70.0 [60.0-80.0] | 40.0 | 1.75x [1.50x-2.00x] |" in table
    assert "| baseline response length, max (tokens) | 718 [700-736] | - | - |" in table
