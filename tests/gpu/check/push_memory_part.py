"""The push moment's peak memory at the check's model shape (Qwen2.5-0.5B on the GPU).

The real ``WeightSync.push`` and ``Colocation`` (``megatron_rl/rollout/weight_sync/sync.py``,
``megatron_rl/training/colocation.py``) make the moves in their order: the trainer's grad buffers
freed, the engine's weights woken, the push, the trainer offloaded, the KV cache woken. The trainer
is a real Megatron worker after a train step; the engine and the push's staging (no vLLM on the lent
machine) are plain device tensors of the bytes the planner counts for them (``estimate_memory``'s
engine weights and pool, ``moments.push_staging_gib``). vLLM's sleep mode frees a tag's memory and
``wake_up(tags)`` allocates it again (``vllm/v1/worker/gpu_worker.py``); the stand-in does the same.

The allocator's peak (``torch.cuda.max_memory_allocated``, reserved too) over each moment is compared
with the planner's moment (``plan_moments``) less its per-process overhead, which the allocator does
not see, and with the earlier order (weights and KV cache woken while the trainer, grad buffers
included, is resident; ``push_order='all_at_once'``). CPU mode: tiny sizes; the order of the calls
and the rows are checked, memory figures are not meaningful there (no allocator statistics).
"""
from __future__ import annotations

import asyncio
from typing import Any

import torch

from megatron_rl.distributed.ports import free_port
from tests.gpu.check import common
from tests.gpu.check.common import Context, gib

GPU_MEMORY_UTILIZATION = 0.3
"""rollout.gpu_memory_utilization of the stand-in engine: its pool (about 42 GiB of the planner's H200)
fits an H100 as well, with the trainer resident beside it in the earlier order."""
CPU_ENGINE_CAP_BYTES = 8 << 20
"""CPU mode: each stand-in engine tensor is capped here (the planner sizes them for a GPU)."""
ABOVE_TOLERANCE = 0.10
"""Measured peak at most 10 % above the planner's moment less overhead: the planner leaves out
cuBLAS workspaces (allocated through torch's allocator), the RoPE table, the DDP buckets' padding,
the allocator's block rounding and what the last step left cached in small blocks."""
BELOW_TOLERANCE = 0.05
"""At most 5 % below: the trainer's weights and optimizer state are exact byte counts (the
memory_estimator part holds them to 5 %) and the engine side is allocated at the planner's figures."""
EXPECTED_ORDER = ["trainer.free_grads", "engine.wake_up(weights)", "push.load", "trainer.offload",
                  "engine.wake_up(kv_cache)"]


