"""Parts that drive the Megatron worker directly (no Ray): the model set-up, process groups,
bf16 against fp32, Transformer Engine, activation recompute, the distributed optimizer.

Each part returns ``{"status", "summary", "figures"}``; ``status`` is 'pass' only when every
check listed in its docstring held.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron_rl.distributed.ports import free_port
from tests.gpu.check.common import (
    Context,
    SkipPart,
    build_random_qwen2,
    check_shim,
    grads_of,
    identical,
    make_samples,
    make_worker,
    outcome,
    policy_loss,
    prepare_process,
    rel_error,
    release,
    weights_of,
    worker_config,
)

FP32_LOGPROB_MAX_ABS = 1e-3
"""Megatron fp32 vs transformers fp32 logprobs on the same device (CPU tests reach 1e-5)."""
FP32_GRAD_REL_MAX = 1e-3
"""Megatron fp32 vs transformers fp32 gradient, ||diff|| / ||ref|| over all tensors."""
LOW_PRECISION_GRAD_REL_MAX = 0.1
"""bf16 vs fp32 gradient; bf16 keeps 8 mantissa bits, a wrong mapping or scale gives ~1."""


def linear_loss(logprobs, old_logprobs, advantages, mask, *, ref_logprobs=None, engine_logprobs=None,
                seq_ids=None, num_tokens_total: int, num_seqs_total: int):
    """-A * log p per response token over the batch's token count: the policy gradient at ratio 1,
    simple enough to recompute with transformers (see :func:`hf_reference`)."""
    loss = (-(advantages * logprobs) * mask).sum() / num_tokens_total
    return loss, {"loss": loss}


def hf_reference(ctx: Context, model_dir: Path, samples: list) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """transformers' fp32 logprobs and :func:`linear_loss` gradient (HF names) on ``ctx.device``,
    one sequence at a time."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(ctx.device)
    total = sum(len(s.response_ids) for s in samples)
    logprobs = []
    for s in samples:
        ids = torch.tensor([s.prompt.token_ids + s.response_ids], device=ctx.device)
        n_p = len(s.prompt.token_ids)
        logits = model(input_ids=ids).logits[0].float()
        targets = torch.tensor(s.response_ids, device=ctx.device)[:, None]
        lp = torch.log_softmax(logits[n_p - 1:-1], -1).gather(-1, targets)[:, 0]
        (-(s.advantage * lp).sum() / total).backward()
        logprobs.append(lp.detach().cpu().tolist())
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    del model
    release(ctx)
    return logprobs, grads


def _max_abs(a: list[list[float]], b: list[list[float]]) -> float:
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b) if x)


# ----------------------------------------------------------------------------- parts
def model_setup(ctx: Context) -> dict[str, Any]:
    """Writes the random model of this mode's size and the tiny model (process-group and
    checkpoint checks) into the work directory."""
    prepare_process(ctx, deterministic=False)
    main = build_random_qwen2(ctx.model_dir, ctx.sizes.model, ctx.device, seed=0)
    tiny = build_random_qwen2(ctx.tiny_dir, "tiny", ctx.device, seed=1)
    return {"status": "pass", "summary": f"{main['shape']}: {main['params'] / 1e6:.1f}M params (bf16 safetensors); "
            f"tiny {tiny['params'] / 1e3:.0f}k", "figures": {"model": main, "tiny": tiny}}


