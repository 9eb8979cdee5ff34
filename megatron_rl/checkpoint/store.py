"""Driver-side checkpoint storage: atomic step directories with a verified manifest.

Layout::

    run_dir/checkpoints/
        step_000123/              a complete checkpoint (only ever created by a rename)
            manifest.json         step, time, config, every file with its size (+ sha256 if small)
            driver_state.pt       driver state: data cursor, scheduler queues, RNG, counters
            megatron/             the trainer ranks' dist checkpoint: model, reference, optimizer,
                                  RNG (megatron_rl/training/dist_checkpoint.py; any layout)
        step_000124.tmp-4711/     being written by pid 4711; never read, removed at start-up

Protocol (one driver per run directory)::

    manager = CheckpointManager(run_dir, keep=cfg.trainer.keep_checkpoints, config_dict=cfg_dict)
    tmp = manager.begin(step)                     # workers write their shards under ``tmp``
    manager.commit(step, tmp, driver_state={...})  # fsync, manifest, rename, prune old ones

    path = latest(run_dir)                        # newest *complete* checkpoint or None
    state = load_driver_state(path)               # verifies the manifest first

A checkpoint becomes visible only through ``os.rename`` of a fully written, fsynced directory,
so a process killed at any point leaves either the previous checkpoint set or the new one.
Checkpoints are trusted files written by this program: ``driver_state.pt`` is a pickle.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rl.runtime.fault_injection import fault_point

MANIFEST = "manifest.json"
DRIVER_STATE = "driver_state.pt"
MANIFEST_VERSION = 1
SMALL_FILE_BYTES = 64 * 1024 * 1024
"""Files up to this size get a sha256 in the manifest; bigger ones (model shards) only a size,
so that saving and loading a 32B model does not re-read hundreds of GB."""

_STEP_RE = re.compile(r"^step_(\d{6,})$")
_TMP_RE = re.compile(r"^step_\d{6,}\.(tmp|del)-")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def checkpoint_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` (zero-padded so names sort)."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:06d}"


def checkpoints_root(run_dir: str | os.PathLike) -> Path:
    """``run_dir/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as ``(step, path)``, oldest first.

    A directory counts only if its name is ``step_NNNNNN`` and it holds a manifest; temporary
    directories (``.tmp-<pid>``, ``.del-<pid>``) are never listed.
    """
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest(run_dir: str | os.PathLike) -> Path | None:
    """Path of the newest complete checkpoint under ``run_dir/checkpoints``, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python ``random``, numpy's global generator, torch CPU (and CUDA if used)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # Stored as plain python values so the state does not depend on numpy's pickle format.
        "numpy": (np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "torch_cuda" in state:
        if not torch.cuda.is_available():
            raise CheckpointError("checkpoint holds CUDA RNG states but no GPU is visible")
        torch.cuda.set_rng_state_all(state["torch_cuda"])


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    # Directory fsync makes renames/creations durable; not supported on every platform/fs.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _remove_tree(path: Path) -> None:
    """Delete a directory so that a crash mid-way never leaves a listable half checkpoint."""
    doomed = path.with_name(f"{path.name}.del-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


class CheckpointManager:
    """Writes checkpoints of one run atomically and keeps the newest ``keep`` of them.

    Creating the manager removes temporary directories left by a killed writer, so it must be
    created by the single driver process of the run before any worker starts writing.
    """

    def __init__(self, run_dir: str | os.PathLike, keep: int, config_dict: dict | None = None) -> None:
        """``keep``: how many complete checkpoints to retain (0 keeps all).
        ``config_dict``: the resolved run configuration, recorded in every manifest."""
        if keep < 0:
            raise ValueError(f"trainer.keep_checkpoints must be >= 0 (0 keeps all), got {keep}")
        self.root = checkpoints_root(run_dir)
        self.keep = keep
        self.config_dict = config_dict or {}
        self.root.mkdir(parents=True, exist_ok=True)
        self.removed_stale = self._clean_stale()

    def _clean_stale(self) -> list[str]:
        removed = []
        for entry in self.root.iterdir():
            if _TMP_RE.match(entry.name) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        return sorted(removed)

    def begin(self, step: int) -> Path:
        """Create and return the temporary directory for the checkpoint of ``step``.

        Workers may write their shard files anywhere below it; nothing there is visible to
        :func:`latest` until :meth:`commit`.
        """
        tmp_dir = self.root / f"{checkpoint_dir_name(step)}.tmp-{os.getpid()}"
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)
        tmp_dir.mkdir(parents=True)
        return tmp_dir

    def commit(self, step: int, tmp_dir: str | os.PathLike, driver_state: dict | None = None) -> Path:
        """Finish the checkpoint begun with :meth:`begin`: write ``driver_state`` and the
        manifest, fsync everything, rename into place, then prune old checkpoints.

        Returns the final checkpoint directory.
        """
        tmp_dir = Path(tmp_dir)
        expected = f"{checkpoint_dir_name(step)}.tmp-"
        if tmp_dir.parent.resolve() != self.root.resolve() or not tmp_dir.name.startswith(expected):
            raise ValueError(f"commit(step={step}) got {tmp_dir}, which is not a directory from begin({step})")
        if not tmp_dir.is_dir():
            raise CheckpointError(f"temporary checkpoint directory {tmp_dir} does not exist")
        if (tmp_dir / MANIFEST).exists():
            raise CheckpointError(f"{tmp_dir / MANIFEST} already exists; the manifest is written by commit()")
        if driver_state is not None:
            torch.save(driver_state, tmp_dir / DRIVER_STATE)

        files = []
        for path in sorted(p for p in tmp_dir.rglob("*") if p.is_file()):
            _fsync_file(path)  # also makes workers' shards durable before the rename
            size = path.stat().st_size
            entry: dict[str, Any] = {"path": path.relative_to(tmp_dir).as_posix(), "size": size}
            if size <= SMALL_FILE_BYTES:
                entry["sha256"] = _sha256(path)
            files.append(entry)
        manifest = {
            "version": MANIFEST_VERSION,
            "step": step,
            "time": time.time(),
            "config": self.config_dict,
            "files": files,
        }
        manifest_tmp = tmp_dir / (MANIFEST + ".part")
        with open(manifest_tmp, "w") as handle:
            json.dump(manifest, handle, indent=1, default=str)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(manifest_tmp, tmp_dir / MANIFEST)
        for directory in sorted({p.parent for p in tmp_dir.rglob("*")} | {tmp_dir}, key=lambda p: -len(p.parts)):
            _fsync_dir(directory)

        fault_point("checkpoint.commit", step=step)  # a driver killed here leaves only the .tmp directory
        final = self.root / checkpoint_dir_name(step)
        if final.exists():
            # Re-saving a step (e.g. resumed and saved again): retire the old copy first.
            _remove_tree(final)
        os.rename(tmp_dir, final)
        _fsync_dir(self.root)
        self._prune()
        return final

    def save(self, step: int, driver_state: dict) -> Path:
        """Checkpoint holding only driver state (begin + commit in one call)."""
        return self.commit(step, self.begin(step), driver_state=driver_state)

    def latest(self) -> Path | None:
        """Newest complete checkpoint of this run (see module-level :func:`latest`)."""
        return latest(self.root.parent)

    @staticmethod
    def load_driver_state(path: str | os.PathLike) -> dict:
        """Verified driver state of the checkpoint at ``path`` (see :func:`load_driver_state`)."""
        return load_driver_state(path)

    def _prune(self) -> None:
        if self.keep == 0:
            return
        found = list_checkpoints(self.root.parent)
        for _, path in found[: max(0, len(found) - self.keep)]:
            _remove_tree(path)


def read_manifest(path: str | os.PathLike, verify: bool = True) -> dict:
    """Load ``path/manifest.json``; with ``verify``, check every listed file's size and hash.

    Raises :class:`CheckpointError` naming the offending file.
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: {path} is not a complete checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        int(manifest["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path} is corrupt ({type(exc).__name__}: {exc})") from exc
    if not verify:
        return manifest
    for entry in files:
        file_path = path / entry["path"]
        if not file_path.is_file():
            raise CheckpointError(f"checkpoint file {file_path} listed in {manifest_path} is missing")
        size = file_path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint file {file_path} has {size} bytes, manifest says {entry['size']} (truncated or replaced)"
            )
        if "sha256" in entry and _sha256(file_path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {file_path} is corrupt: sha256 does not match {manifest_path}")
    return manifest


def load_driver_state(path: str | os.PathLike) -> dict:
    """Verify the checkpoint at ``path`` and return the driver state saved with it."""
    path = Path(path)
    manifest = read_manifest(path, verify=True)
    state_path = path / DRIVER_STATE
    if not any(entry["path"] == DRIVER_STATE for entry in manifest["files"]):
        raise CheckpointError(f"{state_path} is not part of checkpoint {path} (saved without driver state)")
    # weights_only=False: driver state holds arbitrary picklable objects (queues of Prompts);
    # the file is our own and its hash was just checked against the manifest.
    return torch.load(state_path, map_location="cpu", weights_only=False)
