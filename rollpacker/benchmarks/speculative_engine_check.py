"""Where speculative decoding pays on this machine: one real vLLM engine, drafts off vs on.

Why ``rollout.speculative.rounds`` defaults to ``long``: a short round is a *wide* batch (many
prompts x responses, over-provisioned and aborted), a long round a *narrow* one (few sequences
decoding for a long time). Verifying drafts costs a step more compute per sequence; whether the
steps it saves are worth it depends on whether a decode step is compute-bound (wide batches, and
everything on a small CPU) or memory-bound (narrow batches on a GPU).

One engine with ``rollout.speculative.method`` (default ``suffix``) serves both arms of each
shape; requests carry drafts or not (``GenerationRequest.speculate``), so both arms run the same
weights, kernels and cache. Shapes:

* ``wide``: ``--wide-prompts`` x ``--wide-responses`` sampled responses of ``--wide-tokens`` at
  most, siblings in one draft group per prompt, no earlier responses (a short round);
* ``narrow``: ``--narrow-prompts`` x ``--narrow-responses`` of ``--narrow-tokens`` at most, with
  ``--references`` earlier responses of each prompt as the drafter's references (a long round
  with rollout history; the references are sampled at ``--temperature`` by a first, undrafted
  pass of the same prompts). Decoded at ``--narrow-temperature`` (default 0, greedy): then both
  arms generate exactly the same tokens (speculation is lossless), so their times compare the
  same work; sampled, a few sequences' lengths vary more between repeats than drafts change.

The arms alternate (off, on, on, off, ...) over ``--repeats`` so that a drift in the machine's
load hits both alike. Prints, per shape and arm, the median [range] of wall time, decode steps,
generated tokens, ms per generated token and ms per decode step, and the acceptance; last line
``drafts on / off, time per generated token: wide X.XX, narrow Y.YY`` (below 1: drafts pay).
Writes ``<out>/speculative_engine_check.json``.

    rollpacker-speculative-engine-check --model artifacts/tiny-qwen2.5-rechecks
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from megatron_rl.tools import REPO_ROOT as REPO


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "artifacts/tiny-qwen2.5-rechecks"))
    ap.add_argument("--out", default=str(REPO / "runs/speculative_engine_check"))
    ap.add_argument("--method", default="suffix", help="rollout.speculative.method of the engine")
    ap.add_argument("--draft-tokens", type=int, default=4, help="rollout.speculative.num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=2, help="runs per shape and arm")
    ap.add_argument("--wide-prompts", type=int, default=20)
    ap.add_argument("--wide-responses", type=int, default=5)
    ap.add_argument("--wide-tokens", type=int, default=96)
    ap.add_argument("--narrow-prompts", type=int, default=16)
    ap.add_argument("--narrow-responses", type=int, default=1)
    ap.add_argument("--narrow-tokens", type=int, default=320)
    ap.add_argument("--references", type=int, default=4, help="earlier responses per prompt (narrow shape)")
    ap.add_argument("--temperature", type=float, default=1.0, help="of the wide shape and the references")
    ap.add_argument("--narrow-temperature", type=float, default=0.0)
    ap.add_argument("--engine-threads", type=int, default=1,
                    help="rollout.cpu_threads of the engine (1: what the loop's engine gets from its Ray actor)")
    ap.add_argument("--step-budget", type=int, default=0, help="rollout.speculative.step_draft_budget")
    args = ap.parse_args(argv)
    for key in ("repeats", "wide_prompts", "wide_responses", "wide_tokens", "narrow_prompts", "narrow_responses",
                "narrow_tokens", "draft_tokens", "engine_threads"):
        if getattr(args, key) <= 0:
            ap.error(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no HF checkpoint there (make it with megatron-rl-make-tiny-model)")
    return args


async def _generate(engine, requests) -> tuple[dict, float]:
    """Completions of ``requests`` by id, and the wall time from the first submit to the last one."""
    from megatron_rl.rollout.engine import generate_all

    start = time.perf_counter()
    got = await generate_all(engine, requests)
    return got, time.perf_counter() - start


def _requests(tag: str, prompts: list[list[int]], responses: int, max_tokens: int, temperature: float,
              speculate: bool, references: dict[int, list[list[int]]], seed0: int) -> list:
    from megatron_rl.rollout.engine import GenerationRequest

    return [GenerationRequest(f"{tag}-p{p}-r{r}", ids, max_tokens=max_tokens, seed=seed0 + 1000 * p + r,
                              temperature=temperature, speculate=speculate, draft_group=f"{tag}-p{p}",
                              draft_references=references.get(p, []))
            for p, ids in enumerate(prompts) for r in range(responses)]


async def _measure(engine, requests) -> tuple[dict, dict]:
    before = await engine.stats()
    got, seconds = await _generate(engine, requests)
    after = await engine.stats()
    steps = after.decode_steps - before.decode_steps
    drafted, accepted = after.draft_tokens - before.draft_tokens, after.accepted_tokens - before.accepted_tokens
    tokens = sum(len(c.token_ids) for c in got.values())
    figures = {"seconds": seconds, "decode_steps": steps, "tokens": tokens, "ms_per_token": 1e3 * seconds / max(tokens, 1),
               "ms_per_step": 1e3 * seconds / max(steps, 1), "draft_tokens": drafted, "accepted_tokens": accepted}
    return figures, got


def _prompts(tokenizer, n: int, offset: int) -> list[list[int]]:
    from megatron_rl.data.arithmetic import make_problem
    from megatron_rl.data.datasets import apply_chat_template

    return [apply_chat_template(tokenizer, make_problem(offset + i).question) for i in range(n)]


def run_check(args) -> dict:
    from megatron_rl.config import RolloutConfig, SpeculativeConfig
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = RolloutConfig(max_num_seqs=max(128, args.wide_prompts * args.wide_responses), cpu_kv_cache_gib=0.5,
                        cpu_threads=args.engine_threads,
                        speculative=SpeculativeConfig(method=args.method, num_speculative_tokens=args.draft_tokens,
                                                      step_draft_budget=args.step_budget))
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(args.model, cfg, seed=0, max_model_len=1024, runtime_dir=out / "rt")
    results: dict[str, dict[str, list[dict]]] = {"wide": {"off": [], "on": []}, "narrow": {"off": [], "on": []}}
    identical: dict[str, bool] = {}
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        wide = _prompts(tokenizer, args.wide_prompts, 0)
        narrow = _prompts(tokenizer, args.narrow_prompts, 500)
        # Warm-up (first seeded, logprob-returning calls are slow), and the narrow prompts' history.
        history, _ = loop.run_until_complete(_generate(engine, _requests(
            "hist", narrow, args.references, args.narrow_tokens, args.temperature, False, {}, 7)))
        references = {p: [list(history[f"hist-p{p}-r{r}"].token_ids) for r in range(args.references)]
                      for p in range(len(narrow))}
        shapes = {"wide": (wide, args.wide_responses, args.wide_tokens, args.temperature, {}),
                  "narrow": (narrow, args.narrow_responses, args.narrow_tokens, args.narrow_temperature, references)}
        for rep in range(args.repeats):
            for shape, (prompts, responses, tokens, temperature, refs) in shapes.items():
                outputs = {}
                for arm in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                    reqs = _requests(f"{shape}-{arm}-{rep}", prompts, responses, tokens, temperature, arm == "on",
                                     refs, 100 * rep)
                    figures, got = loop.run_until_complete(_measure(engine, reqs))
                    outputs[arm] = [list(got[r.request_id].token_ids) for r in reqs]
                    results[shape][arm].append(figures)
                    print(f"[spec-check] {shape} drafts {arm:3s} repeat {rep}: {figures['seconds']:.1f} s, "
                          f"{figures['decode_steps']} steps, {figures['tokens']} tokens, "
                          f"{figures['ms_per_token']:.1f} ms/token", flush=True)
                if temperature == 0.0:  # greedy: lossless speculation gives the very same tokens
                    same = outputs["on"] == outputs["off"]
                    identical[shape] = identical.get(shape, True) and same
                    if not same:
                        print(f"[spec-check] {shape} repeat {rep}: greedy responses differ with drafts on", flush=True)
    finally:
        loop.run_until_complete(asyncio.wait_for(engine.shutdown(), timeout=120))
        loop.close()
    summary = {"args": vars(args), "runs": results, "ratio_ms_per_token": {}, "greedy_identical": identical}
    for shape, arms in results.items():
        summary["ratio_ms_per_token"][shape] = (statistics.median(r["ms_per_token"] for r in arms["on"])
                                                / statistics.median(r["ms_per_token"] for r in arms["off"]))
    (out / "speculative_engine_check.json").write_text(json.dumps(summary, indent=2))
    return summary


def _cell(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def report(summary: dict) -> str:
    lines = ["| shape | drafts | wall s | decode steps | tokens | ms / token | ms / step | acceptance |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for shape, arms in summary["runs"].items():
        for arm, runs in arms.items():
            drafted = sum(r["draft_tokens"] for r in runs)
            acceptance = f"{sum(r['accepted_tokens'] for r in runs) / drafted:.2f}" if drafted else "-"
            lines.append(f"| {shape} | {arm} | {_cell([r['seconds'] for r in runs], '.1f')} | "
                         f"{_cell([r['decode_steps'] for r in runs], '.0f')} | {_cell([r['tokens'] for r in runs], '.0f')} | "
                         f"{_cell([r['ms_per_token'] for r in runs], '.1f')} | {_cell([r['ms_per_step'] for r in runs], '.0f')} | "
                         f"{acceptance} |")
    for shape, same in summary.get("greedy_identical", {}).items():
        lines.append(f"{shape}: greedy responses with drafts {'identical to' if same else 'DIFFERENT from'} those without")
    ratio = summary["ratio_ms_per_token"]
    lines.append(f"drafts on / off, time per generated token: wide {ratio['wide']:.2f}, narrow {ratio['narrow']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    print(report(run_check(parse_args(argv))))


if __name__ == "__main__":
    main()
