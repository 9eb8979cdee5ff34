"""megatron_rl.model.fingerprint: the sha256 that names a run's weights."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.model.fingerprint import model_record, weights_sha256


def test_the_fingerprint_names_the_weights_and_carries_the_build_record(tmp_path):
    save_file({"w": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    first = weights_sha256(tmp_path)
    assert weights_sha256(tmp_path) == first and len(first) == 64
    save_file({"w": torch.ones(4) * (1 + 2 ** -20)}, str(tmp_path / "model.safetensors"))
    assert weights_sha256(tmp_path) != first  # one ulp-sized change is a different model
    (tmp_path / "make_tiny_model.json").write_text(json.dumps({"seed": 0, "build": {"threads": 2}}))
    record = model_record(tmp_path)
    assert record["weights_sha256"] == weights_sha256(tmp_path) and record["built_by"]["build"]["threads"] == 2
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        weights_sha256(tmp_path / "missing")
