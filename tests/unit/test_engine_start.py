"""megatron_rl.rollout.actor.engine_start: the fork window lent to vLLM's process launchers.

The engine tests (tests/integration/test_vllm_engine.py, test_ray_engine.py) check the forked
engine itself; these check the window: what it changes, that it puts everything back, and what a
child forked inside it sees.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch._dynamo

from megatron_rl.rollout.actor import engine_start
from megatron_rl.rollout.actor.vllm_engine_args import scoped_env

LAUNCHERS = [importlib.import_module(name) for name in engine_start._LAUNCHERS]


def _launchers():
    return [module.get_mp_context for module in LAUNCHERS]


def test_an_unknown_method_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"rollout\.cpu_engine_start.*'forkserver'"):
        with engine_start.engine_processes("forkserver"):
            pass


def test_spawn_leaves_vllm_as_it_is():
    before = _launchers()
    with engine_start.engine_processes("spawn"):
        assert _launchers() == before
        assert engine_start.forked_from is None


def _report(queue):
    queue.put((engine_start.forked_from, torch.get_num_threads(), torch._dynamo.config.disable))


def test_fork_lends_a_fork_context_with_the_engine_settings_then_restores_everything():
    before, threads, disable = _launchers(), torch.get_num_threads(), torch._dynamo.config.disable
    with scoped_env({"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}):
        with engine_start.engine_processes("fork"):
            contexts = [launcher() for launcher in _launchers()]
            assert [c.get_start_method() for c in contexts] == ["fork", "fork"]
            assert torch.get_num_threads() == 1 and torch._dynamo.config.disable
            queue = contexts[0].Queue()
            child = contexts[0].Process(target=_report, args=(queue,))
            child.start()
            got = queue.get(timeout=60)
            child.join(timeout=60)
    # The child is a copy made inside the window: it knows its engine host and has its settings.
    assert got == (os.getpid(), 1, True)
    assert child.exitcode == 0
    assert _launchers() == before
    assert (torch.get_num_threads(), torch._dynamo.config.disable, engine_start.forked_from) == (threads, disable, None)


def _report_tempdir(queue):
    import tempfile

    queue.put(tempfile.gettempdir())


def test_a_child_forked_in_the_window_puts_temp_files_in_the_engines_tmpdir(tmp_path, monkeypatch):
    """vLLM's rendezvous file goes to ``tempfile.gettempdir()`` of the engine core; a core forked from a
    process that had already cached its temp dir used the cached one, not the engine's scratch dir."""
    import tempfile

    host, scratch = tmp_path / "host", tmp_path / "scratch"
    host.mkdir()
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(host))  # what this process cached at its first use
    with scoped_env({"OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}):
        with engine_start.engine_processes("fork"):
            context = _launchers()[0]()
            queue = context.Queue()
            child = context.Process(target=_report_tempdir, args=(queue,))
            child.start()
            got = queue.get(timeout=60)
            child.join(timeout=60)
    assert got == str(scratch)
    assert tempfile.tempdir == str(host)  # this process keeps its own


def test_fork_restores_everything_when_the_engine_start_fails():
    before, threads, disable = _launchers(), torch.get_num_threads(), torch._dynamo.config.disable
    with pytest.raises(RuntimeError, match="engine start failed"):
        with scoped_env({"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}), engine_start.engine_processes("fork"):
            raise RuntimeError("engine start failed")
    assert _launchers() == before
    assert (torch.get_num_threads(), torch._dynamo.config.disable, engine_start.forked_from) == (threads, disable, None)


@pytest.mark.parametrize("omp, torch_threads", [("2", 1), (None, 2)])
def test_engines_that_run_more_threads_are_spawned(omp, torch_threads, caplog):
    """GNU OpenMP hangs in a forked process that runs more than one thread (engine_start's
    docstring): more threads, from the engine's OMP_NUM_THREADS or, without it, from this
    process's torch, leave vLLM's spawn in place."""
    before, threads = _launchers(), torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        with caplog.at_level("INFO", logger=engine_start.__name__):
            with scoped_env({"OMP_NUM_THREADS": omp}), engine_start.engine_processes("fork"):
                assert _launchers() == before and engine_start.forked_from is None
        assert "spawned, not forked: they run 2 threads" in caplog.text
    finally:
        torch.set_num_threads(threads)


def test_the_title_setter_falls_back_to_rays_where_setproctitle_changes_nothing(monkeypatch):
    class Raylet:
        titles: list[str] = []

        def setproctitle(self, title):
            self.titles.append(title)

    raylet = Raylet()
    monkeypatch.setitem(sys.modules, "ray._raylet", raylet)
    current = {"title": ""}

    def no_op(title):  # py-setproctitle in a Ray worker
        pass

    engine_start._title_setter(no_op, lambda: current["title"])("VLLM::EngineCore")
    assert raylet.titles == ["VLLM::EngineCore"]

    def works(title):  # a plain process
        current["title"] = title

    engine_start._title_setter(works, lambda: current["title"])("VLLM::Worker_TP0")
    assert raylet.titles == ["VLLM::EngineCore"] and current["title"] == "VLLM::Worker_TP0"
