"""Speed figures in the form the simulator reads: decode cost per iteration against batch size
(transformers with a static KV cache, fitted to ``step_s + per_seq_s * B + per_ctx_token_s * C``
by ``rollpacker.simulator.engine_model.fit_decode_constants``, written as the JSON that
``rollpacker-simulate --engine-constants`` loads), and Megatron training throughput (tokens/s,
MFU; ``--train-s-per-token`` / ``--train-fixed-s`` / ``--mfu``). ``simulator_calibration``
then runs ``rollpacker-simulate`` on the files written here.

The decode figures are transformers' eager forward (and, on the GPU, the same forward replayed as
a CUDA graph, as vLLM runs it), not vLLM itself: vLLM cannot travel to the GPU machine.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import torch

from megatron_rl.distributed.ports import free_port
from tests.gpu.check.common import (
    Context,
    SkipPart,
    make_samples,
    make_worker,
    outcome,
    policy_loss,
    prepare_process,
    release,
    sync,
    worker_config,
)
from tests.gpu.check.harness import REPO

ENGINE_FILE = "engine_constants.json"
GRAPH_FILE = "engine_constants_graph.json"
TRAIN_FILE = "train_calibration.json"
H200_GB_PER_S = 4800.0  # datasheet HBM3e bandwidth; the planner's GpuSpec('h200') has the same


def _prompts(ctx: Context, vocab: int, batch: int, prompt: int) -> torch.Tensor:
    """The same random prompts for every run of a (batch, prompt), in either process."""
    g = torch.Generator().manual_seed(7919 * batch + prompt)
    return torch.randint(0, min(vocab, 151643), (batch, prompt), generator=g).to(ctx.device)


def _decode_run(ctx: Context, model: Any, batch: int, prompt: int, steps: int, graph: bool,
                keep_logits: bool = False) -> dict[str, Any]:
    """Prefill ``batch`` prompts of ``prompt`` tokens into a static KV cache, then time ``steps``
    greedy decode iterations: eager forwards, or one captured CUDA graph replayed (what vLLM
    does). ``keep_logits``: also return the first sequence's logits of every timed step."""
    from transformers import StaticCache

    warm = 3
    cache = StaticCache(config=model.config, max_cache_len=prompt + warm + steps + 1)
    ids = _prompts(ctx, model.config.vocab_size, batch, prompt)
    sync(ctx)
    start = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(ctx)
    prefill_s = time.perf_counter() - start
    logits = []
    if graph:
        static_in = nxt.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream (kernel selection, workspaces)
            for _ in range(warm - 1):
                step_logits = model(input_ids=static_in, past_key_values=cache, use_cache=True).logits
                static_in.copy_(step_logits[:, -1].argmax(-1, keepdim=True))
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # recorded, not run: the cache does not advance here
            static_out = model(input_ids=static_in, past_key_values=cache, use_cache=True).logits
        g.replay()  # the last warm-up iteration
        static_in.copy_(static_out[:, -1].argmax(-1, keepdim=True))
        sync(ctx)
        start = time.perf_counter()
        for _ in range(steps):
            g.replay()
            static_in.copy_(static_out[:, -1].argmax(-1, keepdim=True))
            if keep_logits:
                logits.append(static_out[0, -1].float().clone())
        sync(ctx)
        del g
    else:
        for _ in range(warm):
            nxt = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        sync(ctx)
        start = time.perf_counter()
        for _ in range(steps):
            step_logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
            nxt = step_logits[:, -1].argmax(-1, keepdim=True)
            if keep_logits:
                logits.append(step_logits[0, -1].float().clone())
        sync(ctx)
    step_s = (time.perf_counter() - start) / steps
    out = {"batch": batch, "prompt": prompt, "prefill_s": prefill_s, "step_s": step_s,
           # mean context of the timed iterations, all sequences together
           "ctx_tokens": batch * (prompt + warm + (steps - 1) / 2)}
    if keep_logits:
        out["logits"] = logits
    return out


