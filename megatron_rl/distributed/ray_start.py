"""Start a local Ray node, and start it again when Ray gave up on it too early.

``ray.init`` on a new node starts the GCS and a raylet, then waits for the raylet to register
with the GCS for a fixed 30 s (``raylet_start_wait_time_s`` in ``ray/_private/node.py``, not a
setting). On a host whose cores are busy (a 2-core CI box running two test workers, a node
whose previous job is still shutting down) the raylet can take longer, and ``ray.init`` raises
"The current node timed out during startup" although nothing is wrong. :func:`init_local_ray`
then stops what that attempt started (its GCS, raylet and agents would otherwise run on, since
the failed ``Node`` is never handed back) and tries again, a bounded number of times; any other
error, and the last timeout, propagates unchanged.

It also sets what every local node of the project wants: the raylet starts no idle worker per
CPU for the first driver (every actor of a run asks for its own ``runtime_env``, which those
plain workers cannot serve, so they only cost a Python start each, ~1 CPU s).
"""
from __future__ import annotations

import logging
import os

import psutil
import ray

from megatron_rl.distributed.node_cleanup import stop_processes

log = logging.getLogger(__name__)

START_TIMEOUT_TEXT = "timed out during startup"
"""What Ray's ``Node`` raises when its raylet did not register in time (ray/_private/node.py)."""

START_TRIES = 3
"""Attempts before a start-up timeout propagates."""


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def init_local_ray(tries: int = START_TRIES, **init_kwargs) -> None:
    """``ray.init(**init_kwargs)`` for a new local node, retried after a start-up timeout."""
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    for attempt in range(1, tries + 1):
        before = _children()
        try:
            ray.init(**init_kwargs)
            return
        except Exception as exc:  # Ray raises a bare Exception for this
            if START_TIMEOUT_TEXT not in str(exc) or attempt == tries:
                raise
            left = sorted(_children() - before)
            log.warning("Ray's raylet did not register within Ray's fixed 30 s start-up wait (attempt %d of "
                        "%d; the host is busy): stopping the %d processes that attempt started and starting "
                        "Ray again", attempt, tries, len(left))
            ray.shutdown()
            stop_processes(left)
