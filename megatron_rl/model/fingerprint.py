"""Which model a run (and every figure measured with it) used: the sha256 of its weight files.

The tiny models are built locally (``megatron-rl-make-tiny-model``) and their weights depend on
the build's thread count, torch version and the CPU kernels torch picks, so two machines can
hold different models under the same path. ``weights_sha256`` names the weights; the run logs it
and writes it to ``run_dir/model.json`` with the build record the model directory carries.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def weights_sha256(model_dir: str | Path) -> str:
    """sha256 over the model's ``*.safetensors`` files (sorted by name, each name then bytes)."""
    digest = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def model_record(model_dir: str | Path) -> dict:
    """The weights' sha256 and, for a locally built model, the build record it carries."""
    record = {"path": str(model_dir), "weights_sha256": weights_sha256(model_dir)}
    build = Path(model_dir) / "make_tiny_model.json"
    if build.is_file():
        record["built_by"] = json.loads(build.read_text())
    return record
