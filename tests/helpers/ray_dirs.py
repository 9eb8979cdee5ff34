"""Ray temp dirs for tests: short (Ray's Unix socket paths must stay under 107 bytes, and pytest's
own tmp dirs nest too deep under a long TMPDIR) and removed when the test module is done."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from megatron_rl.distributed.local_state import short_temp_root


@contextlib.contextmanager
def short_ray_dir(prefix: str = "r", room: int = 4) -> Iterator[Path]:
    """A fresh directory directly under $TMPDIR (or /tmp when $TMPDIR is too long for Ray's
    sockets below it, with ``room`` bytes for sub-directories), deleted on exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=short_temp_root(len(prefix) + 9 + room)))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
