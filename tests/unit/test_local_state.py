"""Machine-local state: short Ray temp dirs, and the start-up sweep of dead runs' /dev/shm dirs.

The sweep must remove exactly what is provably a dead run's of this host and user: a live run's
directory (its pid exists), another host's fanned-out copy, another user's, and anything that is
not a per-run directory are all left alone."""
from __future__ import annotations

import os
import subprocess
import sys

from megatron_rl.distributed import local_state
from megatron_rl.distributed.local_state import (
    dead_run_dirs,
    host_tag,
    ray_temp_dir,
    run_dir_name,
    short_temp_root,
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
