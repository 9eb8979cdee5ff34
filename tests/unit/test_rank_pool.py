"""The SPMD tests' pooled ranks (tests/helpers/rank_pool.py): results, teardown between
scenarios, and what a failing, hanging or dying scenario does to the pool."""
from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest

from megatron_rl.distributed.ports import free_port
from tests.helpers.rank_pool import RankPool


def _all_reduce_rank(rank: int, world: int, port: int, offset: int) -> dict:
    """Joins a gloo world, sums the ranks and says what state the process started in."""
    import torch
    import torch.distributed as dist

    was_initialised = dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    total = torch.tensor([rank + offset])
    dist.all_reduce(total)
    return {"pid": os.getpid(), "sum": int(total), "was_initialised": was_initialised,
            "threads": torch.get_num_threads()}


def _fail_on_rank_1(rank: int, world: int, port: int) -> None:
    if rank == 1:
        raise ValueError("scenario failed on purpose")
    time.sleep(600)  # rank 0 would wait for rank 1 in a collective


def _sleep(rank: int, world: int, port: int, seconds: float) -> None:
    time.sleep(seconds)


def _exit(rank: int, world: int, port: int) -> None:
    os._exit(3)


def _results(out: Path, ranks) -> list:
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in ranks]


@pytest.fixture(scope="module")
def shared():
    """One pool for the tests that leave it healthy."""
    pool = RankPool(size=2)
    yield pool
    pool.close()


@pytest.fixture
def pool():
    """A pool of its own for a test that breaks it."""
    pool = RankPool(size=2)
    yield pool
    pool.close()


def test_scenarios_reuse_the_ranks_and_each_starts_uninitialised(shared, tmp_path: Path) -> None:
    pool = shared
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    assert sorted(pool.run(_all_reduce_rank, 2, free_port(), (10,), first, timeout_s=120)) == [0, 1]
    assert sorted(pool.run(_all_reduce_rank, 2, free_port(), (20,), second, timeout_s=120)) == [0, 1]
    a, b = _results(first, (0, 1)), _results(second, (0, 1))
    assert [s for s, _ in a + b] == ["ok"] * 4
    assert [v["sum"] for _, v in a] == [21, 21] and [v["sum"] for _, v in b] == [41, 41]
    assert [v["pid"] for _, v in a] == [v["pid"] for _, v in b], "the second scenario ran in new processes"
    assert not any(v["was_initialised"] for _, v in a + b), "a scenario found the previous one's process group"
    assert {v["threads"] for _, v in a + b} == {1}


def test_a_world_smaller_than_the_pool_runs_on_its_first_ranks(shared, tmp_path: Path) -> None:
    assert shared.run(_all_reduce_rank, 1, free_port(), (5,), tmp_path, timeout_s=120) == [0]
    assert _results(tmp_path, (0,))[0][1]["sum"] == 5 and not (tmp_path / "rank1.pkl").exists()


def test_a_hung_scenario_times_out_naming_its_ranks(pool, tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after 3"):
        pool.run(_sleep, 2, free_port(), (60.0,), tmp_path, timeout_s=3)


def test_a_rank_that_exits_is_an_error_and_the_pool_reports_it_dead(pool, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"pooled ranks exited without a result: exit codes \{[01]: 3"):
        pool.run(_exit, 2, free_port(), (), tmp_path, timeout_s=120)
    assert not pool.alive()


def test_run_spmd_replaces_a_pool_a_failed_scenario_left_behind(tmp_path: Path) -> None:
    from tests.helpers import rank_pool
    from tests.helpers.megatron_cases import run_spmd

    failed = tmp_path / "failed"
    failed.mkdir()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*scenario failed on purpose"):
        run_spmd(_fail_on_rank_1, 2, (), failed, timeout_s=300)
    assert time.monotonic() - start < 60, "it waited for rank 0, stuck where rank 1 never came"
    assert rank_pool._pool is None, "the pool with a rank stuck in the failed scenario was kept"
    out = tmp_path / "after"
    out.mkdir()
    try:
        assert [r["sum"] for r in run_spmd(_all_reduce_rank, 2, (0,), out, timeout_s=120)] == [1, 1]
    finally:
        rank_pool.close_shared_pool()
