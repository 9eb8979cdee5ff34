"""Fixtures shared by integration test modules.

``ray_session``: one Ray instance shared by consecutive modules that use it (test_reward_pool_ray
and test_reward_scheduler_ray run back to back on one; each start costs seconds of the suite's 2
cores). It is started by the first test that needs it and shut down after the last test of a
run of consecutive users (its module's fixtures torn down first), so the modules in between
(whole-loop runs that start their own Ray, test_weight_fanout's two-node cluster) never run
beside an idle instance. ``loop`` is per module."""
from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

_ray_dir = contextlib.ExitStack()
"""Holds the running instance's temp dir (removed when it shuts down)."""


def _uses_ray(item) -> bool:
    return item is not None and "ray_session" in getattr(item, "fixturenames", ())


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()
    _ray_dir.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop Ray after a user of ``ray_session`` when the next test is in another module and does
    not use it (hookwrapper: after the module's fixtures, e.g. engines on Ray, are torn down)."""
    yield
    if _uses_ray(item) and (nextitem is None or (getattr(nextitem, "module", None) is not item.module
                                                  and not _uses_ray(nextitem))):
        _shutdown_ray()


def pytest_sessionfinish(session, exitstatus):
    """A run cut short (-x, a crash) skips the teardown above: stop Ray here."""
    import ray

    if ray.is_initialized():
        _shutdown_ray()


@pytest.fixture(scope="module")
def ray_session():
    """Ray, started here if it is not running (module scope: engines on it may be module fixtures)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from tests.helpers.ray_dirs import short_ray_dir

    if not ray.is_initialized():
        from megatron_rl.distributed.ray_start import init_local_ray

        temp_dir = _ray_dir.enter_context(short_ray_dir())
        init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(temp_dir),
                       runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray


@pytest.fixture(scope="module")
def loop():
    """One event loop per engine test module: AsyncLLM is bound to the loop its output handler
    runs on, so a module's engines and every call into them share it."""
    import torch

    torch.set_num_threads(1)
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()
