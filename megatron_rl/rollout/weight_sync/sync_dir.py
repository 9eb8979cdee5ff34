"""Where the weight sync's directories live on a node, and their clean-up.

vLLM's engine core runs in its own process and tensors do not survive its RPC, so the file
transports move weights through a directory on the engine's node: /dev/shm (RAM-backed) when it
exists and has room, else under the run directory.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from megatron_rl.distributed.local_state import run_dir_name, sweep_dead_run_dirs

_SHM = Path("/dev/shm")


def default_sync_dir(fallback_root: str | Path | None = None, required_bytes: int = 0) -> Path:
    """Where to write weights for the engine: a per-user, per-process dir under /dev/shm.

    Falls back to ``<fallback_root>/weight_sync`` (or the system temp dir) when /dev/shm is
    missing, not writable, or has less than ``required_bytes`` free (containers often mount a
    64 MiB /dev/shm). The directory is not created.
    """
    name = run_dir_name()  # megatron_rl-<host>-<uid>-<pid>: a later run can tell it is dead
    if _SHM.is_dir() and os.access(_SHM, os.W_OK) and shutil.disk_usage(_SHM).free >= required_bytes:
        return _SHM / name / "weights"
    root = Path(fallback_root) if fallback_root is not None else Path(tempfile.gettempdir()) / name
    return root / "weight_sync"


def sweep_dead_sync_dirs() -> list[Path]:
    """Remove the /dev/shm weight directories of dead runs of this host (a SIGKILLed run cannot
    remove its own); never a live run's, never another node's (see ``local_state``)."""
    return sweep_dead_run_dirs(_SHM)


def remove_sync_dir(directory: str | Path) -> None:
    """Delete a weight directory the run created once the run is over, with the temp and trash
    siblings its writers leave after a crash (``.<name>.*``), and its parent when that is left
    empty (default_sync_dir's per-process dir). /dev/shm is memory: without this every run left
    one model copy there (64 GB for a 32B model in bf16)."""
    path = Path(directory)
    shutil.rmtree(path, ignore_errors=True)
    if path.parent.is_dir():
        for sibling in path.parent.glob(f".{path.name}.*"):
            shutil.rmtree(sibling, ignore_errors=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass  # not empty (e.g. a run dir holding weight_sync/) or already gone
