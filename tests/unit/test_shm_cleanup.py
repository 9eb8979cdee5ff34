"""The session's /dev/shm clean-up removes unmapped new segments and never a mapped one."""
from __future__ import annotations

from multiprocessing import shared_memory

import pytest

from tests.helpers import shm


@pytest.mark.skipif(not shm.SHM.is_dir(), reason="no /dev/shm on this machine")
def test_only_unmapped_segments_are_removed():
    before = shm.segments()
    live = shared_memory.SharedMemory(create=True, size=4096)
    orphan = shared_memory.SharedMemory(create=True, size=4096)
    orphan_name = orphan.name.lstrip("/")
    orphan.close()  # unmapped, not unlinked: what a SIGKILLed engine leaves
    try:
        new = shm.segments() - before
        assert {live.name.lstrip("/"), orphan_name} <= new
        assert live.name.lstrip("/") in shm.mapped_segments()
        # Only these two: a test on the other xdist worker may own other new segments.
        removed = shm.remove_unmapped({live.name.lstrip("/"), orphan_name})
        assert removed == [orphan_name]
        assert orphan_name not in shm.segments() and live.name.lstrip("/") in shm.segments()
    finally:
        live.close()
        live.unlink()
        try:
            shared_memory.SharedMemory(name=orphan_name).unlink()
        except FileNotFoundError:
            pass


@pytest.mark.skipif(not shm.SHM.is_dir(), reason="no /dev/shm on this machine")
def test_only_new_dead_run_dirs_are_removed():
    import os
    import shutil
    import subprocess

    from megatron_rl.distributed.local_state import run_dir_name

    done = subprocess.Popen(["true"])
    done.wait()  # its pid is now dead: what a SIGKILLed trainer rank leaves behind
    dead, live = shm.SHM / run_dir_name(done.pid), shm.SHM / run_dir_name(os.getpid())
    old_dead = shm.SHM / run_dir_name(done.pid + 1_000_000)  # dead too, but not new this session
    tagged = shm.SHM / f"megatron_rl-resume-7-{os.getuid()}-{done.pid}"  # a run with a host tag of its own
    for path in (dead / "weights", live, old_dead, tagged):
        path.mkdir(parents=True)
    try:
        new = {dead.name, live.name, tagged.name}
        assert new <= shm.run_dirs()
        assert sorted(shm.remove_dead_run_dirs(new)) == sorted([dead.name, tagged.name])
        assert not dead.exists() and not tagged.exists() and live.is_dir() and old_dead.is_dir()
    finally:
        for path in (dead, live, old_dead, tagged):
            shutil.rmtree(path, ignore_errors=True)
