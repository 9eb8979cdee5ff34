"""launch/_ray_node.sh's start-up retries, with a stand-in for the ray CLI (pure control flow;
tests/integration/test_slurm_cluster.py runs the script with the real Ray under a real Slurm).

The stand-in counts its starts in a file and exits with status 3 for the first FAILS of them; a
start after that blocks like ``ray start --block`` until SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "_ray_node.sh"

FAKE_RAY = """#!/usr/bin/env bash
n=$(( $(cat "{count}" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "{count}.tmp" && mv "{count}.tmp" "{count}"  # whole: the test polls the file
echo "fake ray start $n: $*" >&2
if [ "$n" -le "{fails}" ]; then exit 3; fi
sleep 300 &
trap 'kill $!; exit 0' TERM
wait
"""


def _start(tmp_path: Path, fails: int, **env_extra: str) -> tuple[subprocess.Popen, Path, Path]:
    count = tmp_path / "starts"
    fake = tmp_path / "ray"
    fake.write_text(FAKE_RAY.format(count=count, fails=fails))
    fake.chmod(0o755)
    ray_dir = tmp_path / "raydir"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(RAY_BIN=str(fake), RAY_NODE_IP="127.0.0.1", RAY_NODE_TMPDIR=str(ray_dir), **env_extra)
    proc = subprocess.Popen(["bash", str(SCRIPT), "worker", "10.0.0.1:6379"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, count, ray_dir


def _starts(count: Path) -> int:
    return int(count.read_text()) if count.is_file() else 0


def test_failed_starts_are_retried_then_a_sigterm_stops_the_node_cleanly(tmp_path):
    proc, count, ray_dir = _start(tmp_path, fails=2)
    deadline = time.monotonic() + 30
    while _starts(count) < 3:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no third start"
        time.sleep(0.1)
    time.sleep(0.5)  # the third start is blocking
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "ray start failed with 3 after" in err and "(start 1 of 3)" in err and "(start 2 of 3)" in err, err
    assert "(start 3 of 3)" not in err and _starts(count) == 3
    assert not ray_dir.exists()


def test_start_failures_end_after_ray_start_tries_with_rays_status(tmp_path):
    proc, count, _ = _start(tmp_path, fails=99, RAY_START_TRIES="2")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, err
    assert _starts(count) == 2
    assert "(start 1 of 2)" in err and "ray exited with 3" in err


def test_an_exit_after_the_start_window_is_a_node_failure_not_retried(tmp_path):
    proc, count, _ = _start(tmp_path, fails=99, RAY_START_WINDOW_S="0")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3 and _starts(count) == 1, err
    assert "starting again" not in err
