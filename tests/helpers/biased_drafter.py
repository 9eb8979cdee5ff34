"""A deliberately wrong speculative sampler, for showing that the distribution test can fail.

Building its drafter inside vLLM's worker (vLLM builds the proposer class named by
``rollout.speculative.method``) replaces the rejection sampler's random-sampling kernel with one
that *accepts every draft token* (it calls vLLM's own kernel with uniform draws of 0, so
``p_target(x) / q(x) >= u`` always holds). Drafts then decide what is sampled: not lossless.
Test use only.
"""
from __future__ import annotations

import torch

from megatron_rl.rollout.worker.spec_drafter import SpecDrafter

KERNEL = "vllm.v1.sample.rejection_sampler.rejection_random_sample_kernel"


def _accept_all(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                bonus_token_ids, recovered_token_ids, uniform_probs, is_greedy, max_spec_len, vocab_size,
                synthetic_conditional_rates=None, NO_DRAFT_PROBS=False, SYNTHETIC_MODE=False):  # noqa: N803
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._rejection_random_sample_kernel_impl(
        output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, bonus_token_ids,
        recovered_token_ids, torch.zeros_like(uniform_probs), is_greedy, max_spec_len, vocab_size,
        synthetic_conditional_rates, NO_DRAFT_PROBS, SYNTHETIC_MODE)


def _install() -> None:
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({KERNEL: _accept_all})


class AcceptAllDrafter(SpecDrafter):
    """The suffix drafter, verified by the accept-everything kernel above."""

    def __init__(self, vllm_config) -> None:
        super().__init__(vllm_config)
        # At build time, not import, as SpecDrafter applies its fix: after vLLM's worker start-up
        # registered the CPU platform's kernels (the config check imports this module elsewhere).
        _install()
