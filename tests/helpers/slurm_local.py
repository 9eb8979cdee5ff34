"""A real two-node Slurm cluster on this machine for tests (tools/slurm_local.sh), and the few
client calls the tests make against it: sbatch, scontrol, scancel, and what a job left behind."""
from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tools" / "slurm_local.sh"
NO_PACKAGES = 3
"""tools/slurm_local.sh up's exit code when slurm-wlm/munge are missing and apt could not install them."""


@dataclass
class LocalSlurm:
    """The cluster tools/slurm_local.sh runs under ``state_dir`` (controller on ``port``)."""

    state_dir: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)

    def _helper(self, command: str, timeout: float) -> subprocess.CompletedProcess:
        env = dict(os.environ, SLURM_LOCAL_DIR=str(self.state_dir), SLURM_LOCAL_PORT=str(self.port))
        return subprocess.run(["bash", str(HELPER), command], env=env, capture_output=True, text=True,
                              timeout=timeout)

    def up(self) -> subprocess.CompletedProcess:
        """Start the cluster (installing the packages with apt when absent); fills :attr:`env`."""
        result = self._helper("up", timeout=600)
        if result.returncode == 0:
            self.env = dict(os.environ, SLURM_CONF=str(self.state_dir / "etc" / "slurm.conf"))
        return result

    def down(self) -> subprocess.CompletedProcess:
        return self._helper("down", timeout=180)

    def run(self, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env={**self.env, **env}, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)

    def sbatch(self, *args: str, **env: str) -> int:
        """Submit; returns the job id."""
        result = self.run("sbatch", *args, **env)
        match = re.search(r"Submitted batch job (\d+)", result.stdout)
        assert result.returncode == 0 and match, f"sbatch failed: {result.stdout}{result.stderr}"
        return int(match.group(1))

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, ...); empty once forgotten."""
        result = self.run("scontrol", "-o", "show", "job", str(job_id))
        if result.returncode != 0:
            return {}
        return dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)

    def wait_done(self, job_id: int, timeout: float) -> dict[str, str]:
        """Poll until the job is over (left PENDING/CONFIGURING/RUNNING/SIGNALING/COMPLETING/STAGE_OUT);
        fails after ``timeout`` seconds. SIGNALING is the job while Slurm delivers a ``--signal``
        (seen on a loaded box for a --signal=B:TERM job: state SIGNALING, ExitCode 0:0, still running)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING", "SIGNALING", "COMPLETING",
                                            "STAGE_OUT", None):
                return info
            assert time.monotonic() < deadline, f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s"
            time.sleep(1.0)


def wait_for(predicate, timeout: float, what: str, poll: float = 1.0, alive=None) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` or when ``alive()`` turns false."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert alive is None or alive(), f"gave up waiting for {what}: the job ended"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(poll)


def job_processes(job_id: int) -> list[str]:
    """'pid command' of every process on this machine whose environment names the job."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = environ.read_bytes().split(b"\0")
            if f"SLURM_JOB_ID={job_id}".encode() not in env:
                continue
            cmd = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append(f"{environ.parent.name} {cmd[:160]}")
    return found


def processes_naming(text: str) -> list[str]:
    """'pid command' of every process whose command line contains ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and cmdline.parent.name != str(os.getpid()):
            found.append(f"{cmdline.parent.name} {cmd[:160]}")
    return found


class JobSegments:
    """The ``psm_*`` segments (vLLM's message queues) that a job's processes map, polled every
    ``period`` s in a thread while the block runs: what the job would leave in /dev/shm if its
    engine could not unlink them. (Segments that appear meanwhile may be another test's: their
    names carry no owner, and a SIGKILLed run of another test worker leaves its own unmapped.)"""

    def __init__(self, job_id: int, period: float = 1.0) -> None:
        self.job_id, self.period = job_id, period
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"job-{job_id}-segments", daemon=True)

    def _poll(self) -> None:
        from megatron_rl.distributed.local_state import mapped_segments

        self.seen |= mapped_segments([int(line.split()[0]) for line in job_processes(self.job_id)])

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            self._poll()

    def __enter__(self) -> JobSegments:
        self._poll()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