def _fit(runs: list[dict[str, Any]]) -> dict[str, float]:
    from rollpacker.simulator.engine_model import fit_decode_constants

    step_s, per_seq_s, per_ctx_s = fit_decode_constants([(r["batch"], r["ctx_tokens"], r["step_s"]) for r in runs])
    pts = [(r["batch"] * r["prompt"], r["prefill_s"]) for r in runs]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    var = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / var if var else my / max(mx, 1.0)
    pred = [step_s + per_seq_s * r["batch"] + per_ctx_s * r["ctx_tokens"] for r in runs]
    worst = max(abs(p - r["step_s"]) / r["step_s"] for p, r in zip(pred, runs))
    return {"step_s": step_s, "per_seq_s": per_seq_s, "per_ctx_token_s": per_ctx_s,
            "prefill_token_s": max(slope, 0.0), "fit_worst_rel_error": worst}


def _load_decode_model(ctx: Context) -> Any:
    from transformers import Qwen2ForCausalLM

    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    return Qwen2ForCausalLM.from_pretrained(str(ctx.require_model()), dtype=dtype).to(ctx.device).eval()


def _sweep(ctx: Context, model: Any, graph: bool) -> list[dict[str, Any]]:
    s = ctx.sizes
    runs = []
    with torch.no_grad():
        for prompt in s.decode_prompts:
            for batch in s.decode_batches:
                runs.append(_decode_run(ctx, model, batch, prompt, s.decode_steps, graph=graph))
                release(ctx)
    return runs


def _write_constants(ctx: Context, fit: dict[str, float], name: str) -> dict[str, Any]:
    """EngineModel JSON of ``fit`` for the measured model; loaded back as the simulator loads it."""
    from megatron_rl.planning.architectures import resolve_shape
    from rollpacker.simulator.engine_model import EngineModel

    shape = resolve_shape(str(ctx.model_dir))
    weights_bytes = shape.total_params * (2 if ctx.gpu else 4)
    # KV capacity of a vLLM pool of 0.9 of this device, after the weights and a 2 GiB reserve.
    capacity = torch.cuda.get_device_properties(0).total_memory if ctx.gpu else 8 * 2 ** 30
    kv_tokens = int(max(0.0, 0.9 * capacity - weights_bytes - 2 * 2 ** 30) / shape.kv_bytes_per_token)
    constants = {k: fit[k] for k in ("step_s", "per_seq_s", "per_ctx_token_s", "prefill_token_s")}
    constants.update({"kv_capacity_tokens": kv_tokens, "max_num_seqs": max(ctx.sizes.decode_batches), "tp": 1,
                      "gpus": 1})
    path = ctx.workdir / name
    path.write_text(json.dumps(constants, indent=2) + "\n")
    EngineModel.from_json(path)
    out = {"engine_constants": constants, "file": str(path)}
    if ctx.gpu:  # weight bytes read per fixed iteration cost, against the datasheet bandwidth
        out["hbm_efficiency"] = weights_bytes / fit["step_s"] / 1e9 / H200_GB_PER_S if fit["step_s"] else 0.0
    return out


def _describe(ctx: Context, label: str, runs: list[dict[str, Any]], fit: dict[str, float]) -> str:
    prompt = ctx.sizes.decode_prompts[0]
    curve = ", ".join(f"B{r['batch']} {r['step_s'] * 1e3:.2f}" for r in runs if r["prompt"] == prompt)
    return (f"{label} ms/iteration at prompt {prompt}: {curve}; fit {fit['step_s'] * 1e3:.2f} ms + "
            f"{fit['per_seq_s'] * 1e6:.2f} us/seq + {fit['per_ctx_token_s'] * 1e9:.3f} ns/ctx token "
            f"(worst fit error {fit['fit_worst_rel_error']:.0%})")


def decode(ctx: Context) -> dict[str, Any]:
    """transformers' eager decode iteration time for every (batch, prompt) of the mode's sizes,
    the linear fit, and ``engine_constants.json`` (EngineModel fields) in the work directory."""
    prepare_process(ctx, deterministic=False)
    model = _load_decode_model(ctx)
    runs = _sweep(ctx, model, graph=False)
    fit = _fit(runs)
    figures = {"fit": fit, "runs": runs, **_write_constants(ctx, fit, ENGINE_FILE)}
    checks = {"timings positive": all(r["step_s"] > 0 for r in runs)}
    return outcome(checks, _describe(ctx, "eager", runs, fit), figures)


