"""The directory engines started for a tensor push load from: the model's config and tokenizer
and a manifest, no weights (the engines load dummy weights, then get a push). Written by the
driver (``push.transport.TensorTransport.new_engine_dir``), read by the engine
(``vllm_engine``)."""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from megatron_rl.runtime.files import replace_dir

PUSH_MANIFEST = "tensor_push.json"
PUSH_FORMAT = "megatron_rl.tensor_push/1"


def write_push_start_dir(hf_path: str | Path, directory: str | Path, tp: int, version: int,
                         quantization=None) -> Path:
    """A directory new engines of TP ``tp`` start from without any weights on disk: the HF
    checkpoint's config, tokenizer and generation files plus a manifest; the engines load dummy
    weights and wait for a tensor push of ``version`` (replaces ``directory`` atomically).
    ``quantization`` (a ``quantization.scheme.QuantSpec``, rollout.quantization): the config
    carries that engine format, so the new engines build quantized layers for the push."""
    target = Path(directory)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        for item in Path(hf_path).iterdir():
            if item.is_file() and not item.name.endswith(".safetensors") and not item.name.endswith(".bin") \
                    and item.name != "model.safetensors.index.json":
                shutil.copy2(item, tmp / item.name)
        if quantization is not None:
            from megatron_rl.quantization.engine_format import write_model_files

            write_model_files(hf_path, tmp, quantization)
        (tmp / PUSH_MANIFEST).write_text(json.dumps({"format": PUSH_FORMAT, "tensor_parallel_size": tp,
                                                     "version": version, "hf_path": str(hf_path)}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, target)
    return target


def read_push_manifest(directory: str | Path) -> dict | None:
    """The manifest of :func:`write_push_start_dir`, or None."""
    path = Path(directory) / PUSH_MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != PUSH_FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {PUSH_FORMAT!r}")
    return manifest
