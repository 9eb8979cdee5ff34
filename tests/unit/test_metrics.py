"""Metrics logger (jsonl, resume truncation, TensorBoard, W&B error, progress bar) and helpers."""
from __future__ import annotations

import json
import re
import sys
import time

import numpy as np
import pytest
import torch

from megatron_rl.config.schema import TrainerConfig
from megatron_rl.runtime.metrics_logger import MetricsLogger, PhaseTimer, Timer, length_stats, occupancy, read_metrics


def _cfg(**overrides) -> TrainerConfig:
    values = dict(steps=5, tensorboard=False, progress_bar=False, wandb_project="")
    values.update(overrides)
    return TrainerConfig(**values)


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_jsonl_records_flattened_and_converted(tmp_path):
    with MetricsLogger(tmp_path, _cfg(), config_dict={"trainer": {"seed": 3}}) as logger:
        logger.log(0, {"reward/mean": np.float32(0.5), "time": {"rollout": 1.25, "train": torch.tensor(2.0)}, "note": "x"})
        # The 'step' argument wins over a 'step' metric.
        logger.log(1, {"step": 99, "reward/mean": 0.75, "loss": float("nan"), "count": np.int64(7)})
        # Written through before close: another process can tail the file.
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and lines[1]["step"] == 1
    assert abs(lines[0]["time"] - time.time()) < 60
    assert {k: v for k, v in lines[0].items() if k != "time"} == {
        "step": 0, "reward/mean": 0.5, "time/rollout": 1.25, "time/train": 2.0, "note": "x"
    }
    assert lines[1]["loss"] is None and lines[1]["count"] == 7 and isinstance(lines[1]["count"], int)
    assert json.loads((tmp_path / "config.json").read_text()) == {"trainer": {"seed": 3}}


def test_resume_drops_steps_at_and_after_resume_point(tmp_path):
    with MetricsLogger(tmp_path, _cfg()) as logger:
        for step in range(5):
            logger.log(step, {"v": step})
    # The previous attempt crashed while writing step 5's line.
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "v": ')
    with MetricsLogger(tmp_path, _cfg(), start_step=3) as logger:
        assert _steps(tmp_path / "metrics.jsonl") == [0, 1, 2]
        logger.log(3, {"v": 30})
        logger.log(4, {"v": 40})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["v"] for r in records] == [0, 1, 2, 30, 40]
    # A fresh run (start_step=0) in the same directory starts an empty file.
    MetricsLogger(tmp_path, _cfg()).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_corrupt_line_in_middle_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2 is not a metrics record"):
        MetricsLogger(tmp_path, _cfg(), start_step=1)


def test_tensorboard_event_file_holds_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, _cfg(tensorboard=True)) as logger:
        logger.log(0, {"reward/mean": 0.25, "flag": True, "name": "abc"})
        logger.log(1, {"reward/mean": 0.5})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["reward/mean"]
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(0, 0.25), (1, 0.5)]


def test_wandb_missing_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match=r"trainer\.wandb_project='demo' needs the 'wandb' package"):
        MetricsLogger(tmp_path, _cfg(wandb_project="demo"))