def decode_cuda_graph(ctx: Context) -> dict[str, Any]:
    """The same sweep with each decode iteration captured once as a CUDA graph and replayed (how
    vLLM decodes): first its logits against eager ones on the same prompts (max |diff| below 2 %
    of the largest logit, bf16), then ``engine_constants_graph.json``, which simulator_calibration
    prefers."""
    prepare_process(ctx, deterministic=False)
    model = _load_decode_model(ctx)
    prompt = ctx.sizes.decode_prompts[0]
    with torch.no_grad():
        probe = [_decode_run(ctx, model, 4, prompt, 8, graph=False, keep_logits=True)["logits"]]
        try:
            probe.append(_decode_run(ctx, model, 4, prompt, 8, graph=True, keep_logits=True)["logits"])
        except RuntimeError as exc:  # a host sync inside transformers' forward makes capture fail
            raise SkipPart(f"transformers' decode step cannot be captured: {str(exc).splitlines()[0][:200]}") from None
    scale = max(float(a.abs().max()) for a in probe[0])
    diff = max(float((a - b).abs().max()) for a, b in zip(*probe)) / max(scale, 1e-30)
    if diff >= 0.02:
        return outcome({"graph logits match eager": False}, f"graph logits differ from eager by {diff:.3g} of "
                       "the largest", {"logits_max_abs_vs_eager": diff})
    runs = _sweep(ctx, model, graph=True)
    fit = _fit(runs)
    figures = {"logits_max_abs_vs_eager": diff, "fit": fit, "runs": runs, **_write_constants(ctx, fit, GRAPH_FILE)}
    checks = {"graph logits match eager": True, "timings positive": all(r["step_s"] > 0 for r in runs)}
    summary = _describe(ctx, "graph", runs, fit) + f"; logits vs eager {diff:.1e} (relative)"
    return outcome(checks, summary, figures)


