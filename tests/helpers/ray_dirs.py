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


@contextlib.contextmanager
def local_ray_cluster(head: dict, others: list[dict]) -> Iterator[object]:
    """Several raylets on this machine (``ray.cluster_utils.Cluster``: the head with ``head``'s
    node args, one more node per entry of ``others``), this process connected to it; yields the
    cluster. Its state lives in a short temp dir removed afterwards: ``Cluster`` writes
    <RAY_TMPDIR>/ray/ray_current_cluster (by default under /tmp/ray, which a new machine lacks)."""
    import os

    import pytest

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    with short_ray_dir("r", room=4) as root, pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", str(root))
        (root / "ray").mkdir()
        cluster = Cluster(initialize_head=True, head_node_args={**head, "temp_dir": str(root / "ray")})
        try:
            for node in others:
                cluster.add_node(**node)
            ray.init(address=cluster.address, log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
