"""Synchronous reward vs the reward scheduler, side by side, on the real vLLM engine + Ray pool.

    python -m megatron_rl.benchmarks.benchmark_reward [--steps 3] [--prompts 16] [--responses 4] [--workers 2]
                                     [--max-new-tokens 96] [--model DIR] [--autoscale]

One step = generate P x R responses with the real vLLM engine (tiny Qwen2 model on CPU here),
then have every one of them scored by the Ray reward pool, on a math + code mix (half the
prompts each, routed by ``reward.kind='mixed'``):

* **sync**: score all responses after the rollout ends (submit all, wait for all);
* **scheduler**: score each response the moment it finishes (``RewardPool.score``, as the
  rollout loop does), so reward work overlaps generation and the step waits only for its last
  reward.

A random tiny model writes no code or boxed answers, so every response's text is the engine's
tokens followed by a reference answer (``\\boxed{...}`` for math, a fenced solution for code):
reward work is then real (math-verify in its grader process, each code solution run against its
tests in the sandbox, CPU-bound test suites of different sizes), as it would be for a trained
policy. Nothing is slept. Step time = first request submitted -> last reward collected.
Prints both columns, the ratio sync / scheduler, and the scheduler's reward metrics.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from megatron_rl.config.schema import RewardConfig, RolloutConfig
from megatron_rl.rollout.engine import GenerationRequest
from megatron_rl.sample import Prompt, Sample

# Each code problem: count primes below N by trial division (CPU-bound; N sets the test's cost).
_CODE_SOLUTION = ("def count_primes(n):\n    return sum(1 for k in range(2, n) "
                  "if all(k % d for d in range(2, int(k ** 0.5) + 1)))\n")
_CODE_TESTS = "from solution import count_primes\n\ndef test_count():\n    assert count_primes({n}) == {expected}\n"
_SIZES = (2_000, 20_000, 60_000, 120_000)


def _count_primes(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(sieve[i * i::i]))
    return sum(sieve)


def make_prompts(tokenizer, count: int) -> tuple[list[Prompt], dict[str, str]]:
    """Half arithmetic (math reward), half KodCode-style code problems; plus each one's reference
    answer text (appended to responses, see the module docstring)."""
    from megatron_rl.data.arithmetic import make_problems

    prompts, references = [], {}
    maths = make_problems(count - count // 2, seed=0)
    for i, problem in enumerate(maths):
        ids = tokenizer.encode(problem.question, add_special_tokens=False)
        prompts.append(Prompt(f"arith:{i}", ids, problem.answer, problem.question, {"format": "builtin"}))
        references[prompts[-1].prompt_id] = f"\n#### {problem.answer}"
    for i in range(count // 2):
        n = _SIZES[i % len(_SIZES)]
        tests = _CODE_TESTS.format(n=n, expected=_count_primes(n))
        question = f"Write count_primes(n): the number of primes below n (n={n})."
        ids = tokenizer.encode(question, add_special_tokens=False)
        prompts.append(Prompt(f"kod:{i}", ids, tests, question, {"format": "kodcode", "tests": tests}))
        references[prompts[-1].prompt_id] = f"\n```python\n{_CODE_SOLUTION}```"
    return prompts, references


async def run_step(engine, pool, tokenizer, prompts, references, args, step: int,
                   overlapped: bool) -> tuple[float, list[Sample]]:
    """One step; returns its time (first submit -> last reward) and its scored samples."""
    start = time.monotonic()
    samples: dict[str, Sample] = {}
    for prompt in prompts:
        for r in range(args.responses):
            rid = f"{'o' if overlapped else 's'}{step}-{prompt.prompt_id}-{r}"
            samples[rid] = Sample(prompt=prompt, response_index=r, request_id=rid)
            await engine.submit(GenerationRequest(rid, prompt.token_ids, args.max_new_tokens,
                                                  seed=step * 1000 + r, temperature=1.0, return_logprobs=False))
    scoring, finished = [], []
    stream = engine.completions()
    remaining = len(samples)
    while remaining:
        done = await stream.__anext__()
        sample = samples[done.request_id]
        remaining -= 1
        sample.response_ids = list(done.token_ids) + tokenizer.encode(
            references[sample.prompt.prompt_id], add_special_tokens=False)
        sample.finish_reason = done.finish_reason
        sample.timings["finished"] = time.monotonic()
        if overlapped:
            scoring.append(asyncio.ensure_future(pool.score(sample)))
        else:
            finished.append(sample)
    if overlapped:
        await asyncio.gather(*scoring)
    else:
        handles = [pool.submit(s) for s in finished]
        await asyncio.get_running_loop().run_in_executor(None, pool.wait, handles, 600.0)
    elapsed = time.monotonic() - start
    # Every response carries a right answer; one scored wrong hit its (adaptive) timeout, which a
    # loaded machine can cause. Counted and printed, never hidden.
    wrong = sum(s.correct is not True for s in samples.values())
    print(f"  step {step} {'scheduler' if overlapped else 'sync':9s} {elapsed:6.2f} s, {wrong} not correct",
          file=sys.stderr, flush=True)
    return elapsed, list(samples.values())


async def bench(args, engine, pools, tokenizer) -> dict:
    prompts, references = make_prompts(tokenizer, args.prompts)
    results: dict[str, list[float]] = {"sync": [], "scheduler": []}
    metrics: dict[str, float] = {}
    wrong = {"sync": 0, "scheduler": 0}
    # Warm-up step (engine graphs, grader processes) is not timed.
    await run_step(engine, pools["sync"], tokenizer, prompts, references, args, -1, overlapped=False)
    for step in range(args.steps):
        t_sync, sync_samples = await run_step(engine, pools["sync"], tokenizer, prompts, references, args, step, False)
        results["sync"].append(t_sync)
        wrong["sync"] += sum(s.correct is not True for s in sync_samples)
        pools["scheduler"].step_metrics()
        t, samples = await run_step(engine, pools["scheduler"], tokenizer, prompts, references, args, step, True)
        results["scheduler"].append(t)
        wrong["scheduler"] += sum(s.correct is not True for s in samples)
        for k, v in pools["scheduler"].step_metrics(samples).items():
            metrics[k] = metrics.get(k, 0.0) + v / args.steps
    return {"times": results, "scheduler_metrics": metrics, "wrong": wrong}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--model", default="", help="HF model dir (default: a tiny random Qwen2 built in a temp dir)")
    parser.add_argument("--autoscale", action="store_true",
                        help="scheduler pool starts at 1 worker and may grow to --workers")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import ray
    import torch
    from transformers import AutoTokenizer

    from megatron_rl.distributed.ray_start import init_local_ray
    from megatron_rl.reward.pool.reward_pool import RewardPool
    from megatron_rl.rollout.actor.vllm_engine import VLLMEngine

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench-reward-")
    model = args.model
    if not model:
        from megatron_rl.model.tiny import build_tiny_qwen2

        model = str(build_tiny_qwen2(Path(tmp) / "tiny", seed=0))
    tokenizer = AutoTokenizer.from_pretrained(model)
    init_local_ray(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
                   _temp_dir=str(Path(tmp) / "ray"), runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    engine = VLLMEngine(model, RolloutConfig(max_num_seqs=64, cpu_kv_cache_gib=0.25), seed=0,
                        max_model_len=128 + args.max_new_tokens)
    base = dict(kind="mixed", worker_num_cpus=0.25, timeout_s=5.0, code_timeout_max_s=30.0)
    pools = {"sync": RewardPool(RewardConfig(num_workers=args.workers, **base), model, args.max_new_tokens)}
    sched_cfg = (RewardConfig(num_workers=1, min_workers=1, max_workers=args.workers, scale_up_queue_per_worker=2.0,
                              scale_up_wait_s=0.5, **base)
                 if args.autoscale else RewardConfig(num_workers=args.workers, **base))
    pools["scheduler"] = RewardPool(sched_cfg, model, args.max_new_tokens)
    loop = asyncio.new_event_loop()
    try:
        for pool in pools.values():
            pool.ready(timeout_s=300)
        out = loop.run_until_complete(bench(args, engine, pools, tokenizer))
    finally:
        for pool in pools.values():
            pool.shutdown()
        loop.run_until_complete(engine.shutdown())
        loop.close()
        ray.shutdown()
    sync, sched = out["times"]["sync"], out["times"]["scheduler"]
    n = args.prompts * args.responses
    label = f"scheduler{' (autoscale 1..%d)' % args.workers if args.autoscale else ''}"
    print(f"\nreward benchmark: {args.steps} steps x {n} responses ({args.prompts // 2} code + "
          f"{args.prompts - args.prompts // 2} math prompts x {args.responses}), {args.workers} reward workers, "
          f"max_new_tokens={args.max_new_tokens}, real vLLM engine")
    print(f"{'':28s}{'sync reward':>14s}{label:>30s}{'ratio':>10s}")
    print(f"{'step time mean (s)':28s}{statistics.mean(sync):14.2f}{statistics.mean(sched):30.2f}"
          f"{statistics.mean(sync) / statistics.mean(sched):10.2f}")
    print(f"{'step time min (s)':28s}{min(sync):14.2f}{min(sched):30.2f}{min(sync) / min(sched):10.2f}")
    print(f"{'responses not correct':28s}{out['wrong']['sync']:14d}{out['wrong']['scheduler']:30d}"
          "   (timeouts under CPU contention)")
    print("scheduler reward metrics (mean per step):")
    for key, value in sorted(out["scheduler_metrics"].items()):
        print(f"  {key:32s}{value:10.3f}")
    print(f"speedup: {statistics.mean(sync) / statistics.mean(sched):.2f}")


if __name__ == "__main__":
    main()
