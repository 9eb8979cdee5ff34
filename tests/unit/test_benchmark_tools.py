"""tools/benchmark.py's period arithmetic and summaries; tools/plot_timeline.py's picture."""
import json

import pytest

from tools.benchmark import period_steps, summarize
from tools.plot_timeline import plot_timeline


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
    from tools.benchmark_weight_sync import report, split

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
