"""The quantization step of a quantized weight sync (``rollout.quantization``) on the device,
the part of low-precision rollout that runs without vLLM.

The model_setup checkpoint's weights are quantized where they live (the GPU in GPU mode) by
nvidia-modelopt's tensor quantizers, exactly as every sync does
(``megatron_rl.quantization.scheme.quantize_tensors``), for ``fp8`` (E4M3 per-channel weights,
modelopt's FP8 export format that vLLM's ``ModelOptFp8Config`` reads) and ``int8``
(compressed-tensors W8A8). Checked per method:

* every decoder linear weight comes out in the low-precision dtype, on the device, with a
  float32 scale of the engine format's shape, and the layers that stay in high precision
  (embeddings, output layer, norms, biases) come out untouched;
* modelopt's result against a plain torch rounding of the same weights (same scales): the
  fraction of bit-identical elements (modelopt's CUDA kernels may round a few ties differently;
  at most 1e-4 of the elements may differ, each within the rounding bound);
* ``|dequantized - weight|`` within half a grid step everywhere;
* the export: safetensors written and read back bit for bit, ``config.json``'s
  ``quantization_config`` (and for fp8 modelopt's ``hf_quant_config.json``) as vLLM reads them.

Figures: GB of weights quantized per second (what a sync of this model pays for quantizing on
the device), the modelopt version and its import time. On CPU the same with tiny sizes (an fp8
cast is a storage format there; the code path is modelopt's own).
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests.gpu.check.common import Context, outcome, prepare_process, timed

MAX_TIE_MISMATCH = 1e-4
"""Largest fraction of elements whose bits may differ from the plain torch rounding."""


def _reference(weight: torch.Tensor, scale: torch.Tensor, method: str) -> torch.Tensor:
    """The same quantization written with plain torch ops: what modelopt must agree with."""
    x = weight.detach().float() / scale.float().reshape(-1, 1)
    if method == "int8":
        return torch.round(x).clamp(-128, 127).to(torch.int8)
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _load_weights(model_dir: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update({k: v.to(device) for k, v in load_file(str(path)).items()})
    if not tensors:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors (the model_setup part writes them)")
    return tensors


def _check_method(ctx: Context, model_dir: Path, tensors: dict[str, torch.Tensor], method: str,
                  workdir: Path) -> tuple[dict[str, bool], dict[str, Any]]:
    from safetensors.torch import load_file, save_file

    from megatron_rl.quantization.engine_format import HF_QUANT_CONFIG, write_model_files
    from megatron_rl.quantization.scheme import (
        dequantize,
        is_quantized_weight,
        quant_spec,
        quantize_tensors,
        rounding_bound,
        scale_name,
    )

    spec = quant_spec(method, "bfloat16")
    items = sorted(tensors.items())
    list(quantize_tensors([i for i in items if is_quantized_weight(i[0])][:1], spec))  # warm-up: kernels, lazy set-up
    out, seconds = timed(ctx, lambda: dict(quantize_tensors(items, spec)))
    quantized = [n for n in tensors if is_quantized_weight(n)]
    weight_bytes = sum(tensors[n].numel() * tensors[n].element_size() for n in quantized)
    rows_ok = dtype_ok = device_ok = True
    elements = mismatched = 0
    worst_over_bound = 0.0
    for name in quantized:
        w, q, s = tensors[name], out[name], out[scale_name(name)]
        dtype_ok &= q.dtype == spec.weight_dtype and s.dtype == torch.float32
        device_ok &= q.device.type == ctx.device.type and s.device.type == ctx.device.type
        rows_ok &= tuple(s.shape) == ((w.shape[0], 1) if method == "int8" else (w.shape[0],))
        ref = _reference(w, s, method)
        elements += q.numel()
        mismatched += int((_bits(q) != _bits(ref)).sum())
        err = (dequantize(q, s) - w.float()).abs()
        worst_over_bound = max(worst_over_bound, float((err / rounding_bound(w, s, spec)).max()))
    kept = [n for n in tensors if not is_quantized_weight(n)]
    untouched = all(out[n] is tensors[n] or torch.equal(out[n], tensors[n]) for n in kept)
    # Export as a quantized engine's start-up checkpoint: files written and read back.
    target = workdir / f"export-{method}"
    target.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in out.items()}, str(target / "model.safetensors"))
    write_model_files(model_dir, target, spec)
    back = load_file(str(target / "model.safetensors"))
    round_trip = all(torch.equal(_bits(back[n]), _bits(out[n].cpu())) if back[n].dtype == spec.weight_dtype
                     else torch.equal(back[n], out[n].cpu()) for n in out)
    qc = json.loads((target / "config.json").read_text()).get("quantization_config", {})
    if method == "fp8":
        legacy = json.loads((target / HF_QUANT_CONFIG).read_text())
        config_ok = (qc.get("quant_method") == "modelopt" and "lm_head" in qc.get("ignore", [])
                     and legacy["quantization"]["quant_algo"] == qc.get("quant_algo"))
    else:
        config_ok = qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "int-quantized"
    fraction = mismatched / max(elements, 1)
    checks = {
        f"{method}: low-precision weights with float32 scales": dtype_ok and bool(quantized),
        f"{method}: quantized on the device": device_ok,
        f"{method}: one scale per output channel": rows_ok,
        f"{method}: embeddings, norms, lm_head, biases untouched": untouched,
        f"{method}: modelopt == torch rounding (ties aside)": fraction <= MAX_TIE_MISMATCH,
        f"{method}: error within half a grid step": worst_over_bound <= 1.0,
        f"{method}: export round trip": round_trip,
        f"{method}: engine config": config_ok,
    }
    figures = {"tensors_quantized": len(quantized), "weight_gb": weight_bytes / 1e9, "quantize_s": seconds,
               "gb_per_s": weight_bytes / 1e9 / max(seconds, 1e-9), "bit_mismatch_fraction": fraction,
               "max_error_over_bound": worst_over_bound, "quantization_config": qc}
    return checks, figures


def quantize_export(ctx: Context) -> dict[str, Any]:
    """fp8 and int8: the sync's quantization step on the device and the engine-format export."""
    prepare_process(ctx, deterministic=False)
    model_dir = ctx.require_model()
    start = time.perf_counter()
    try:
        from megatron_rl.quantization.modelopt_ops import modelopt_version, qtensors

        qtensors()
    except ImportError as exc:
        raise RuntimeError(f"nvidia-modelopt does not import ({exc}); carry its wheels "
                           "(tools/prepare_gpu_wheels.sh puts them in .gpu_wheels)") from exc
    import_s = time.perf_counter() - start
    tensors = _load_weights(model_dir, ctx.device)
    checks: dict[str, bool] = {}
    figures: dict[str, Any] = {"modelopt": modelopt_version(), "modelopt_import_s": import_s,
                               "device": str(ctx.device)}
    with tempfile.TemporaryDirectory(dir=ctx.workdir) as tmp:
        for method in ("fp8", "int8"):
            c, f = _check_method(ctx, model_dir, tensors, method, Path(tmp))
            checks.update(c)
            figures[method] = f
    summary = (f"fp8 {figures['fp8']['gb_per_s']:.1f} GB/s, int8 {figures['int8']['gb_per_s']:.1f} GB/s of "
               f"weights quantized ({figures['fp8']['weight_gb']:.2f} GB); modelopt {figures['modelopt']}; bits "
               f"differing from torch rounding {figures['fp8']['bit_mismatch_fraction']:.1e} / "
               f"{figures['int8']['bit_mismatch_fraction']:.1e}")
    return outcome(checks, summary, figures)