def nccl_groups(ctx: Context) -> dict[str, Any]:
    """nccl (gloo on CPU) world and Megatron's groups: an all-reduce and a broadcast on every
    group, all_gather_object; then the tiny model's logprobs through Megatron on this device
    against transformers, and the HF export (gather_object over the backend) equal to the file."""
    prepare_process(ctx, deterministic=False)
    from megatron.core import parallel_state as ps

    worker = make_worker(ctx, worker_config(ctx, dtype="float32", micro_batch_tokens=4096), ctx.tiny_dir, free_port())
    backend = torch.distributed.get_backend()
    groups = {"world": torch.distributed.group.WORLD, "tp": ps.get_tensor_model_parallel_group(),
              "pp": ps.get_pipeline_model_parallel_group(), "dp": ps.get_data_parallel_group(),
              "model_parallel": ps.get_model_parallel_group(), "embedding": ps.get_embedding_group(),
              "dp_with_cp": ps.get_data_parallel_group(with_context_parallel=True)}
    collectives = {}
    for name, group in groups.items():
        size = torch.distributed.get_world_size(group)
        t = torch.full((1024,), 3.0, device=ctx.device)
        torch.distributed.all_reduce(t, group=group)
        b = torch.arange(8.0, device=ctx.device)
        torch.distributed.broadcast(b, src=torch.distributed.get_global_rank(group, 0), group=group)
        collectives[name] = bool(torch.all(t == 3.0 * size)) and bool(torch.equal(b.cpu(), torch.arange(8.0)))
    gathered: list = [None]
    torch.distributed.all_gather_object(gathered, {"rank": 0})
    samples = make_samples("tiny", 6, 9, 13, seed=5)
    got = worker.compute_logprobs(samples)
    exported = worker.export_hf_state_dict()
    check_shim(ctx)
    worker.shutdown()
    expected, _ = hf_reference(ctx, ctx.tiny_dir, samples)
    from safetensors.torch import load_file

    on_disk = load_file(str(ctx.tiny_dir / "model.safetensors"))
    export_equal = set(on_disk) <= set(exported) and all(
        torch.equal(exported[k], v.float()) for k, v in on_disk.items())
    diff = _max_abs(got, expected)
    want = "nccl" if ctx.gpu else "gloo"
    checks = {f"backend {want}": backend == want, "collectives": all(collectives.values()),
              "all_gather_object": gathered == [{"rank": 0}],
              "logprobs vs transformers": diff < FP32_LOGPROB_MAX_ABS, "HF export equals the file": export_equal}
    return outcome(checks, f"{backend}, {len(groups)} groups ok, logprob |diff| vs HF {diff:.1e}, "
                    f"export {'=' if export_equal else '!='} file",
                    {"backend": backend, "collectives": collectives, "logprob_max_abs_vs_hf": diff})


def _low_precision_vs_fp32(ctx: Context, impl: str) -> dict[str, Any]:
    """One train step in fp32 (Megatron, local spec) and in ``sizes.train_dtype`` (``impl`` spec)
    from the same weights and batch, plus transformers fp32 as the independent reference."""
    s = ctx.sizes
    model_dir = ctx.require_model()
    samples = make_samples(s.model, s.train_seqs, s.prompt_tokens, s.response_tokens, seed=1)
    port = free_port()
    w = make_worker(ctx, worker_config(ctx, dtype="float32", micro_batch_tokens=s.micro_batch_tokens), model_dir, port)
    lp32 = w.compute_logprobs(samples)
    m32 = w.train_step(samples, linear_loss)
    g32 = grads_of(w)
    hf_named = w.export_hf_grads()
    w.shutdown(destroy_world=False)
    del w
    release(ctx)
    hf_lp, hf_grads = hf_reference(ctx, model_dir, samples)
    fp32_vs_hf = rel_error(hf_named, hf_grads)  # computed on the reference's device
    del hf_grads, hf_named
    w = make_worker(ctx, worker_config(ctx, dtype=s.train_dtype, micro_batch_tokens=s.micro_batch_tokens, impl=impl),
                    model_dir, port)
    lp_low = w.compute_logprobs(samples)
    m_low = w.train_step(samples, linear_loss)
    low_vs_32 = rel_error(grads_of(w), g32)
    check_shim(ctx)
    w.shutdown()
    figures = {"dtype": s.train_dtype, "impl": impl, "tokens": sum(x.num_tokens for x in samples),
               "fp32_logprob_max_abs_vs_hf": _max_abs(lp32, hf_lp), "fp32_grad_vs_hf": fp32_vs_hf,
               "low_logprob_max_abs_vs_fp32": _max_abs(lp_low, lp32), "low_grad_vs_fp32": low_vs_32,
               "loss_fp32": m32["loss"], "loss_low": m_low["loss"]}
    checks = {"fp32 logprobs vs HF": figures["fp32_logprob_max_abs_vs_hf"] < FP32_LOGPROB_MAX_ABS,
              "fp32 grad vs HF": fp32_vs_hf["rel"] < FP32_GRAD_REL_MAX,
              f"{s.train_dtype} grad vs fp32": low_vs_32["rel"] < LOW_PRECISION_GRAD_REL_MAX}
    summary = (f"{s.train_dtype} ({impl}) vs fp32: grad rel err {low_vs_32['rel']:.2e} (worst tensor "
               f"{low_vs_32['worst_rel']:.2e}), logprob |diff| {figures['low_logprob_max_abs_vs_fp32']:.2e}; "
               f"fp32 vs HF: grad {fp32_vs_hf['rel']:.1e}, logprob {figures['fp32_logprob_max_abs_vs_hf']:.1e}")
    if not ctx.gpu:
        summary += " (CPU: float32 both, Megatron's Float16Optimizer needs CUDA params)"
    return outcome(checks, summary, figures)