def test_wandb_offline_run_records_metrics_and_resumes_the_same_run(tmp_path):
    """The real wandb package, offline: metrics reach the run file, config too, and a resumed
    logger (start_step > 0) continues the same run id."""
    pytest.importorskip("wandb", reason="wandb is in requirements/cpu.lock; this venv lacks it")
    from megatron_rl.runtime.metrics_logger import new_wandb_run_id
    from tests.helpers.wandb_offline import offline_runs

    cfg = _cfg(wandb_project="demo", wandb_mode="offline")
    with MetricsLogger(tmp_path, cfg, config_dict={"trainer": {"seed": 3}}) as logger:
        for step in range(3):
            logger.log(step, {"reward/mean": 0.25 * step, "time": {"step": 1.0 + step}})
    run_id = (tmp_path / "wandb_run_id.txt").read_text()
    with MetricsLogger(tmp_path, cfg, start_step=2) as logger:
        logger.log(2, {"reward/mean": 0.75})  # the resumed attempt redoes step 2
        logger.log(3, {"reward/mean": 1.0})
    runs = offline_runs(tmp_path)
    assert len(runs) == 2 and {r["run_id"] for r in runs} == {run_id}
    assert all(r["project"] == "demo" for r in runs)
    first = {row["_step"]: row for row in runs[0]["history"]}
    assert sorted(first) == [0, 1, 2]
    assert first[1]["reward/mean"] == 0.25 and first[2]["time/step"] == 3.0
    assert [(row["_step"], row["reward/mean"]) for row in runs[1]["history"]] == [(2, 0.75), (3, 1.0)]
    ids = {new_wandb_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[a-z0-9]{8}", i) for i in ids)


def test_progress_bar_postfix(tmp_path, capsys):
    with MetricsLogger(tmp_path, _cfg(progress_bar=True, steps=9), start_step=1, total_steps=4) as logger:
        assert logger._bar.total == 4
        logger.log(1, {"reward/mean": 0.5, "reward/accuracy": 0.25, "time/step": 3.21})
        assert logger._bar.n == 2
        assert logger._bar.postfix == "reward=0.500, acc=0.25, step_s=3.2"
        logger.log(3, {"reward/mean": 0.75})
        assert logger._bar.n == 4


def test_length_stats_hand_computed():
    assert length_stats([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == {"mean": 5.5, "p50": 5.5, "p90": 9.1, "max": 10.0}
    assert length_stats([7], prefix="response_length/") == {
        "response_length/mean": 7.0, "response_length/p50": 7.0, "response_length/p90": 7.0, "response_length/max": 7.0
    }
    stats = length_stats([10, 0, 20])  # unsorted input; p90 = 10 + 0.8 * (20 - 10)
    assert stats == {"mean": 10.0, "p50": 10.0, "p90": pytest.approx(18.0), "max": 20.0}
    with pytest.raises(ValueError, match="at least one"):
        length_stats([])


def test_timer_accumulates_phases(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 4.0, 4.5, 10.0])  # reset, start, stop, start, stop, summary
    monkeypatch.setattr("megatron_rl.runtime.metrics_logger.time.perf_counter", lambda: next(clock))
    timer = PhaseTimer()
    with timer("rollout"):
        pass
    timer.start("rollout")
    assert timer.stop("rollout") == 0.5
    assert timer.as_dict() == {"rollout": 2.5}
    assert timer.intervals() == [("rollout", 1.0, 3.0), ("rollout", 4.0, 4.5)]  # the monotonic clock's own times
    assert timer.summary() == {"time/rollout": 2.5, "time/step": 10.0}


def test_timer_misuse_errors():
    timer = Timer()  # the short alias
    with pytest.raises(ZeroDivisionError):
        with timer.phase("train"):
            1 / 0  # a failing phase still stops its clock
    timer.start("train")
    with pytest.raises(RuntimeError, match="'train' is already running"):
        timer.start("train")
    with pytest.raises(RuntimeError, match="'reward' was not started"):
        timer.stop("reward")
    timer.reset()
    assert timer.as_dict() == {}


def test_occupancy_hand_computed():
    # Active counts: [0,1):1 [1,2):2 [2,3):3 [3,4):2 [4,6):1 -> integral 10 over 6 s.
    intervals = [(0, 4), (1, 3), (2, 6)]
    assert occupancy(intervals, capacity=4) == pytest.approx(10 / 24)
    # Capacity 2: during [2,3) only 2 of 3 run (one waits) -> integral 9.
    assert occupancy(intervals, capacity=2) == pytest.approx(9 / 12)
    # Explicit window (1, 5): counts [1,2):2 [2,3):3->2 [3,4):2 [4,5):1 -> 7 / (2 * 4).
    assert occupancy(intervals, capacity=2, window=(1, 5)) == pytest.approx(7 / 8)
    # Tail: one long request alone in a 10 s window with 4 slots.
    assert occupancy([(0, 2), (0, 2), (0, 2), (0, 10)], capacity=4) == pytest.approx((4 * 2 + 8) / 40)
    # Back-to-back requests touching at t=1 never overlap.
    assert occupancy([(0, 1), (1, 2)], capacity=1) == pytest.approx(1.0)
    # Window wider than the requests: idle time counts.
    assert occupancy([(2, 3)], capacity=1, window=(0, 4)) == pytest.approx(0.25)
    assert occupancy([], capacity=8) == 0.0


def test_occupancy_errors():
    with pytest.raises(ValueError, match="capacity must be > 0"):
        occupancy([(0, 1)], capacity=0)
    with pytest.raises(ValueError, match=r"interval 1 ends before it starts: \(3, 2\)"):
        occupancy([(0, 1), (3, 2)], capacity=1)
    with pytest.raises(ValueError, match="window must have end > start"):
        occupancy([(0, 1)], capacity=1, window=(2, 2))


def test_tensorboard_resume_purges_replayed_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, _cfg(tensorboard=True)) as logger:
        for step in range(5):
            logger.log(step, {"loss": float(step)})
    with MetricsLogger(tmp_path, _cfg(tensorboard=True), start_step=2) as logger:
        logger.log(2, {"loss": 20.0})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 0.0), (1, 1.0), (2, 20.0)]
