"""megatron_rl.benchmarks.benchmark_training end to end: a recorded run's shapes replayed through
plain torch and the trainer's own Megatron-Core step, one arm per thread count, in a child
process (the Megatron arm initializes torch.distributed, which must not leak into pytest)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def _fake_run(run_dir, model_dir) -> None:
    """A finished run's three files, as the loop writes them, on the random-init tiny model."""
    from megatron_rl.config.loading import apply_override, config_to_dict, load_config

    cfg = load_config(None)
    apply_override(cfg, f"model.hf_path={model_dir}")
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    shapes = [[[12, 30], [12, 9], [20, 41], [20, 5]], [[15, 64], [15, 3], [8, 17], [8, 22]]]
    (run_dir / "trained_prompts.jsonl").write_text(
        "".join(json.dumps({"step": i, "prompt_ids": ["a", "b"], "lengths": s}) + "\n" for i, s in enumerate(shapes)))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "train/tokens_per_s": 1000.0 + i, "train/torch_threads": 1.0}) + "\n" for i in range(2)))


def test_each_thread_count_gets_a_plain_and_a_megatron_arm_and_the_fraction_is_printed(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    _fake_run(run_dir, tiny_model_dir)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.benchmarks.benchmark_training", "--run", str(run_dir),
                           "--threads", "1,2", "--steps", "2"], capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in proc.stdout.splitlines()
            if line.startswith("| ") and line.count("|") == 3}
    for arm in ("plain torch, 1 process x 1 thread(s)", "plain torch, 1 process x 2 thread(s)",
                "the trainer's step in this process: Megatron-Core TP1, 1 thread(s)",
                "the trainer's step in this process: Megatron-Core TP1, 2 thread(s)"):
        median = float(rows[arm].split()[0])
        assert median > 0, (arm, proc.stdout)
    assert "the run: Megatron-Core TP" in proc.stdout and "(1 thread(s) per rank) |" in proc.stdout, proc.stdout
    fraction = [line for line in proc.stdout.splitlines() if line.startswith("training fraction of plain torch: ")]
    assert len(fraction) == 1, proc.stdout
    best = max(float(rows[f"plain torch, 1 process x {n} thread(s)"].split()[0]) for n in (1, 2))
    assert float(fraction[0].split(": ")[1]) == pytest.approx(1000.5 / best, abs=0.006)
