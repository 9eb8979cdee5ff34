"""Whole-loop runs as ``python -m megatron_rl.train`` subprocesses, for the loop tests
(test_train_loop, test_rollpacker_loop, test_quantized_loop, test_speculative_loop): the small
run's overrides, the launcher and the JSONL readers. The process boundary is what these tests
check (signals, exit codes, the CLI's start-up and teardown), so they do not drive the trainer
in-process."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from megatron_rl.distributed.local_state import HOST_TAG_ENV

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


def run_train(args: list[str], log_file: Path, host_tag: str | None = None, **popen) -> subprocess.Popen:
    """``python -m megatron_rl.train args`` in its own session (so a test can signal the whole
    group), stdout and stderr to ``log_file``.

    ``host_tag`` (``MEGATRON_RL_HOST_TAG``) gives the run's /dev/shm dirs a host name of their own:
    a test that kills a run and checks that its next attempt's start-up swept what it left passes
    one tag to every attempt, so that no other test's job (two test workers) sweeps them first.
    """
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    if host_tag is not None:
        env[HOST_TAG_ENV] = host_tag
    return subprocess.Popen([sys.executable, "-m", "megatron_rl.train", *args], cwd=REPO, env=env,
                            stdout=open(log_file, "w"), stderr=subprocess.STDOUT, start_new_session=True, **popen)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sync_dir_of(log: str) -> str:
    """The run's weight directory, as its start-up logged it."""
    return re.search(r"weights for the engines go to (\S+)", log).group(1)


def assert_weights_dir_removed(log: str) -> None:
    """The run's weight directory (in /dev/shm: memory), and its per-process parent there, are gone."""
    sync_dir = sync_dir_of(log)
    assert not Path(sync_dir).exists()
    if sync_dir.startswith("/dev/shm/"):
        assert not Path(sync_dir).parent.exists(), "the per-process /dev/shm dir was left behind"


def assert_each_prompt_trained_once(run_dir: Path, steps: int) -> None:
    trained = [pid for rec in read_jsonl(run_dir / "trained_prompts.jsonl") for pid in rec["prompt_ids"]]
    assert len(trained) == len(set(trained)) == steps * P0


def one_copy_mb(model_dir: Path, tp: int) -> float:
    """Megabytes of one fp32 copy of the model's engine tensors at rollout TP ``tp`` (vocabulary
    padding excluded): what one sync moves into one engine replica."""
    from megatron_rl.model.qwen2 import read_qwen2_arch
    from megatron_rl.resharding.layouts import VLLMLayout

    layout = VLLMLayout(read_qwen2_arch(model_dir), tp)
    return sum(seg.length * spec.row_numel for shard in range(layout.tp)
               for spec in layout.tensors(shard) for seg in spec.segments) * 4 / 1e6
