"""Cost model of one rollout engine (a vLLM instance of TP GPUs) for the simulator.

One decode iteration of a continuous batch of B sequences holding C context tokens in total
costs ``step_s + per_seq_s * B + per_ctx_token_s * C``: a fixed part (reading the weight shard,
scheduler and sampler overhead, TP all-reduce latency), a per-sequence part (the matmul FLOPs of
one token) and a per-context-token part (reading the KV cache in attention). Prefill costs
``prefill_token_s`` per token. The KV cache holds ``kv_capacity_tokens``; beyond it the engine
preempts (vLLM V1 recompute preemption).

Constants come from the GPU datasheet and the model shape (:meth:`EngineModel.for_gpu`), from a
JSON file of measured constants (:meth:`EngineModel.from_json`, e.g. the CPU benchmark), or from
a least-squares fit of measured iteration times (:func:`fit_decode_constants`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from megatron_rl.planning.architectures import ModelShape
from megatron_rl.planning.memory import GIB, GpuSpec


@dataclass(frozen=True)
class GpuEfficiency:
    """Achieved fractions of datasheet peaks (assumptions, printed with every simulation)."""

    hbm: float = 0.7
    """Fraction of HBM bandwidth reached by decode (weight and KV reads)."""
    decode_mfu: float = 0.35
    """Matmul efficiency of the small decode GEMMs."""
    prefill_mfu: float = 0.55
    """Matmul efficiency of prefill."""
    tp_efficiency: float = 0.9
    """Throughput kept per TP doubling (all-reduce cost)."""
    step_overhead_s: float = 0.003
    """Scheduler + sampler + kernel launch time of one iteration (CUDA graphs on)."""
    allreduce_latency_s: float = 12e-6
    """Latency of one TP all-reduce (two per layer per iteration)."""


@dataclass(frozen=True)
class EngineModel:
    """Per-engine costs; all times in seconds."""

    step_s: float
    per_seq_s: float
    per_ctx_token_s: float
    prefill_token_s: float
    kv_capacity_tokens: int
    max_num_seqs: int
    tp: int = 1
    gpus: int = 1
    """GPUs of one engine (= TP)."""

    def decode_time(self, batch: int, ctx_tokens: int, iterations: int = 1) -> float:
        """Time of ``iterations`` decode steps starting at ``ctx_tokens`` context; the context
        grows by ``batch`` tokens per step (closed form of the arithmetic series)."""
        k = iterations
        return (k * (self.step_s + self.per_seq_s * batch + self.per_ctx_token_s * ctx_tokens)
                + self.per_ctx_token_s * batch * k * (k - 1) / 2)

    @classmethod
    def for_gpu(cls, shape: ModelShape, gpu: GpuSpec, tp: int, gpu_memory_utilization: float,
                max_num_seqs: int, eff: GpuEfficiency = GpuEfficiency(), activation_reserve_gib: float = 2.0
                ) -> "EngineModel":
        """Roofline-style constants of a TP-``tp`` vLLM engine of ``shape`` on ``gpu``."""
        scale = tp * eff.tp_efficiency ** math.log2(tp)  # effective GPUs after TP communication
        bw = gpu.hbm_gb_per_s * 1e9 * eff.hbm
        weights = shape.total_params * 2
        flops_per_token = 2 * shape.total_params
        allreduce = 0.0 if tp == 1 else 2 * shape.arch.num_layers * eff.allreduce_latency_s
        kv_per_gpu_token = shape.kv_bytes_per_token / min(tp, shape.arch.num_kv_heads)
        pool = gpu_memory_utilization * gpu.memory_gib * GIB
        kv_bytes = pool - weights / tp - activation_reserve_gib * GIB
        return cls(
            step_s=eff.step_overhead_s + allreduce + weights / (bw * scale),
            per_seq_s=flops_per_token / (gpu.bf16_tflops * 1e12 * eff.decode_mfu * scale),
            # Each GPU reads its share of K/V; replicas beyond num_kv_heads do not speed it up.
            per_ctx_token_s=kv_per_gpu_token / (bw * eff.tp_efficiency ** math.log2(tp)),
            prefill_token_s=flops_per_token / (gpu.bf16_tflops * 1e12 * eff.prefill_mfu * scale),
            kv_capacity_tokens=max(0, int(kv_bytes / kv_per_gpu_token)),
            max_num_seqs=max_num_seqs, tp=tp, gpus=tp,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "EngineModel":
        """Measured constants, e.g. ``{"step_s": 0.004, "per_seq_s": 1e-4, "per_ctx_token_s": 2e-8,
        "prefill_token_s": 5e-5, "kv_capacity_tokens": 40000, "max_num_seqs": 64}``."""
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"engine constants {p}: cannot read JSON ({exc})") from None
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        missing = sorted({"step_s", "per_seq_s", "per_ctx_token_s", "prefill_token_s", "kv_capacity_tokens",
                          "max_num_seqs"} - set(raw))
        if unknown or missing:
            raise ValueError(f"engine constants {p}: unknown keys {unknown}, missing keys {missing}")
        return cls(**{k: (int(v) if k in ("kv_capacity_tokens", "max_num_seqs", "tp", "gpus") else float(v))
                      for k, v in raw.items()})

    def with_tp(self, tp: int) -> "EngineModel":
        """The same hardware regrouped into TP=``tp`` engines (measured constants: ideal scaling of
        the fixed and per-sequence parts, KV capacity proportional to GPUs)."""
        ratio = tp / self.tp
        return replace(self, step_s=self.step_s / ratio, per_seq_s=self.per_seq_s / ratio,
                       prefill_token_s=self.prefill_token_s / ratio,
                       kv_capacity_tokens=int(self.kv_capacity_tokens * ratio), tp=tp, gpus=tp)

    def to_dict(self) -> dict:
        return asdict(self)


def fit_decode_constants(samples: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least-squares (step_s, per_seq_s, per_ctx_token_s) from measured decode iterations given as
    (batch size, context tokens, seconds); negative coefficients are clipped to zero."""
    import numpy as np

    if len(samples) < 3:
        raise ValueError(f"need at least 3 measured iterations to fit 3 constants, got {len(samples)}")
    a = np.array([[1.0, b, c] for b, c, _ in samples])
    y = np.array([t for _, _, t in samples])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return tuple(float(max(0.0, x)) for x in coef)  # type: ignore[return-value]