def bf16_train_step(ctx: Context) -> dict[str, Any]:
    """bf16 train step (local spec, Float16Module + fp32 main grads) against fp32 on the same
    device: relative gradient error below 0.1; fp32 Megatron against transformers fp32."""
    prepare_process(ctx, deterministic=False)
    return _low_precision_vs_fp32(ctx, "local")


def transformer_engine(ctx: Context) -> dict[str, Any]:
    """The Transformer Engine layer spec in bf16 against fp32 local, when TE is importable."""
    if not ctx.gpu:
        raise SkipPart("Transformer Engine needs a GPU")
    try:
        import transformer_engine  # noqa: F401
    except Exception as exc:  # not installed, or its CUDA libraries do not load
        raise SkipPart(f"transformer_engine not importable here ({type(exc).__name__}); its wheel "
                       "(transformer-engine-cu13 2.20.2, 276.5 MB) cannot travel within the 64 MiB limit") from None
    prepare_process(ctx, deterministic=False)
    return _low_precision_vs_fp32(ctx, "transformer_engine")


def recompute(ctx: Context) -> dict[str, Any]:
    """parallel.recompute_granularity full and selective give the gradient of no recompute:
    bit-identical, or no further from it than a repeat of the no-recompute step is."""
    prepare_process(ctx, deterministic=True)
    s = ctx.sizes
    model_dir = ctx.require_model()
    samples = make_samples(s.model, s.train_seqs, s.prompt_tokens, s.response_tokens, seed=2)
    port = free_port()
    results: dict[str, Any] = {}
    base = None
    runs = ("none", "none (repeat)", "full", "selective")
    for i, label in enumerate(runs):
        cfg = worker_config(ctx, dtype=s.train_dtype, micro_batch_tokens=s.micro_batch_tokens,
                            recompute=label.split()[0])
        w = make_worker(ctx, cfg, model_dir, port)
        metrics = w.train_step(samples, policy_loss(cfg))
        grads = grads_of(w)
        if i == len(runs) - 1:
            check_shim(ctx)
        w.shutdown(destroy_world=i == len(runs) - 1)
        del w
        if base is None:
            base = (grads, metrics["loss"])
            continue
        err = rel_error(grads, base[0])
        results[label] = {"bit_identical": identical(grads, base[0]), "max_abs": err["max_abs"], "rel": err["rel"],
                          "loss_equal": metrics["loss"] == base[1]}
        del grads
        release(ctx)
    floor = results["none (repeat)"]["max_abs"]
    checks = {g: results[g]["bit_identical"] or results[g]["max_abs"] <= floor for g in ("full", "selective")}
    text = ", ".join(f"{g} " + ("bit-identical" if r["bit_identical"] else f"max |diff| {r['max_abs']:.1e}")
                     for g, r in results.items())
    return outcome(checks, f"{s.train_dtype} grads vs no recompute: {text}", {"dtype": s.train_dtype, **results})


