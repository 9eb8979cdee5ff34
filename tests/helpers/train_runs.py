"""Whole-loop runs as ``python -m megatron_rl.train`` subprocesses, for the loop tests
(test_train_loop, test_rollpacker_loop, test_quantized_loop, test_speculative_loop): the small
run's overrides, the launcher and the JSONL readers. The process boundary is what these tests
check (signals, exit codes, the CLI's start-up and teardown), so they do not drive the trainer
in-process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.job_lock import run_job

REPO = Path(__file__).resolve().parents[2]
P0, R0 = 4, 2
"""Prompts per step and responses per prompt of every loop test run."""


def overrides(model_dir: Path, run_dir: Path, steps: int, extra: list[str] = ()) -> list[str]:
    """A TP-2 run on CPU of ``steps`` small steps (P0 x R0 samples, 24 new tokens), then ``extra``."""
    return [
        f"model.hf_path={model_dir}", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
        "parallel.tensor_model_parallel_size=2", "cluster.device=cpu",
        f"data.prompts_per_step={P0}", f"data.responses_per_prompt={R0}", "data.builtin_num_prompts=64",
        "rollout.max_new_tokens=24", "rollout.max_num_seqs=16", "rollout.cpu_kv_cache_gib=0.25",
        "data.max_prompt_tokens=96", "optimizer.micro_batch_tokens=256", "optimizer.lr=1e-3",
        "trainer.progress_bar=false", "trainer.tensorboard=false", *extra,
    ]


def run_train(args: list[str], log_file: Path, job_lock: bool = True, **popen) -> subprocess.Popen:
    """``python -m megatron_rl.train args`` in its own session (so a test can signal the whole
    group), stdout and stderr to ``log_file``; under the jobs' shared lock (``tests/helpers/job_lock``)
    unless ``job_lock`` is false (inside ``exclusive_jobs``)."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "megatron_rl.train", *args], cwd=REPO, env=env,
                                stdout=open(log_file, "w"), stderr=subprocess.STDOUT, start_new_session=True, **popen)

    return run_job(start) if job_lock else start()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
