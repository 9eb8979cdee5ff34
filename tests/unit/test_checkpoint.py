"""Checkpoint manager: atomic commit, crash safety, retention, manifest verification, RNG."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import deque

import numpy as np
import pytest
import torch

from megatron_rl.checkpoint.store import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    latest,
    list_checkpoints,
    load_driver_state,
    read_manifest,
    restore_rng_state,
)


def test_commit_layout_manifest_and_worker_files(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3, config_dict={"trainer": {"seed": 7}})
    tmp = manager.begin(5)
    assert tmp.name == f"step_000005.tmp-{os.getpid()}"
    assert latest(tmp_path) is None  # begun but not committed: invisible
    (tmp / "model").mkdir()
    (tmp / "model" / "rank0.pt").write_bytes(b"x" * 1000)
    final = manager.commit(5, tmp, driver_state={"cursor": 12})

    assert final == tmp_path / "checkpoints" / "step_000005"
    assert not tmp.exists()
    assert latest(tmp_path) == final
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["step"] == 5
    assert manifest["config"] == {"trainer": {"seed": 7}}
    assert abs(manifest["time"] - time.time()) < 60
    files = {f["path"]: f for f in manifest["files"]}
    assert set(files) == {"driver_state.pt", "model/rank0.pt"}
    assert files["model/rank0.pt"]["size"] == 1000
    import hashlib

    assert files["model/rank0.pt"]["sha256"] == hashlib.sha256(b"x" * 1000).hexdigest()
    assert load_driver_state(final) == {"cursor": 12}


def test_driver_state_round_trip_with_rng(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)  # advance so states are mid-stream
    state = {
        "data_cursor": {"epoch": 2, "index": 37},
        "scheduler": {"long_prompt_queue": deque(["p:3", "p:9"])},
        "counters": {"tokens": 123456},
        "rng": capture_rng_state(),
    }
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    path = CheckpointManager(tmp_path, keep=1).save(4, state)

    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # scramble
    loaded = load_driver_state(path)
    assert loaded["data_cursor"] == {"epoch": 2, "index": 37}
    assert loaded["scheduler"]["long_prompt_queue"] == deque(["p:3", "p:9"])
    assert loaded["counters"] == {"tokens": 123456}
    restore_rng_state(loaded["rng"])
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[0] == expected[0]
    assert got[1] == expected[1]
    assert torch.equal(got[2], expected[2])


def test_retention_keeps_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3, 10):
        manager.save(step, {"step": step})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 10]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003", "step_000010"]
    assert load_driver_state(latest(tmp_path)) == {"step": 10}
    assert manager.latest() == tmp_path / "checkpoints" / "step_000010"
    assert manager.load_driver_state(manager.latest()) == {"step": 10}


def test_keep_zero_keeps_all_and_negative_rejected(tmp_path):
    manager = CheckpointManager(tmp_path, keep=0)
    for step in range(4):
        manager.save(step, {})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="keep_checkpoints"):
        CheckpointManager(tmp_path, keep=-1)


def test_resave_same_step_replaces(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(3, {"v": 1})
    manager.save(3, {"v": 2})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]
    assert load_driver_state(latest(tmp_path)) == {"v": 2}


def test_leftover_tmp_dir_ignored_then_cleaned(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    good = manager.save(1, {"ok": True})
    # A crashed writer's directory, complete-looking but never renamed, plus a half-deleted one.
    crashed = tmp_path / "checkpoints" / "step_000002.tmp-99999"
    crashed.mkdir()
    (crashed / "driver_state.pt").write_bytes(b"partial")
    (crashed / "manifest.json").write_text('{"step": 2, "files": []}')
    deleting = tmp_path / "checkpoints" / "step_000000.del-99999"
    deleting.mkdir()
    (deleting / "manifest.json").write_text('{"step": 0, "files": []}')

    assert latest(tmp_path) == good
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    restarted = CheckpointManager(tmp_path, keep=2)
    assert restarted.removed_stale == ["step_000000.del-99999", "step_000002.tmp-99999"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


def test_manifest_missing_corrupt_and_file_errors(tmp_path):
    manager = CheckpointManager(tmp_path, keep=5)
    tmp = manager.begin(1)
    (tmp / "shard.bin").write_bytes(b"abcdef")
    path = manager.commit(1, tmp, driver_state={"a": 1})

    # Flip one byte without changing the size: only the hash can catch it.
    (path / "shard.bin").write_bytes(b"abcdeX")
    with pytest.raises(CheckpointError, match=r"shard\.bin is corrupt: sha256"):
        load_driver_state(path)
    (path / "shard.bin").write_bytes(b"abc")
    with pytest.raises(CheckpointError, match=r"shard\.bin has 3 bytes, manifest says 6"):
        load_driver_state(path)
    (path / "shard.bin").unlink()
    with pytest.raises(CheckpointError, match=r"shard\.bin listed in .*manifest\.json is missing"):
        load_driver_state(path)

    (path / "manifest.json").write_text('{"step": 1, "fil')
    with pytest.raises(CheckpointError, match=r"manifest\.json is corrupt"):
        read_manifest(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        load_driver_state(path)


def test_checkpoint_without_driver_state(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1)
    tmp = manager.begin(0)
    (tmp / "w.bin").write_bytes(b"1")
    path = manager.commit(0, tmp)
    assert read_manifest(path)["files"] == [
        {"path": "w.bin", "size": 1, "sha256": "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b"}
    ]
    with pytest.raises(CheckpointError, match="saved without driver state"):
        load_driver_state(path)


def test_commit_rejects_foreign_dir(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1)
    tmp = manager.begin(2)
    with pytest.raises(ValueError, match=r"not a directory from begin\(3\)"):
        manager.commit(3, tmp)


_WRITER = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    from megatron_rl.checkpoint.store import CheckpointManager
    run_dir, ready = sys.argv[1], sys.argv[2]
    manager = CheckpointManager(run_dir, keep=2)
    manager.save(1, {"step": 1})
    tmp = manager.begin(2)
    chunk = b"\\0" * (4 << 20)
    with open(tmp / "model_shard.bin", "wb") as handle:
        for i in range(10_000):  # up to 40 GB: far more than will be written before the kill
            handle.write(chunk)
            handle.flush()
            if i == 4:
                open(ready, "w").close()
    manager.commit(2, tmp, {"step": 2})
    """
)


def test_sigkill_mid_write_keeps_previous_checkpoint(tmp_path):
    ready = tmp_path / "ready"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, f"writer exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "writer never reached the big write"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    leftover = tmp_path / "checkpoints" / f"step_000002.tmp-{proc.pid}"
    assert (leftover / "model_shard.bin").stat().st_size >= 5 * (4 << 20)
    assert latest(tmp_path) == tmp_path / "checkpoints" / "step_000001"
    assert load_driver_state(latest(tmp_path)) == {"step": 1}
    CheckpointManager(tmp_path, keep=2)  # the restarted driver
    assert not leftover.exists()
    assert latest(tmp_path) == tmp_path / "checkpoints" / "step_000001"
