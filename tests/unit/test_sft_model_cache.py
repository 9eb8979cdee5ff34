"""The SFT'd tiny model's per-machine cache (tests/helpers/sft_model): the key changes with every
input the weights depend on, a model is built once per key (a second call reuses it), and only a
finished build counts."""
from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import sft_model
from tests.helpers.sft_model import SFTBuild, ensure_sft_tiny_model

# A build that takes seconds: one layer of width 64, two SFT steps, one held-out prompt.
QUICK = SFTBuild(sft_steps=2, batch_size=2, eval_prompts=1,
                 shape={"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                        "intermediate_size": 64, "max_position_embeddings": 512})


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLPACKER_MODEL_CACHE", str(tmp_path / "models"))


def test_the_key_covers_every_build_input(monkeypatch, tmp_path):
    import torch

    base = SFTBuild()
    changed = [dataclasses.replace(base, seed=1), dataclasses.replace(base, sft_steps=401),
               dataclasses.replace(base, batch_size=16), dataclasses.replace(base, lr=1e-3),
               dataclasses.replace(base, num_threads=1), dataclasses.replace(base, shape={"num_layers": 2}),
               dataclasses.replace(base, recheck={"rate": 0.08})]
    keys = {base.key()} | {build.key() for build in changed}
    assert len(keys) == 1 + len(changed)
    assert SFTBuild(shape={"num_layers": 4}).key() == base.key()  # a default spelled out is the same model
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", "0.0.0-other")
        assert base.key() not in keys
    source = tmp_path / "repo"
    for name in sft_model.BUILD_SOURCES:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((sft_model.REPO / name).read_bytes())
    monkeypatch.setattr(sft_model, "REPO", source)
    assert base.key() in keys  # the same sources: the same key
    (source / "megatron_rl/data/arithmetic.py").write_text("# another problem generator\n")
    assert base.key() not in keys
    assert base.directory().parent == tmp_path / "models"


def test_built_once_per_key_and_only_a_finished_build_counts(monkeypatch):
    from megatron_rl.tools import make_tiny_model as tool

    out = ensure_sft_tiny_model(QUICK)
    assert out == QUICK.directory() and (out / "model.safetensors").is_file()
    assert (out.parent / f"{out.name}.inputs.json").is_file()
    monkeypatch.setattr(tool, "make_tiny_model", lambda *a, **k: pytest.fail("rebuilt a cached model"))
    assert ensure_sft_tiny_model(QUICK) == out
    # A directory without the build's report (a copy cut short, an older layout) is not a model.
    other = dataclasses.replace(QUICK, seed=5)
    other.directory().mkdir(parents=True)
    (other.directory() / "config.json").write_text("{}")
    with pytest.raises(pytest.fail.Exception, match="rebuilt"):
        ensure_sft_tiny_model(other)
