"""Fixtures shared by integration test modules.

``ray_session`` is one Ray instance for the whole pytest session (test_engine_handoff,
test_ray_engine, test_reward_pool_ray, test_reward_scheduler_ray share it: each start costs
seconds of the suite's 2 cores), shut down right after the last test that uses it, so the
modules after it (whole-loop runs that start their own Ray, test_weight_fanout's two-node
cluster) run without an idle instance beside them. ``loop`` is per module."""
from __future__ import annotations

import asyncio
import os

import pytest

_RAY_USERS = pytest.StashKey[set]()
"""Node ids of the collected tests that use ``ray_session``."""


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what will not run
def pytest_collection_modifyitems(session, config, items):
    config.stash[_RAY_USERS] = {item.nodeid for item in items if "ray_session" in getattr(item, "fixturenames", ())}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last ``ray_session`` test (its module's fixtures already torn down): stop Ray."""
    yield
    users = item.config.stash.get(_RAY_USERS, set())
    users.discard(item.nodeid)
    if not users and "ray_session" in getattr(item, "fixturenames", ()):
        import ray

        ray.shutdown()


@pytest.fixture(scope="session")
def ray_session():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from tests.helpers.ray_dirs import short_ray_dir

    with short_ray_dir() as temp_dir:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(temp_dir),
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        try:
            yield ray
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def loop():
    """One event loop per engine test module: AsyncLLM is bound to the loop its output handler
    runs on, so a module's engines and every call into them share it."""
    import torch

    torch.set_num_threads(1)
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()
