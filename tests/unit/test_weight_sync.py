"""write_hf_weights / default_sync_dir: file layout, tied lm_head, atomic replacement."""
from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.rollout.weight_sync import sync_dir
from megatron_rl.rollout.weight_sync.hf_files import EMBED_KEY, LM_HEAD_KEY, write_hf_weights
from megatron_rl.rollout.weight_sync.sync_dir import default_sync_dir


def _read_all(directory) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_tied_model_gets_lm_head_copy_of_embedding(tmp_path):
    embed = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    norm = torch.ones(3)
    target = write_hf_weights({EMBED_KEY: embed, "model.norm.weight": norm}, tmp_path / "w")
    assert target == tmp_path / "w"
    assert sorted(os.listdir(target)) == ["model.safetensors"]
    loaded = _read_all(target)
    assert set(loaded) == {EMBED_KEY, "model.norm.weight", LM_HEAD_KEY}
    assert torch.equal(loaded[LM_HEAD_KEY], embed)
    assert torch.equal(loaded[EMBED_KEY], embed)


def test_shared_storage_is_written_twice(tmp_path):
    # HF state dicts of tied models hold the same tensor under both names.
    embed = torch.randn(5, 2)
    loaded = _read_all(write_hf_weights({EMBED_KEY: embed, LM_HEAD_KEY: embed}, tmp_path / "w"))
    assert torch.equal(loaded[LM_HEAD_KEY], embed) and torch.equal(loaded[EMBED_KEY], embed)


def test_untied_model_keeps_its_own_head_and_missing_head_is_an_error(tmp_path):
    embed, head = torch.zeros(4, 3), torch.ones(4, 3)
    loaded = _read_all(write_hf_weights({EMBED_KEY: embed, LM_HEAD_KEY: head}, tmp_path / "a", tie_word_embeddings=False))
    assert torch.equal(loaded[LM_HEAD_KEY], head)
    with pytest.raises(KeyError, match="lm_head.weight"):
        write_hf_weights({EMBED_KEY: embed}, tmp_path / "b", tie_word_embeddings=False)
    with pytest.raises(KeyError, match="embed_tokens"):
        write_hf_weights({"model.norm.weight": torch.ones(3)}, tmp_path / "c")
    with pytest.raises(TypeError, match="model.norm.weight"):
        write_hf_weights({EMBED_KEY: embed, "model.norm.weight": [1.0]}, tmp_path / "d")
    assert not (tmp_path / "b").exists() and not (tmp_path / "d").exists()


def test_replaces_existing_directory_and_leaves_no_temp_dirs(tmp_path):
    target = tmp_path / "w"
    write_hf_weights({EMBED_KEY: torch.zeros(2, 2)}, target)
    (target / "stale.safetensors").write_bytes(b"old")
    write_hf_weights({EMBED_KEY: torch.full((2, 2), 7.0)}, target)
    assert sorted(os.listdir(target)) == ["model.safetensors"]
    assert torch.equal(_read_all(target)[EMBED_KEY], torch.full((2, 2), 7.0))
    assert sorted(os.listdir(tmp_path)) == ["w"]


def test_failed_write_keeps_previous_weights(tmp_path, monkeypatch):
    target = tmp_path / "w"
    write_hf_weights({EMBED_KEY: torch.zeros(2, 2)}, target)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        write_hf_weights({EMBED_KEY: torch.ones(2, 2)}, target)
    assert torch.equal(_read_all(target)[EMBED_KEY], torch.zeros(2, 2))
    assert sorted(os.listdir(tmp_path)) == ["w"]


def test_sharding_writes_an_index(tmp_path):
    tensors = {f"model.layers.{i}.w": torch.full((4,), float(i)) for i in range(3)}  # 16 bytes each
    tensors[EMBED_KEY] = torch.zeros(2, 2)
    target = write_hf_weights(tensors, tmp_path / "w", max_shard_bytes=32)
    files = sorted(p.name for p in target.glob("*.safetensors"))
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 3 * 16 + 2 * 16  # embed + its lm_head copy
    assert set(index["weight_map"]) == set(tensors) | {LM_HEAD_KEY}
    loaded = _read_all(target)
    for name, fname in index["weight_map"].items():
        assert name in load_file(str(target / fname))
    assert torch.equal(loaded["model.layers.2.w"], torch.full((4,), 2.0))


def test_default_sync_dir_prefers_dev_shm_and_falls_back(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(sync_dir, "_SHM", shm)
    host = socket.gethostname().replace("-", "_")
    assert default_sync_dir() == shm / f"megatron_rl-{host}-{os.getuid()}-{os.getpid()}" / "weights"
    # Not enough room in /dev/shm -> the fallback root.
    assert default_sync_dir(tmp_path / "run", required_bytes=1 << 62) == tmp_path / "run" / "weight_sync"
    monkeypatch.setattr(sync_dir, "_SHM", tmp_path / "absent")
    assert default_sync_dir(tmp_path / "run") == tmp_path / "run" / "weight_sync"


def test_remove_sync_dir_deletes_the_run_weights_and_their_leftovers_only(tmp_path):
    from megatron_rl.rollout.weight_sync.sync_dir import remove_sync_dir

    root = tmp_path / "megatron_rl-0-123"
    weights = write_hf_weights({"model.embed_tokens.weight": torch.ones(4, 2)}, root / "weights")
    (root / ".weights.tmp-1234abcd").mkdir()  # a writer killed mid-write
    (root / ".weights.old-1234abcd").mkdir()
    remove_sync_dir(weights)
    assert not root.exists()  # the per-process dir went with its last entry

    run_dir = tmp_path / "run"  # the fallback: weight_sync/ inside the run dir
    weights = write_hf_weights({"model.embed_tokens.weight": torch.ones(4, 2)}, run_dir / "weight_sync")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / ".weight_sync_other").mkdir()  # not one of the writers' siblings
    remove_sync_dir(weights)
    assert sorted(p.name for p in run_dir.iterdir()) == [".weight_sync_other", "metrics.jsonl"]
    remove_sync_dir(weights)  # already gone: nothing to do
