"""Atomic directory replacement, shared by every writer of a directory that readers must only
ever see whole (weight-sync directories, rollout-shard directories, fanned-out copies)."""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def replace_dir(tmp: str | Path, target: str | Path) -> None:
    """Put the finished directory ``tmp`` in place of ``target`` and delete the old one.

    Two renames (old -> trash, tmp -> target): only the short gap between them lacks a
    directory, and readers (engines) read only after the writer returns, so none sees half a
    directory."""
    tmp, target = Path(tmp), Path(target)
    trash = None
    if target.exists():
        trash = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, trash)
    os.rename(tmp, target)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
