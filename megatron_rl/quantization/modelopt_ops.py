"""The per-tensor quantizers, from nvidia-modelopt (imported only when quantization is on).

modelopt's ``INT8QTensor`` / ``FP8QTensor`` do the rounding, clamping and E4M3 cast, the same
code path as its ``export_hf_checkpoint`` (``tests/unit/test_quantization.py`` checks the two
agree bit for bit). Its whole-model API (``mtq.quantize`` + ``export_hf_checkpoint``) is not used
per sync: it needs a transformers model object with quantizer modules on one process, while a
sync has only tensors, and in the sharded sync each writer holds one engine rank's fused slices.

Importing ``modelopt.torch.quantization`` imports every framework plug-in modelopt finds
installed (vLLM, Megatron, transformers, TE, ...): 20+ s on this box, and vLLM in the trainer
processes. The tensor quantizers need none of them, so :func:`qtensors` hides the plug-in
packages that are not already imported while modelopt loads (modelopt skips a plug-in whose
package is missing) and restores them right after.
"""
from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import torch

# Packages of modelopt's quantization plug-ins (modelopt/torch/quantization/plugins/__init__.py)
# plus the heavy ones they pull in; hidden only when not imported yet.
_PLUGIN_PACKAGES = ("vllm", "megatron", "transformers", "transformer_engine", "apex", "accelerate", "diffusers",
                    "fairscale", "nemo", "peft", "trl", "torch_geometric", "fastvideo", "wandb", "tensorboard")


def import_without_plugins(import_fn, keep: tuple[str, ...] = ()):
    """Run ``import_fn()`` with the not-yet-imported plug-in packages (except ``keep``) hidden
    from the import system, so modelopt registers no plug-in for them; returns its result."""
    hidden = [name for name in _PLUGIN_PACKAGES if name not in keep and name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ModuleNotFoundError
    try:
        return import_fn()
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


@functools.cache
def qtensors() -> SimpleNamespace:
    """modelopt's INT8QTensor and FP8QTensor (imported once per process)."""

    def load():
        from modelopt.torch.quantization.qtensor import FP8QTensor, INT8QTensor

        return SimpleNamespace(INT8QTensor=INT8QTensor, FP8QTensor=FP8QTensor)

    return import_without_plugins(load)


def modelopt_version() -> str:
    """The installed nvidia-modelopt version (recorded in the fp8 checkpoint's producer field)."""
    from importlib import metadata

    return metadata.version("nvidia-modelopt")


def quantize_rows(weight: torch.Tensor, scales: torch.Tensor, method: str) -> torch.Tensor:
    """``weight / scales`` on the int8 or FP8 E4M3 grid (``scales``: ``[rows, 1]`` float32).

    int8: round to nearest, clamp to [-128, 127]. fp8: cast to E4M3 (|values| <= 448 by
    construction of the scales). Computed in float32 on the weight's device."""
    w = weight.detach().float()
    if method == "int8":
        qt, _ = qtensors().INT8QTensor.quantize(w, scales=scales)
    elif method == "fp8":
        qt, _ = qtensors().FP8QTensor.quantize(w, scales=scales)
    else:
        raise ValueError(f"quantize_rows: unknown method {method!r} (int8 or fp8)")
    return qt._quantized_data
