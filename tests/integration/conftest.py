"""Fixtures shared by integration test modules (each module gets its own instance)."""
from __future__ import annotations

import asyncio
import os

import pytest


@pytest.fixture(scope="module")
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
