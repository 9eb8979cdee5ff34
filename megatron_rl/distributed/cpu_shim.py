"""Run Megatron-Core on a machine without a GPU by redirecting its CUDA calls to the CPU.

Megatron-Core assumes CUDA in a handful of places: it passes
``torch.cuda.current_device()`` as the device of buffers, keeps its RNG tracker on CUDA
generators, creates a few tensors with a literal ``device="cuda"``, asserts
``torch.cuda.FloatTensor`` gradients in grad clipping, and synchronises streams. This module
redirects exactly those to the CPU so that the *same* Megatron code paths (TP, PP, DDP, the
optimizer, vocab-parallel cross entropy) run over gloo.

Two parts:

* :func:`apply_cpu_shim` patches process-wide functions (``torch.cuda.current_device``, RNG
  state, synchronize/streams/events, Megatron's grad clipping, and the backward of Megatron's
  activation-recompute checkpoint, see :func:`_backward_in_device_mode`). Idempotent, and a
  no-op when a GPU is present. Never call it in a process that hosts vLLM: vLLM's CPU backend
  probes ``torch.cuda`` itself.
* :func:`cpu_device_mode` is a context manager (also usable as a decorator) that rewrites
  ``device="cuda"`` / ``.cuda()`` in factory calls to the CPU. torch function modes are
  thread-local, so enter it in every thread that runs Megatron code.

Sequence parallelism on CPU: gloo has the reduce-scatter / all-gather Megatron's SP mappings
use; the one obstacle is the norm. Without Transformer Engine or apex the local layer spec
builds ``WrappedTorchNorm`` (megatron/core/transformer/torch_norm.py), which asserts
``not config.sequence_parallel`` because it does not tag its weights: under SP each TP rank
normalises only its slice of the sequence, so the norm weights' gradients are partial sums
that ``finalize_model_grads`` must all-reduce over TP, and it picks exactly the parameters
tagged ``sequence_parallel`` (``_allreduce_non_tensor_model_parallel_grads`` in
megatron/core/distributed/finalize_model_grads.py; TE's and apex's norms tag theirs, see
megatron/core/fusions/fused_layer_norm.py). :class:`SequenceParallelTorchNorm` is that tagged
torch norm; model/qwen2.py puts it in the local spec only when the shim is needed.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch.overrides import TorchFunctionMode

_F = TypeVar("_F", bound=Callable[..., Any])
_LOCK = threading.Lock()
_APPLIED = False
_CPU = torch.device("cpu")


def shim_needed() -> bool:
    """True when no CUDA device is visible, i.e. Megatron must be redirected to the CPU."""
    return not torch.cuda.is_available()


def _is_cuda_device(device: Any) -> bool:
    # On a machine without a GPU a bare int device can only mean a CUDA ordinal.
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            # Tensor.cuda(...) -> stay on the CPU (no copy, like .cuda() on a CUDA tensor).
            return args[0]
        if name == "to" and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def _cpu_device_mode_cm() -> Iterator[None]:
    if not shim_needed():
        yield
        return
    with _CpuDeviceMode():
        yield


class cpu_device_mode(contextlib.ContextDecorator):
    """Context manager / decorator: CUDA device arguments of torch calls land on the CPU.

    A no-op when a GPU is present. Thread-local: enter it in each thread running Megatron code.
    """

    def __enter__(self) -> "cpu_device_mode":
        self._cm = _cpu_device_mode_cm()
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        return bool(self._cm.__exit__(*exc))


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _NullStream:
    """Stands in for torch.cuda.Stream / Event: every method is a no-op (CPU ops are synchronous)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _CPU

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return _noop

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_NullStream":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


def _cpu_get_rng_state(device: Any = "cuda", *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Megatron's clip_grad_by_total_norm_fp32 minus its torch.cuda.FloatTensor assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.detach().mul_(clip_coeff)


def _make_noop(name: str) -> Callable[..., None]:
    # One distinct function per patched name: torch._dynamo's trace rules reject one function
    # object registered under several torch names.
    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    noop.__name__ = f"cpu_shim_{name}"
    return noop


def _patch_torch_cuda() -> None:
    import torch._dynamo  # noqa: F401  (build dynamo's torch-name rule table before we patch)

    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.synchronize = _make_noop("synchronize")
    cuda.empty_cache = _make_noop("empty_cache")
    cuda.set_device = _make_noop("set_device")
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    # torch.manual_seed itself calls torch.cuda.manual_seed_all, so seed the CPU generator
    # directly (going through torch.manual_seed would recurse).
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = _make_noop("set_stream")
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0


def _backward_in_device_mode(function_cls: type) -> None:
    """Run ``function_cls.backward`` (a torch.autograd.Function) inside :class:`cpu_device_mode`.

    torch function modes are not active inside autograd's backward (the engine does not carry
    the Python mode stack), yet Megatron's activation recomputation (``CheckpointFunction``)
    reruns layer forward code there, which builds e.g. the causal mask with a literal
    ``device="cuda"``. Autograd looks the backward up on the class at call time, so replacing it
    reaches every checkpoint.
    """
    original = function_cls.backward
    if getattr(original, "_cpu_shim", False):
        return

    def backward(ctx: Any, *grads: Any) -> Any:
        with cpu_device_mode():
            return original(ctx, *grads)

    backward._cpu_shim = True  # type: ignore[attr-defined]
    function_cls.backward = staticmethod(backward)


def _patch_megatron() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    # parallel.recompute_granularity 'full' and 'selective' (core_attn) both checkpoint through
    # CheckpointFunction; the output-discarding variant serves only MoE / layernorm recompute.
    _backward_in_device_mode(mcore_random.CheckpointFunction)
    clip_grads.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    # optimizer.py binds the function at import time, so patch its reference too.
    from megatron.core.optimizer import optimizer as mcore_optimizer

    if hasattr(mcore_optimizer, "clip_grad_by_total_norm_fp32"):
        mcore_optimizer.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32


def apply_cpu_shim() -> bool:
    """Patch torch.cuda and Megatron-Core for CPU execution; returns True if the shim is active.

    Idempotent and thread-safe; does nothing (returns False) when a GPU is present.
    """
    global _APPLIED
    if not shim_needed():
        return False
    with _LOCK:
        if not _APPLIED:
            _patch_torch_cuda()
            _patch_megatron()
            _APPLIED = True
    return True


class SequenceParallelTorchNorm:
    """The local spec's torch RMSNorm with its weight tagged for Megatron's TP gradient all-reduce.

    Built by Megatron's ``build_module(spec, config=..., hidden_size=..., eps=...)`` like
    ``WrappedTorchNorm``; returns a plain ``torch.nn.RMSNorm`` (same parameters and state dict
    keys), so checkpoints and weight conversion are unchanged. CPU-only by construction: refused
    when a GPU is visible (there TE's norms handle sequence parallelism).
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> torch.nn.Module:
        if not shim_needed():
            raise RuntimeError("SequenceParallelTorchNorm is the CPU shim's norm; on GPUs use Transformer Engine's")
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelTorchNorm builds RMSNorm only, got {config.normalization!r}")
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        for param in norm.parameters():
            # The tag finalize_model_grads looks for (see the module docstring).
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def with_cpu_device_mode(fn: _F) -> _F:
    """Decorator for methods that run Megatron code: enters :class:`cpu_device_mode` per call."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with cpu_device_mode():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
