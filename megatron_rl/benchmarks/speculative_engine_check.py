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
load hits both alike. ``--plain-engine`` adds a third arm, ``plain``: the same requests, undrafted,
on a second engine started without speculation, i.e. what a configured-but-idle drafter costs a
plain decode step (vLLM routes every step of a speculative engine through its spec path; drafts
off on a speculative engine vs plain). ``--torch-compile`` starts the engines with
``rollout.cpu_torch_compile=true`` (vLLM's compiled sampler helpers). Each engine's first
seeded, logprob-returning call is timed (``first call``: where a compile would show). Prints, per shape and arm, the median [range] of wall time, decode steps,
generated tokens, ms per generated token and ms per decode step, and the acceptance; last line
``drafts on / off, time per generated token: wide X.XX, narrow Y.YY`` (below 1: drafts pay).
Writes ``<out>/speculative_engine_check.json``.

    megatron-rl-benchmark speculative_engine_check --model artifacts/tiny-qwen2.5-rechecks
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from megatron_rl.runtime.aio import wait_for
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
    ap.add_argument("--plain-engine", action="store_true",
                    help="also run the shapes undrafted on an engine without speculation (arm 'plain')")
    ap.add_argument("--torch-compile", action="store_true", help="rollout.cpu_torch_compile=true for the engines")
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


def _engine(args, out: Path, method: str, name: str):
    from megatron_rl.config.schema import RolloutConfig, SpeculativeConfig
    from megatron_rl.rollout.actor.vllm_engine import VLLMEngine

    cfg = RolloutConfig(max_num_seqs=max(128, args.wide_prompts * args.wide_responses), cpu_kv_cache_gib=0.5,
                        cpu_threads=args.engine_threads, cpu_torch_compile=args.torch_compile,
                        speculative=SpeculativeConfig(method=method, num_speculative_tokens=args.draft_tokens,
                                                      step_draft_budget=args.step_budget))
    return VLLMEngine(args.model, cfg, seed=0, max_model_len=1024, runtime_dir=out / f"rt_{name}")


def run_check(args) -> dict:
    from megatron_rl.rollout.engine import GenerationRequest

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loop = asyncio.new_event_loop()
    engines = {"spec": _engine(args, out, args.method, "spec")}
    arms_of = {"spec": ("off", "on")}
    if args.plain_engine:
        engines["plain"] = _engine(args, out, "off", "plain")
        arms_of["plain"] = ("plain",)
    arm_names = [a for arms in arms_of.values() for a in arms]
    results: dict[str, dict[str, list[dict]]] = {s: {a: [] for a in arm_names} for s in ("wide", "narrow")}
    identical: dict[str, bool] = {}
    first_call: dict[str, float] = {}
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        wide = _prompts(tokenizer, args.wide_prompts, 0)
        narrow = _prompts(tokenizer, args.narrow_prompts, 500)
        for name, engine in engines.items():  # the first seeded, logprob-returning call of each engine
            _, first_call[name] = loop.run_until_complete(_generate(engine, [GenerationRequest(
                f"first-{name}", wide[0], max_tokens=4, seed=0, temperature=1.0)]))
        # The narrow prompts' history (earlier responses, undrafted) for the drafter's references.
        history, _ = loop.run_until_complete(_generate(engines["spec"], _requests(
            "hist", narrow, args.references, args.narrow_tokens, args.temperature, False, {}, 7)))
        references = {p: [list(history[f"hist-p{p}-r{r}"].token_ids) for r in range(args.references)]
                      for p in range(len(narrow))}
        shapes = {"wide": (wide, args.wide_responses, args.wide_tokens, args.temperature, {}),
                  "narrow": (narrow, args.narrow_responses, args.narrow_tokens, args.narrow_temperature, references)}
        for rep in range(args.repeats):
            for shape, (prompts, responses, tokens, temperature, refs) in shapes.items():
                outputs = {}
                for arm in (arm_names if rep % 2 == 0 else arm_names[::-1]):
                    engine = engines["plain" if arm == "plain" else "spec"]
                    reqs = _requests(f"{shape}-{arm}-{rep}", prompts, responses, tokens, temperature, arm == "on",
                                     refs, 100 * rep)
                    figures, got = loop.run_until_complete(_measure(engine, reqs))
                    outputs[arm] = [list(got[r.request_id].token_ids) for r in reqs]
                    results[shape][arm].append(figures)
                    print(f"[spec-check] {shape} {arm:5s} repeat {rep}: {figures['seconds']:.1f} s, "
                          f"{figures['decode_steps']} steps, {figures['tokens']} tokens, "
                          f"{figures['ms_per_token']:.2f} ms/token", flush=True)
                if temperature == 0.0:  # greedy: lossless speculation gives the very same tokens
                    same = all(outputs[a] == outputs["off"] for a in arm_names)
                    identical[shape] = identical.get(shape, True) and same
                    if not same:
                        print(f"[spec-check] {shape} repeat {rep}: greedy responses differ between arms", flush=True)
    finally:
        for engine in engines.values():
            loop.run_until_complete(wait_for(engine.shutdown(), timeout=120))
        loop.close()
    summary = {"args": vars(args), "runs": results, "ratio_ms_per_token": {}, "greedy_identical": identical,
               "first_call_s": first_call}
    for shape, arms in results.items():
        summary["ratio_ms_per_token"][shape] = (statistics.median(r["ms_per_token"] for r in arms["on"])
                                                / statistics.median(r["ms_per_token"] for r in arms["off"]))
    if args.plain_engine:
        summary["ratio_off_vs_plain"] = {shape: statistics.median(r["ms_per_token"] for r in arms["off"])
                                         / statistics.median(r["ms_per_token"] for r in arms["plain"])
                                         for shape, arms in results.items()}
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
                         f"{_cell([r['ms_per_token'] for r in runs], '.2f')} | {_cell([r['ms_per_step'] for r in runs], '.1f')} | "
                         f"{acceptance} |")
    for shape, same in summary.get("greedy_identical", {}).items():
        lines.append(f"{shape}: greedy responses with drafts {'identical to' if same else 'DIFFERENT from'} those without")
    for name, seconds in summary.get("first_call_s", {}).items():
        lines.append(f"first call ({name} engine): {seconds:.2f} s")
    for shape, ratio in summary.get("ratio_off_vs_plain", {}).items():
        lines.append(f"undrafted steps on the speculative engine / plain engine, time per token: {shape} {ratio:.2f}")
    ratio = summary["ratio_ms_per_token"]
    lines.append(f"drafts on / off, time per generated token: wide {ratio['wide']:.2f}, narrow {ratio['narrow']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    print(report(run_check(parse_args(argv))))


if __name__ == "__main__":
    main()
