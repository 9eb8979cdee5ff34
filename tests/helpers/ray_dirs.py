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
def local_ray_cluster(head: dict, others: list[dict], tries: int = 3) -> Iterator[object]:
    """Several raylets on this machine (``ray.cluster_utils.Cluster``: the head with ``head``'s
    node args, one more node per entry of ``others``), this process connected to it; yields the
    cluster. Its state lives in a short temp dir removed afterwards: ``Cluster`` writes
    <RAY_TMPDIR>/ray/ray_current_cluster (by default under /tmp/ray, which a new machine lacks).

    Each raylet must register with the GCS within Ray's fixed 30 s (``ray/_private/node.py``), which a
    raylet on a busy 2-core box can miss: as ``megatron_rl.distributed.ray_start.init_local_ray`` does
    for one node, a start that times out is stopped (every process it started) and the whole cluster
    started again, up to ``tries`` attempts."""
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
        cluster = start_cluster(Cluster, {**head, "temp_dir": str(root / "ray")}, others, tries)
        try:
            ray.init(address=cluster.address, log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def start_cluster(cluster_class, head: dict, others: list[dict], tries: int = 3):
    """The started cluster (``local_ray_cluster``, ``fault_runs.two_node_cluster``); a start-up timeout stops what the attempt started and
    tries again, any other error (and the last timeout) propagates after the same clean-up."""
    import logging

    import psutil

    from megatron_rl.distributed.node_cleanup import stop_processes
    from megatron_rl.distributed.ray_start import START_TIMEOUT_TEXT

    def children() -> set[int]:
        return {p.pid for p in psutil.Process().children(recursive=True)}

    for attempt in range(1, tries + 1):
        before, cluster = children(), None
        try:
            cluster = cluster_class(initialize_head=True, head_node_args=head)
            for node in others:
                cluster.add_node(**node)
            return cluster
        except Exception as exc:  # Ray raises a bare Exception for a start-up timeout
            if cluster is not None:
                cluster.shutdown()
            stop_processes(sorted(children() - before))
            if START_TIMEOUT_TEXT not in str(exc) or attempt == tries:
                raise
            logging.getLogger(__name__).warning(
                "a raylet did not register within Ray's fixed 30 s (attempt %d of %d; the host is busy): "
                "starting the cluster again", attempt, tries)
    raise AssertionError("unreachable")
