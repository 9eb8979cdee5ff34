"""One lock between the test workers for whole training jobs (``tests/run.sh`` runs two xdist workers).

A job's start-up and its teardown sweep the /dev/shm dirs of dead runs on this host (a SIGKILLed
run cannot remove its own). The resume tests check that *their* resume's start-up swept the run
they killed, so between the kill and that start-up no other job may start or end. Every job a
test starts holds the lock shared for its lifetime (:func:`run_job`); a test that needs the
window quiet holds it exclusively (:func:`exclusive_jobs`) and starts its own jobs without it.
Jobs under the test Slurm cluster need not hold it: they run as hosts n1 and n2 (their own UTS
namespaces), so their sweeps cannot touch this host's run dirs; the Slurm test holds it shared
only around its /dev/shm check, which another test's SIGKILLed run would upset.
The lock file lives in the session's temp root, which both workers share. ``flock`` locks are
released by the kernel when their holder dies, so a crashed test cannot wedge the other worker.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from tests.helpers import timeline


def lock_path() -> Path:
    return Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / "megatron_rl-test-jobs.lock"


def _acquire(mode: int) -> int:
    fd = os.open(lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
    start = timeline.now()
    fcntl.flock(fd, mode)
    if timeline.now() - start >= timeline.MIN_WAIT_S:  # on the run's timeline (TEST_TIMELINE)
        timeline.record("lock_wait", start, timeline.now(), mode="exclusive" if mode == fcntl.LOCK_EX else "shared")
    return fd


def run_job(start) -> subprocess.Popen:
    """``start()`` (returning the job's Popen) under the shared lock, held until the process ends."""
    fd = _acquire(fcntl.LOCK_SH)
    try:
        proc = start()
    except BaseException:
        os.close(fd)
        raise

    def release() -> None:
        proc.wait()
        os.close(fd)

    threading.Thread(target=release, name=f"job-lock-{proc.pid}", daemon=True).start()
    return proc


@contextlib.contextmanager
def shared_jobs() -> Iterator[None]:
    """The shared lock for a block that runs jobs this process does not start itself (sbatch)."""
    fd = _acquire(fcntl.LOCK_SH)
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_jobs() -> Iterator[None]:
    """No other worker's job runs (starts, ends, sweeps) inside the block; start jobs here with
    ``job_lock=False`` (the lock is not re-entrant)."""
    fd = _acquire(fcntl.LOCK_EX)
    start = timeline.now()
    try:
        yield
    finally:
        os.close(fd)
        timeline.record("lock_held", start, timeline.now(), mode="exclusive")