class _Tracker:
    """Peak allocated / reserved bytes per moment: :meth:`mark` ends one moment and starts the next."""

    def __init__(self, ctx: Context) -> None:
        self.gpu = ctx.gpu
        self.peaks: dict[str, dict[str, float]] = {}
        self.start()

    def start(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def mark(self, name: str) -> None:
        if self.gpu:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            self.peaks[name] = {"allocated_gib": gib(torch.cuda.max_memory_allocated()),
                                "reserved_gib": gib(torch.cuda.max_memory_reserved()), "device_used_gib": gib(total - free)}
        else:
            self.peaks[name] = {"allocated_gib": 0.0, "reserved_gib": 0.0, "device_used_gib": 0.0}
        self.start()


class _Policy:
    """``Colocation``'s MovablePolicy over one MegatronWorker (Colocation logs the moves); the
    offload ends the push moment."""

    def __init__(self, worker: Any, tracker: _Tracker) -> None:
        self.worker, self.tracker = worker, tracker

    async def free_grad_buffers(self) -> dict:
        freed = self.worker.free_grad_buffers()
        self.tracker.mark("grads freed")  # the push moment starts without them (its start is not its peak)
        return freed

    async def offload_for_rollout(self) -> dict:
        self.tracker.mark("push")
        return self.worker.offload_for_rollout()

    async def reload_for_training(self) -> dict:
        return self.worker.reload_for_training()

    async def set_num_threads(self, n: int) -> None:
        return None


class _Engine:
    """The engine's device memory only: 'weights' and 'kv_cache' tensors that sleep frees and wake_up allocates."""

    tensor_parallel_size = 1

    def __init__(self, sizes: dict[str, int], device: torch.device) -> None:
        self.sizes, self.device = sizes, device
        self.held: dict[str, torch.Tensor] = {}

    async def sleep(self, level: int = 1) -> None:
        self.held.clear()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        for tag in tags or list(self.sizes):
            self.held[tag] = torch.ones(self.sizes[tag], dtype=torch.uint8, device=self.device)  # touched: resident


class _Transport:
    """A tensor push's memory: the trainer's bucket buffers and the engine's receive slots plus the
    largest tensor shard, filled with the trainer's weight bytes while they exist."""

    streams_from_trainer = True
    writes_directory = False
    starts_engines_empty = True

    def __init__(self, worker: Any, staging: dict[str, int], device: torch.device, log: list[str]) -> None:
        self.worker, self.staging, self.device, self.log = worker, staging, device, log
        self.grads_at_load = -1

    async def stage(self, version: int, tp: int) -> dict[str, float]:
        return {}

    async def load(self, engine: _Engine, version: int) -> dict[str, float]:
        from megatron_rl.training.memory_offload import grad_buffer_bytes

        self.log.append("push.load")
        self.grads_at_load = grad_buffer_bytes(self.worker.model)
        buffers = {k: torch.empty(n, dtype=torch.uint8, device=self.device) for k, n in self.staging.items()}
        moved = 0
        for p in self.worker.model.parameters():  # the trainer's weights are the push's source
            flat = p.detach().reshape(-1).view(torch.uint8)
            for buf in buffers.values():
                n = min(flat.numel(), buf.numel())
                buf[:n].copy_(flat[:n])
            moved += flat.numel()
        del buffers
        return {"bytes": float(moved)}


def _sizes(ctx: Context, cfg: Any, shape: Any, est: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Engine tensors and push staging in bytes, as the planner counts them (capped on CPU)."""
    from megatron_rl.planning.memory import GIB
    from megatron_rl.planning.moments import push_staging_gib

    cap = float("inf") if ctx.gpu else CPU_ENGINE_CAP_BYTES
    e = est.engine

    def size(g: float) -> int:
        return int(min(g * GIB, cap))

    engine = {"weights": size(e["weights"]), "kv_cache": size(e["kv cache"] + e["activation reserve"])}
    return engine, {k: size(v) for k, v in push_staging_gib(cfg, shape).items()}


async def _new_order(sync: Any, tracker: _Tracker) -> None:
    tracker.start()
    await sync.push(1)
    tracker.mark("kv woken")


async def _old_order(coloc: Any, engine: _Engine, transport: _Transport, tracker: _Tracker) -> None:
    """The earlier order (moments' 'all_at_once'): every tag woken with the trainer whole, then the push."""
    await coloc.to_training()
    tracker.start()
    await engine.wake_up()
    await transport.load(engine, 2)
    tracker.mark("old: push")  # the offload after it only lowers the memory (and its first one is slow)


def push_memory(ctx: Context) -> dict[str, Any]:
    """Peak memory of the push moment in the new order vs the planner and vs the old order (module docstring)."""
    common.prepare_process(ctx, deterministic=False)
    from megatron_rl.planning.architectures import resolve_shape
    from megatron_rl.planning.memory import GPUS, estimate_memory
    from megatron_rl.planning.moments import plan_moments
    from megatron_rl.rollout.weight_sync.sync import WeightSync
    from megatron_rl.training.colocation import Colocation
    from megatron_rl.training.memory_offload import grad_buffer_bytes

    s = ctx.sizes
    model_dir = ctx.require_model()
    shape = resolve_shape(str(model_dir))
    cfg = common.worker_config(ctx, dtype=s.train_dtype, micro_batch_tokens=s.micro_batch_tokens)
    cfg.trainer.offload_during_rollout = True
    cfg.rollout.sleep_during_train = True
    cfg.rollout.weight_sync_format = "tensor"
    cfg.rollout.tensor_parallel_size = 1
    cfg.rollout.gpu_memory_utilization = GPU_MEMORY_UTILIZATION
    est = estimate_memory(cfg, shape, GPUS["h200"])
    planned = {order: {m.name: m for m in plan_moments(cfg, shape, est, order).moments}
               for order in ("ordered", "all_at_once")}
    engine_bytes, staging_bytes = _sizes(ctx, cfg, shape, est)

    tracker = _Tracker(ctx)
    worker = common.make_worker(ctx, cfg, model_dir, free_port())
    policy = _Policy(worker, tracker)
    engine = _Engine(engine_bytes, ctx.device)
    coloc = Colocation(cfg, policy, engine, on_cpu=not ctx.gpu)
    log = coloc.log  # Colocation's moves, the push's load among them
    transport = _Transport(worker, staging_bytes, ctx.device, log)
    grads_resident: dict[str, int] = {}

    async def step() -> None:
        await coloc.to_training()  # engines asleep, trainer resident (it never left): a step's training side
        worker.train_step(common.make_samples(s.model, s.train_seqs, s.prompt_tokens, s.response_tokens, seed=11),
                          common.policy_loss(cfg))
        grads_resident["after step"] = grad_buffer_bytes(worker.model)
        common.release(ctx)
        del log[:]
        await _new_order(WeightSync(transport, None, engine, coloc), tracker)
        grads_resident["at load"] = transport.grads_at_load
        order = list(log)
        await _old_order(coloc, engine, transport, tracker)
        grads_resident["old order at load"] = transport.grads_at_load
        log[:] = order

    asyncio.run(step())
    worker.shutdown(destroy_world=True)
    common.release(ctx)
    return _row(ctx, est, planned, tracker.peaks, log, grads_resident, engine_bytes, staging_bytes)


def _row(ctx: Context, est: Any, planned: dict[str, dict[str, Any]], peaks: dict[str, dict[str, float]],
         log: list[str], grads: dict[str, int], engine_bytes: dict[str, int], staging: dict[str, int]) -> dict[str, Any]:
    overhead = est.overhead_gib
    new = planned["ordered"]
    plan_gib = {"push": new["push (engine weights woken)"].total_gib - overhead,
                "kv woken": new["push done, KV cache woken"].total_gib - overhead,
                "old: push": planned["all_at_once"]["push (weights + KV woken, trainer resident)"].total_gib - overhead}
    figures: dict[str, Any] = {"order": log, "grad_buffer_bytes": grads, "engine_bytes": engine_bytes,
                               "staging_bytes": staging, "planner_less_overhead_gib": plan_gib,
                               "planner_overhead_gib": overhead, "peaks": peaks,
                               "tolerance": {"above": ABOVE_TOLERANCE, "below": BELOW_TOLERANCE}}
    checks = {"order: grads freed, weights woken, push, trainer offloaded, KV woken": log == EXPECTED_ORDER,
              "grad buffers freed before the push": grads.get("after step", 0) > 0 and grads.get("at load") == 0,
              "old order pushes with the grad buffers resident": grads.get("old order at load", 0) > 0,
              "a row per moment": set(peaks) == {"grads freed", "push", "kv woken", "old: push"}}
    if not ctx.gpu:
        return common.outcome(checks, f"cpu: order {' -> '.join(log)}; memory figures not meaningful on CPU (no allocator "
                       "statistics, engine tensors capped at 8 MiB)", figures)
    measured = {k: peaks[k]["allocated_gib"] for k in plan_gib}
    ratio = {k: measured[k] / plan_gib[k] for k in plan_gib}
    figures["ratio"] = ratio
    new_peak = max(measured["push"], measured["kv woken"])
    checks["new order's peak below the old order's"] = new_peak < measured["old: push"]
    for k in plan_gib:
        checks[f"planner within tolerance: {k}"] = 1 - BELOW_TOLERANCE <= ratio[k] <= 1 + ABOVE_TOLERANCE
        # One process here, the planner's overhead counts two: the device's use at the moment's end stays below.
        checks[f"device used within the planner's moment: {k}"] = peaks[k]["device_used_gib"] <= plan_gib[k] + overhead
    text = (f"push moment peak {measured['push']:.2f} GiB (planner {plan_gib['push']:.2f} + overhead {overhead:.0f}), "
            f"KV woken {measured['kv woken']:.2f} ({plan_gib['kv woken']:.2f}), old order {measured['old: push']:.2f} "
            f"({plan_gib['old: push']:.2f}); reserved push {peaks['push']['reserved_gib']:.2f} GiB")
    return common.outcome(checks, text, figures)