def train_throughput(ctx: Context) -> dict[str, Any]:
    """Megatron training throughput (train step + the old-logprob forward, as the simulator's
    training time counts it) at two batch sizes: tokens/s, the fixed + per-token fit, MFU
    against the H200's 989 TFLOP/s bf16 datasheet peak (the simulator's FLOP model: 6 P per token
    plus causal attention); ``train_calibration.json`` in the work directory."""
    prepare_process(ctx, deterministic=False)
    from megatron_rl.planning.architectures import resolve_shape
    from megatron_rl.planning.memory import GPUS
    from rollpacker.simulator.costs import TrainModel

    s = ctx.sizes
    cfg = worker_config(ctx, dtype=s.train_dtype, micro_batch_tokens=s.throughput_micro_batch_tokens)
    w = make_worker(ctx, cfg, ctx.require_model(), free_port())
    loss = policy_loss(cfg)
    shape = resolve_shape(str(ctx.model_dir))
    points = []
    for n in s.throughput_seqs:
        batch = make_samples(s.model, n, s.throughput_seq_len // 8, s.throughput_seq_len - s.throughput_seq_len // 8,
                             seed=10 + n)
        w.compute_logprobs(batch)
        w.train_step(batch, loss)  # warm-up (allocations, kernel selection)
        times = []
        for _ in range(s.throughput_steps):
            sync(ctx)
            start = time.perf_counter()
            w.compute_logprobs(batch)
            logprob_s = time.perf_counter() - start
            w.train_step(batch, loss)
            sync(ctx)
            times.append((time.perf_counter() - start, logprob_s))
        total, logprob = sorted(times)[len(times) // 2]
        tokens = n * s.throughput_seq_len
        points.append({"seqs": n, "tokens": tokens, "step_s": total, "logprob_s": logprob,
                       "tokens_per_s": tokens / total})
    w.shutdown()
    (a, b) = points[0], points[-1]
    per_token = (b["step_s"] - a["step_s"]) / (b["tokens"] - a["tokens"])
    fixed = a["step_s"] - per_token * a["tokens"]
    figures: dict[str, Any] = {"model": shape.name, "dtype": s.train_dtype, "points": points,
                               "train_s_per_token": per_token, "train_fixed_s": fixed}
    if ctx.gpu:
        ideal = TrainModel(shape.total_params, shape.arch.num_layers, shape.arch.hidden_size, 1,
                           GPUS["h200"].bf16_tflops * 1e12, mfu=1.0, fixed_s=0.0, sync_s=0.0)
        figures["mfu"] = [ideal.time([s.throughput_seq_len] * p["seqs"]) / p["step_s"] for p in points]
    keys = ("train_s_per_token", "train_fixed_s") + (("mfu",) if ctx.gpu else ())
    (ctx.workdir / TRAIN_FILE).write_text(json.dumps({k: figures[k] for k in keys}, indent=2) + "\n")
    mfu = f", MFU {figures['mfu'][-1]:.1%}" if ctx.gpu else " (MFU n/a on CPU)"
    summary = (f"{s.train_dtype} {points[-1]['tokens']} tokens/step: {points[-1]['tokens_per_s']:,.0f} tokens/s "
               f"(train+logprobs){mfu}; fit {per_token * 1e6:.2f} us/token + {fixed:+.3f} s")
    checks = {"throughput positive": all(p["tokens_per_s"] > 0 for p in points)}
    if ctx.gpu:  # on a shared CPU box the two timings can come out in either order
        checks["more tokens take longer (per-token fit > 0)"] = per_token > 0
    return outcome(checks, summary, figures)


def _simulate(args: list[str]) -> tuple[int, str]:
    # From the repository root, like the parts themselves (see harness.REPO): no install needed.
    proc = subprocess.run([sys.executable, "-m", "rollpacker.benchmarks.simulate", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def simulator_calibration(ctx: Context) -> dict[str, Any]:
    """rollpacker-simulate with the measured figures: the measured engine constants and training
    fit on a recipe whose model is the one measured (``model.hf_path`` set to it), and, on the
    GPU, the measured MFU and decode HBM efficiency on the 7B recipe (``--gpu h200``)."""
    graph, train = ctx.workdir / GRAPH_FILE, ctx.workdir / TRAIN_FILE
    engine = graph if graph.is_file() else ctx.workdir / ENGINE_FILE
    if not engine.is_file() or not train.is_file():
        raise SkipPart("needs decode and train_throughput's files")
    cal = json.loads(train.read_text())
    runs = {"measured constants": [
        "--recipe", "examples/qwen2.5/qwen2.5_7b_math_2x8_tp2_rtp1.yaml", f"model.hf_path={ctx.model_dir}",
        "--steps", "10", "--engine-constants", str(engine), "--train-s-per-token", f"{max(cal['train_s_per_token'], 1e-9):.6g}",
        "--train-fixed-s", f"{max(cal['train_fixed_s'], 0.0):.6g}"]}
    if ctx.gpu:
        source = "decode_cuda_graph" if engine == graph else "decode"
        eff = json.loads((ctx.workdir / "results" / f"{source}.json").read_text())["figures"].get("hbm_efficiency", 0.7)
        runs["measured efficiencies"] = ["--recipe", "examples/qwen2.5/qwen2.5_7b_math_2x8_tp2_rtp1.yaml", "--gpu",
                                         "h200", "--steps", "10", "--mfu", f"{cal['mfu'][-1]:.4f}",
                                         "--hbm-efficiency", f"{min(max(eff, 0.05), 1.0):.4f}"]
    figures: dict[str, Any] = {"engine_constants": engine.name}
    checks = {}
    for name, args in runs.items():
        rc, out = _simulate(args)
        speedup = [line for line in out.splitlines() if line.startswith("speedup:")]
        figures[name] = {"args": args, "rc": rc, "speedup": speedup[-1] if speedup else "", "tail": out[-600:]}
        checks[name] = rc == 0 and bool(speedup)
    summary = "; ".join(f"{n}: " + (f["speedup"] or f"rc {f['rc']}") for n, f in figures.items() if n in runs)
    return outcome(checks, f"simulate.py ({engine.name}) " + summary, figures)