def distributed_optimizer(ctx: Context) -> dict[str, Any]:
    """parallel.use_distributed_optimizer on a world of one: the same gradient and (within bf16
    rounding) the same update as the plain optimizer; its checkpoint (save_parameter_state /
    load_parameter_state) restores weights and optimizer state exactly (tiny model)."""
    if not ctx.gpu:
        raise SkipPart("Megatron's distributed optimizer accepts only torch.cuda parameters")
    prepare_process(ctx, deterministic=True)
    s = ctx.sizes
    model_dir = ctx.require_model()
    samples = make_samples(s.model, s.train_seqs, s.prompt_tokens, s.response_tokens, seed=3)
    port = free_port()
    out = {}
    for dist in (False, True):
        cfg = worker_config(ctx, dtype=s.train_dtype, micro_batch_tokens=s.micro_batch_tokens,
                            distributed_optimizer=dist)
        w = make_worker(ctx, cfg, model_dir, port)
        before = weights_of(w) if not dist else None
        metrics = w.train_step(samples, policy_loss(cfg))
        out[dist] = {"grads": grads_of(w), "weights": weights_of(w), "metrics": metrics, "before": before}
        w.shutdown(destroy_world=False)
        del w
        release(ctx)
    plain, dist = out[False], out[True]
    grad_err = rel_error(dist["grads"], plain["grads"])
    update = {k: plain["weights"][k] - plain["before"][k] for k in plain["weights"]}
    gap = {k: dist["weights"][k] - plain["weights"][k] for k in plain["weights"]}
    update_norm = sum(float(v.norm()) ** 2 for v in update.values()) ** 0.5
    gap_norm = sum(float(v.norm()) ** 2 for v in gap.values()) ** 0.5
    del out, plain, dist, update, gap
    release(ctx)
    ckpt = _checkpoint_round_trip(ctx, port)
    check_shim(ctx)
    from megatron_rl.distributed.process_groups import destroy_process_groups

    destroy_process_groups()
    figures = {"grad_vs_plain": grad_err, "update_gap_rel": gap_norm / (update_norm + 1e-30), "checkpoint": ckpt}
    checks = {"same gradient": grad_err["rel"] <= 1e-6, "same update": figures["update_gap_rel"] < 1e-2,
              "checkpoint restores weights": ckpt["restored_equal"],
              "step after restore repeats the step after save": ckpt["next_step_equal"]}
    return outcome(checks, f"grad rel diff vs plain {grad_err['rel']:.1e}, update gap {figures['update_gap_rel']:.1e} "
                    f"of the update; checkpoint round trip {'exact' if ckpt['next_step_equal'] else 'differs'}",
                   figures)


def _checkpoint_round_trip(ctx: Context, port: int) -> dict[str, bool]:
    """Distributed optimizer on the tiny model: step, save, step (A), load, step (B); A == B."""
    cfg = worker_config(ctx, dtype=ctx.sizes.train_dtype, micro_batch_tokens=4096, distributed_optimizer=True)
    w = make_worker(ctx, cfg, ctx.tiny_dir, port)
    first, second = make_samples("tiny", 6, 9, 13, seed=6), make_samples("tiny", 6, 9, 13, seed=7)
    loss = policy_loss(cfg)
    w.train_step(first, loss)
    with tempfile.TemporaryDirectory() as directory:
        w.save_checkpoint(directory)
        saved = weights_of(w)
        w.train_step(second, loss)
        after_a = weights_of(w)
        w.load_checkpoint(directory)
        restored = weights_of(w)
        w.train_step(second, loss)
        after_b = weights_of(w)
    w.shutdown(destroy_world=False)
    return {"restored_equal": identical(restored, saved), "next_step_equal": identical(after_a, after_b),
            "step_changed_weights": not identical(after_a, saved)}

