"""Parts about trainer memory: ``trainer.offload_during_rollout`` (what leaves the GPU, and the
next step unchanged) and the planner's memory estimate (``megatron_rl/planning/memory.py``)
against the CUDA allocator's figures for the same model, layout and microbatch.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl.distributed.ports import free_port
from tests.gpu.check.common import (
    Context,
    gib,
    identical,
    make_samples,
    make_worker,
    memory_allocated,
    outcome,
    policy_loss,
    prepare_process,
    release,
    timed,
    weights_of,
    worker_config,
)

STATIC_RATIO_TOLERANCE = 0.05
"""Weights, gradients and optimizer state are exact byte counts: measured / estimated within 5 %."""


def offload(ctx: Context) -> dict[str, Any]:
    """Offload after step 1, reload, offload and reload again, step 2: step 2's weights and loss
    are bit-identical to a worker that never offloaded (the first cycle's timing includes
    allocating pinned host memory, the second's does not). On the GPU the allocated memory drops by at least 95 % of what
    the offload reports moving (grad buffers, optimizer state, weights) and comes back to within
    1 %. Plain and distributed optimizer (GPU only) each."""
    prepare_process(ctx, deterministic=True)
    from megatron_rl.training.memory_offload import grad_accumulator_ids, grad_buffer_bytes

    s = ctx.sizes
    model_dir = ctx.require_model()
    first = make_samples(s.model, s.train_seqs, s.prompt_tokens, s.response_tokens, seed=4)
    second = make_samples(s.model, s.train_seqs, s.prompt_tokens, s.response_tokens, seed=5)
    port = free_port()
    variants = [False, True] if ctx.gpu else [False]
    figures: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    for dist in variants:
        label = "distributed optimizer" if dist else "plain"
        cfg = worker_config(ctx, dtype=s.train_dtype, micro_batch_tokens=s.micro_batch_tokens,
                            distributed_optimizer=dist)
        loss = policy_loss(cfg)
        ref = make_worker(ctx, cfg, model_dir, port)
        ref.train_step(first, loss)
        ref_metrics = ref.train_step(second, loss)
        ref_weights = weights_of(ref)
        ref.shutdown(destroy_world=False)
        del ref
        release(ctx)
        w = make_worker(ctx, cfg, model_dir, port)
        w.train_step(first, loss)
        accumulators = grad_accumulator_ids(w.model)
        before = memory_allocated(ctx)
        moved, off_s = timed(ctx, w.offload_for_rollout)
        after = memory_allocated(ctx)
        grads_left = grad_buffer_bytes(w.model)
        back, on_s = timed(ctx, w.reload_for_training)
        reloaded = memory_allocated(ctx)
        # A second cycle: the first allocates the pinned host memory (torch's caching host
        # allocator keeps it), the second reuses it, as every offload after a run's first does.
        _, off2_s = timed(ctx, w.offload_for_rollout)
        _, on2_s = timed(ctx, w.reload_for_training)
        kept_accumulators = grad_accumulator_ids(w.model) == accumulators
        metrics = w.train_step(second, loss)
        same = identical(weights_of(w), ref_weights) and metrics["loss"] == ref_metrics["loss"]
        w.shutdown(destroy_world=dist == variants[-1])
        del w, ref_weights
        release(ctx)
        host = moved["optimizer_to_host"] + moved["weights_to_host"]
        fig = {"moved": moved, "reloaded": back, "allocated_before_gib": gib(before),
               "allocated_offloaded_gib": gib(after), "allocated_reloaded_gib": gib(reloaded),
               "offload_s": off_s, "reload_s": on_s, "host_gb_per_s": 2 * host / 1e9 / max(off_s + on_s, 1e-9),
               "second_offload_s": off2_s, "second_reload_s": on2_s,
               "grad_buffer_bytes_left": grads_left, "next_step_identical": same,
               "grad_accumulators_kept": kept_accumulators}
        figures[label] = fig
        checks[f"{label}: next step identical"] = same
        checks[f"{label}: grad accumulators kept"] = kept_accumulators
        checks[f"{label}: grad buffers freed"] = grads_left == 0 and moved["grad_buffers_freed"] > 0
        if ctx.gpu:
            checks[f"{label}: memory freed"] = before - after >= 0.95 * sum(moved.values())
            checks[f"{label}: memory back"] = abs(reloaded - before) <= 0.01 * before
    parts = []
    for label, f in figures.items():
        moved = sum(f["moved"].values())
        size = f"{gib(moved):.2f} GiB" if moved >= 2 ** 30 / 10 else f"{moved / 2 ** 20:.1f} MiB"
        mem = (f"allocated {f['allocated_before_gib']:.2f} -> {f['allocated_offloaded_gib']:.2f} -> "
               f"{f['allocated_reloaded_gib']:.2f} GiB, " if ctx.gpu else "")
        parts.append(f"{label}: {mem}moved {size} in {f['offload_s']:.2f}+{f['reload_s']:.2f} s "
                     f"(again: {f['second_offload_s']:.2f}+{f['second_reload_s']:.2f} s), "
                     f"next step {'identical' if f['next_step_identical'] else 'DIFFERS'}")
    if not ctx.gpu:
        parts.append("CPU: only the grad buffers are freed; no allocator figures")
    return outcome(checks, "; ".join(parts), figures)


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _optimizer_bytes(worker: Any) -> int:
    """Bytes of optimizer-owned tensors: fp32 master copies that are not the model's own
    storage, and Adam's state (the same walk memory_offload makes)."""
    model_storages = {p.untyped_storage().data_ptr() for p in worker.model.parameters()}
    tensors = []
    for opt in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            tensors += [p for p in group["params"] if p.untyped_storage().data_ptr() not in model_storages]
        for state in inner.state.values():
            tensors += [v for k, v in state.items() if torch.is_tensor(v) and k != "step"]
    return _unique_bytes(tensors)


def _measure(ctx: Context, recompute: str, port: int, last: bool) -> dict[str, float]:
    """Resident bytes by kind after a first step, then the second step's memory: at the output
    layer's input (decoder activations stored), at the loss (plus logits and cross entropy) and
    the peak, each above the resident state."""
    from megatron_rl.training.memory_offload import grad_buffer_bytes
    from megatron_rl.training.weights_io import _unwrap

    s = ctx.sizes
    cfg = worker_config(ctx, dtype=s.train_dtype, micro_batch_tokens=s.mem_seqs * s.mem_seq_len, recompute=recompute)
    batch = make_samples(s.model, s.mem_seqs, s.mem_seq_len // 4, s.mem_seq_len - s.mem_seq_len // 4, seed=8)
    w = make_worker(ctx, cfg, ctx.require_model(), port)
    loss = policy_loss(cfg)
    w.train_step(batch, loss)  # creates Adam's state
    release(ctx)
    out = {"weights": float(_unique_bytes(w.model.parameters())), "gradients": float(grad_buffer_bytes(w.model)),
           "optimizer": float(_optimizer_bytes(w))}
    if ctx.gpu:
        marks: dict[str, int] = {}
        resident = torch.cuda.memory_allocated()
        head = _unwrap(w.model).output_layer

        def mark_head(*_: Any) -> None:  # a pre-hook's return value would replace the layer's input
            marks.setdefault("head", torch.cuda.memory_allocated())

        hook = head.register_forward_pre_hook(mark_head)

        def marking_loss(*args, **kwargs):
            marks.setdefault("loss", torch.cuda.memory_allocated())
            return loss(*args, **kwargs)

        torch.cuda.reset_peak_memory_stats()
        w.train_step(batch, marking_loss)
        hook.remove()
        out.update({"resident_allocated": float(resident), "activations": float(marks["head"] - resident),
                    "logits": float(marks["loss"] - marks["head"]),
                    "step_peak": float(torch.cuda.max_memory_allocated() - resident)})
    w.shutdown(destroy_world=last)
    release(ctx)
    return out


def memory_estimator(ctx: Context) -> dict[str, Any]:
    """The planner's per-GPU estimate (estimate_memory, bf16 on the GPU) against measured bytes
    for parallel.recompute_granularity none / selective / full, one microbatch of
    micro_batch_tokens: weights, gradients, optimizer (exact tensor byte counts, within 5 %),
    and, on the GPU, activations and logits (allocator figures; reported as ratios, not judged:
    the local layer spec stores the s^2 attention probabilities the estimate leaves out)."""
    prepare_process(ctx, deterministic=False)
    from megatron_rl.planning.architectures import resolve_shape
    from megatron_rl.planning.memory import GIB, GPUS, estimate_memory

    s = ctx.sizes
    shape = resolve_shape(str(ctx.require_model()))
    port = free_port()
    granularities = ("none", "selective", "full") if ctx.gpu else ("none",)
    figures: dict[str, Any] = {"shape": shape.name, "dtype": s.train_dtype,
                               "micro_batch_tokens": s.mem_seqs * s.mem_seq_len}
    checks: dict[str, bool] = {}
    for i, granularity in enumerate(granularities):
        cfg = worker_config(ctx, dtype=s.train_dtype, micro_batch_tokens=s.mem_seqs * s.mem_seq_len,
                            recompute=granularity)
        est = estimate_memory(cfg, shape, GPUS["h200"]).trainer
        measured = _measure(ctx, granularity, port, last=i == len(granularities) - 1)
        kinds = ["weights", "gradients", "optimizer"] + (["activations", "logits"] if ctx.gpu else [])
        ratios = {k: measured[k] / (est[k] * GIB) for k in kinds}
        row = {"estimated_gib": {k: est[k] for k in kinds}, "measured_gib": {k: gib(measured[k]) for k in kinds},
               "ratio": ratios}
        if ctx.gpu:
            a = shape.arch
            # The local spec's unfused attention keeps the bf16 softmax output [b, heads, s, s] of
            # every layer for backward (unless core attention is recomputed).
            s2 = 0 if granularity != "none" else s.mem_seqs * a.num_heads * s.mem_seq_len ** 2 * 2 * a.num_layers
            row["local_spec_s2_gib"] = gib(s2)
            row["activations_ratio_with_s2"] = measured["activations"] / (est["activations"] * GIB + s2)
            row["step_peak_over_resident_gib"] = gib(measured["step_peak"])
            row["step_peak_ratio"] = measured["step_peak"] / ((est["activations"] + est["logits"]) * GIB)
        figures[granularity] = row
        for k in ("weights", "gradients", "optimizer"):
            checks[f"{granularity}: {k}"] = abs(ratios[k] - 1.0) <= STATIC_RATIO_TOLERANCE
    base = figures["none"]["ratio"]
    text = "measured/estimated: " + ", ".join(f"{k} {base[k]:.2f}" for k in ("weights", "gradients", "optimizer"))
    if ctx.gpu:
        text += "; activations " + ", ".join(
            f"{g} {figures[g]['ratio']['activations']:.2f}" for g in granularities)
        text += (f" (none with the local spec's s^2 term: {figures['none']['activations_ratio_with_s2']:.2f}); "
                 f"logits {base['logits']:.2f}; step peak / (activations + logits) "
                 f"{figures['none']['step_peak_ratio']:.2f}")
    else:
        text += "; activations n/a on CPU (no allocator statistics)"
    return outcome(checks, text, figures)
