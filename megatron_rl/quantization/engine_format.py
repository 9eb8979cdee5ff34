"""The engine side of the quantized checkpoint format: what vLLM reads to build quantized layers.

vLLM decides at start-up, from ``quantization_config`` in the model's ``config.json``, which
layers are quantized and how; later in-place reloads only feed tensors. So a quantized engine
starts from a quantized checkpoint (:func:`quantize_hf_checkpoint` for the first engines,
the rollout-shard directory with :func:`write_model_files` for engines rebuilt by an elastic-TP
switch, or with the tensor push its weightless start directory,
``rollout.weight_sync.push.start_dir``), and every sync then sends :func:`~megatron_rl.quantization.scheme.
quantize_tensors`'s output (the tensor push: the engine ranks apply ``quantize_slices`` to what
they receive).

* ``int8``: compressed-tensors ``W8A8`` (``int-quantized``): int8 per-channel weights with a
  ``[rows, 1]`` float32 ``weight_scale``, dynamic per-token int8 activations, ``lm_head`` ignored
  (embeddings are not ``Linear``, norms have no weights to quantize). vLLM's
  ``CompressedTensorsW8A8Int8`` serves it (CUTLASS on GPUs; oneDNN or AMX on CPUs).
* ``fp8``: modelopt's ``FP8_PER_CHANNEL_PER_TOKEN`` export: E4M3 per-channel weights with a
  ``[rows]`` float32 ``weight_scale``, dynamic per-token FP8 activations; ``config.json`` gets
  the ``quantization_config`` modelopt's ``export_hf_checkpoint`` writes (``quant_method:
  modelopt``) and ``hf_quant_config.json`` its legacy copy. vLLM's ``ModelOptFp8Config`` serves
  it (SM 8.9+ GPUs).

The two dicts are written out here (importing compressed-tensors costs ~12 s and modelopt's
export module more); ``tests/unit/test_quantization.py`` checks them against compressed-tensors'
own W8A8 preset and against modelopt's export of a real model.
"""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch

from megatron_rl.quantization.scheme import QuantSpec, quantize_tensors
from megatron_rl.runtime.files import replace_dir

IGNORED_MODULES = ["lm_head"]
"""Linear modules left unquantized (the output layer); embeddings and norms are not Linear."""

FP8_ALGO = "FP8_PER_CHANNEL_PER_TOKEN"
HF_QUANT_CONFIG = "hf_quant_config.json"


def _int8_args(symmetric: bool, strategy: str, dynamic: bool) -> dict:
    return {"num_bits": 8, "type": "int", "symmetric": symmetric, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None}


def quantization_config(spec: QuantSpec) -> dict:
    """``quantization_config`` of the engine's ``config.json`` for ``spec``."""
    if spec.method == "int8":
        return {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": _int8_args(True, "channel", False),
                "input_activations": _int8_args(spec.activation_symmetric, "token", True),
                "output_activations": None,
            }},
            "kv_cache_scheme": None,
            "ignore": list(IGNORED_MODULES),
        }
    return {"quant_method": "modelopt", "quant_algo": FP8_ALGO, "ignore": list(IGNORED_MODULES),
            "producer": {"name": "modelopt", "version": _modelopt_version()}}


def hf_quant_config(spec: QuantSpec) -> dict | None:
    """modelopt's ``hf_quant_config.json`` (its export writes it beside ``config.json``), fp8 only."""
    if spec.method != "fp8":
        return None
    return {"producer": {"name": "modelopt", "version": _modelopt_version()},
            "quantization": {"quant_algo": FP8_ALGO, "kv_cache_quant_algo": None,
                             "exclude_modules": list(IGNORED_MODULES)}}


def _modelopt_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("nvidia-modelopt")
    except metadata.PackageNotFoundError:  # the config is still valid; vLLM does not read it
        return "unknown"


def write_model_files(hf_path: str | Path, target: str | Path, spec: QuantSpec | None) -> None:
    """Copy ``hf_path``'s config, tokenizer and generation files (not its weights) into
    ``target``; with ``spec``, ``config.json`` carries its ``quantization_config`` (and, for fp8,
    ``hf_quant_config.json`` is written)."""
    target = Path(target)
    for item in Path(hf_path).iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name not in (
                "model.safetensors.index.json", HF_QUANT_CONFIG):
            shutil.copy2(item, target / item.name)
    if spec is None:
        return
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config(spec)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    legacy = hf_quant_config(spec)
    if legacy is not None:
        (target / HF_QUANT_CONFIG).write_text(json.dumps(legacy, indent=2))


def _read_hf_tensors(hf_path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(hf_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_path}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return tensors


def quantize_hf_checkpoint(hf_path: str | Path, target: str | Path, spec: QuantSpec,
                           dtype: torch.dtype | None = None) -> Path:
    """The HF checkpoint ``hf_path`` as a quantized checkpoint in ``target`` (replaced as a
    whole): what the first engines of a quantized run start from. The unquantized tensors are
    cast to ``dtype`` when given (the engine's). A tied model's checkpoint keeps no
    ``lm_head.weight``, as the HF one (vLLM unties the engine's config when it finds one, and the
    sharded sync writes for the architecture the trainer sees). Returns ``target``."""
    from safetensors.torch import save_file

    hf_path, target = Path(hf_path), Path(target)
    tensors = _read_hf_tensors(hf_path)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    out = {name: t.contiguous() for name, t in quantize_tensors(sorted(tensors.items()), spec)}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_model_files(hf_path, tmp, spec)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, target)
    return target


def attention_scale_params(num_layers: int, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """State-dict entries a quantized engine adds to each attention layer, with the values they
    are created with (= "not in the checkpoint"; no KV-cache quantization here). vLLM's
    sharded_state loader refuses a rank file that lacks any state-dict entry, so rank files of
    quantized engines carry them:

    * int8 (``CompressedTensorsKVCacheMethod``): ``q/k/v_scale`` ones and ``q/k/v_zero_point``
      zeros, shape ``[1]``;
    * fp8 (modelopt's, vLLM's ``BaseKVCacheMethod``): ``q/k/v/prob_scale`` scalars -1.0.
    """
    if spec.method == "int8":
        per_layer = {f"{kind}_{what}": torch.full((1,), 1.0 if what == "scale" else 0.0)
                     for kind in ("q", "k", "v") for what in ("scale", "zero_point")}
    else:
        per_layer = {f"{kind}_scale": torch.tensor(-1.0) for kind in ("q", "k", "v", "prob")}
    return {f"model.layers.{layer}.self_attn.attn.{name}": value.clone()
            for layer in range(num_layers) for name, value in per_layer.items()}
