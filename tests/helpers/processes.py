"""The processes of a run started in its own session, and whether any outlive it."""
from __future__ import annotations

import os
import time
from pathlib import Path

import psutil


def describe(pid: int) -> str:
    """A process's name and command line ('' when it is gone)."""
    try:
        proc = psutil.Process(pid)
        return proc.name() + " " + " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def run_processes(leader: int) -> dict[int, str]:
    """Every live process of a run whose driver ``leader`` leads its own session
    (``start_new_session=True``): its descendants and the session's members, with their names."""
    found = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == leader:
                found[proc.pid] = describe(proc.pid)
        except (OSError, psutil.Error):
            continue
    try:
        for child in psutil.Process(leader).children(recursive=True):
            found[child.pid] = describe(child.pid)
    except psutil.Error:
        pass
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def left_behind(pids: list[int], segments: list[str] = (), wait_s: float = 20.0) -> tuple[list[int], list[str]]:
    """The pids still alive and ``psm_*`` segments still in /dev/shm after up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [p for p in pids if _alive(p)]
        left = [s for s in segments if (Path("/dev/shm") / s).exists()]
        if (not alive and not left) or time.monotonic() > deadline:
            return alive, left
        time.sleep(0.2)
