"""Training-time and reward-time models of the simulator.

Training: FLOPs of the step (forward+backward 6*P per token plus causal attention, the
old-logprob forward, the reference forward when KL is on) over the trainer GPUs at an assumed
MFU, stretched by the 1F1B pipeline bubble of the recipe's PP and microbatch count; then the
weight sync to the engines. Measured constants (``s_per_token``) replace the FLOP model, which
is how the CPU benchmark calibrates it.

Reward: per-response scoring time drawn from a log-normal, with a fraction of responses that
hang until the timeout (code); the adaptive timeout of the reward scheduler cuts those at
min(max(T_min, lambda*T_anchor), T_max).
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, replace

from megatron_rl.config.schema import RunConfig
from megatron_rl.planning.architectures import ModelShape
from megatron_rl.planning.memory import GpuSpec
from megatron_rl.planning.weight_sync_cost import SyncAssumptions, sync_seconds

_SYNC = SyncAssumptions()


@dataclass(frozen=True)
class TrainModel:
    """Time of the train phase of one step."""

    params: int
    num_layers: int
    hidden: int
    gpus: int
    peak_flops: float
    mfu: float = 0.4
    pp: int = 1
    dp: int = 1
    micro_batch_tokens: int = 4096
    reference_forward: bool = False
    fixed_s: float = 1.0
    """Optimizer step, logprob pass set-up, metrics: per step."""
    sync_s: float = 3.0
    """Weight sync trainer -> engines (also paid again when the rollout TP changes); from_recipe
    charges the recipe's ``rollout.weight_sync_format`` (``planning.weight_sync_cost``)."""
    s_per_token: float = 0.0
    """Measured seconds per trained token; when > 0 it replaces the FLOP model."""
    recompute: str = "none"
    """parallel.recompute_granularity: 'full' adds one forward per training pass (~4/3 of the
    train FLOPs); 'selective' adds the core-attention forward."""
    offload_s: float = 0.0
    """trainer.offload_during_rollout: optimizer state and weights to host and back, per step."""

    @classmethod
    def from_recipe(cls, cfg: RunConfig, shape: ModelShape, gpu: GpuSpec, mfu: float = 0.4,
                    sync: SyncAssumptions = _SYNC, host_gb_per_s: float = 25.0,
                    sync_format: str | None = None) -> "TrainModel":
        """The recipe's training time model; its weight sync is ``rollout.weight_sync_format``'s
        (or ``sync_format``'s) cost under ``sync``'s link speeds
        (``megatron_rl.planning.weight_sync_cost``)."""
        p = cfg.parallel
        gpus = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size * p.data_parallel_size
        offload_s = 0.0
        if cfg.trainer.offload_during_rollout:
            # Per GPU: bf16 weights of its TP/PP shard + fp32 master and Adam m, v (12 B/param,
            # sharded over DP x CP by the distributed optimizer), out and back over PCIe.
            shard_params = shape.total_params / (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
            optim_shard = p.data_parallel_size * p.context_parallel_size if p.use_distributed_optimizer else 1
            offload_s = 2 * shard_params * (2 + 12 / optim_shard) / (host_gb_per_s * 1e9)
        return cls(shape.total_params, shape.arch.num_layers, shape.arch.hidden_size, gpus, gpu.bf16_tflops * 1e12, mfu,
                   p.pipeline_model_parallel_size, p.data_parallel_size, cfg.optimizer.micro_batch_tokens,
                   cfg.model.use_reference_model or cfg.algorithm.kl_coef > 0,
                   sync_s=sync_seconds(cfg, shape, sync_format, sync)["total"],
                   recompute=p.recompute_granularity, offload_s=offload_s)

    def time(self, seq_tokens: list[int]) -> float:
        """Seconds to train on sequences of these total (prompt + response) lengths."""
        tokens = sum(seq_tokens)
        if self.s_per_token > 0:
            return self.fixed_s + self.s_per_token * tokens
        attn = sum(s * s for s in seq_tokens) * self.num_layers * self.hidden
        fwd = 2 * self.params * tokens + 2 * attn
        train = 3 * fwd + {"full": fwd, "selective": 2 * attn}.get(self.recompute, 0)
        flops = train + fwd * (2 if self.reference_forward else 1)  # train + old (+ ref) logprobs
        micro = max(1, math.ceil(tokens / (self.dp * self.micro_batch_tokens)))
        bubble = (self.pp - 1) / (micro + self.pp - 1)
        return self.fixed_s + self.offload_s + flops / (self.gpus * self.peak_flops * self.mfu) / (1 - bubble)


@dataclass(frozen=True)
class RewardModel:
    """Per-response reward time on one of ``workers`` CPU workers."""

    workers: int
    median_s: float = 0.05
    sigma: float = 0.5
    hang_fraction: float = 0.0
    """Responses that run until the timeout (infinite loops in code)."""
    timeout_s: float = 2.0
    adaptive_min_s: float = 2.0
    adaptive_lambda: float = 1.5

    @classmethod
    def math(cls, workers: int, timeout_s: float = 2.0) -> "RewardModel":
        return cls(workers, 0.05, 0.5, 0.0, timeout_s)

    @classmethod
    def code(cls, workers: int, timeout_s: float = 30.0) -> "RewardModel":
        """Sandbox runs: median 1.5 s, 3 % of responses hang until the timeout."""
        return cls(workers, 1.5, 0.8, 0.03, timeout_s)

    @classmethod
    def judge(cls, workers: int, timeout_s: float = 30.0) -> "RewardModel":
        """LLM-judge calls (a verdict of a few tokens after a ~1k-token prompt on a served judge
        model): median 0.5 s per call, no hangs."""
        return cls(workers, 0.5, 0.5, 0.0, timeout_s)

    def durations(self, n: int, rng: random.Random, adaptive: bool) -> list[float]:
        return [self.one(rng, adaptive) for _ in range(n)]

    def one(self, rng: random.Random, adaptive: bool) -> float:
        """One response's scoring time (the adaptive timeout cuts hangs when ``adaptive``)."""
        anchor = self.median_s * math.exp(1.645 * self.sigma)  # slowest correct run ~ P95
        cap = min(max(self.adaptive_min_s, self.adaptive_lambda * anchor), self.timeout_s) if adaptive else self.timeout_s
        if rng.random() < self.hang_fraction:
            return cap
        return min(cap, self.median_s * math.exp(rng.gauss(0.0, self.sigma)))

    def describe(self) -> str:
        """One line stating the reward model (printed as an assumed input)."""
        return (f"{self.workers} workers, median {self.median_s:g} s, hang fraction {self.hang_fraction:g}, "
                f"timeout {self.timeout_s:g} s")

    def scaled(self, factor: float) -> "RewardModel":
        """Every scoring time (median and timeout) times ``factor`` (the sensitivity of the reward time)."""
        return replace(self, median_s=self.median_s * factor, timeout_s=self.timeout_s * factor,
                       adaptive_min_s=self.adaptive_min_s * factor)

    def completion_time(self, release_times: list[float], durations: list[float]) -> float:
        """When the last of these jobs finishes on the worker pool (FIFO by release time)."""
        free = [0.0] * max(1, self.workers)
        end = 0.0
        for release, d in sorted(zip(release_times, durations)):
            start = max(release, heapq.heappop(free))
            heapq.heappush(free, start + d)
            end = max(end, start + d)
        return end


@dataclass(frozen=True)
class MixedReward:
    """A dataset mix: each response is scored by one of ``parts`` (reward model, share of the
    responses) on one shared pool of ``workers``, as the RL loop's reward.kind 'mixed' routes rows."""

    parts: tuple[tuple[RewardModel, float], ...]
    workers: int

    def __post_init__(self) -> None:
        total = sum(share for _, share in self.parts)
        if not self.parts or any(share < 0 for _, share in self.parts) or abs(total - 1.0) > 1e-6:
            raise ValueError(f"mixed reward: shares must be >= 0 and sum to 1, got {[s for _, s in self.parts]}")

    def durations(self, n: int, rng: random.Random, adaptive: bool) -> list[float]:
        out = []
        for _ in range(n):
            u, acc = rng.random(), 0.0
            for model, share in self.parts:
                acc += share
                if u < acc:
                    break
            out.append(model.one(rng, adaptive))
        return out

    def completion_time(self, release_times: list[float], durations: list[float]) -> float:
        return RewardModel(self.workers).completion_time(release_times, durations)

    def describe(self) -> str:
        return f"{self.workers} workers, mix " + " + ".join(
            f"{share:.0%} (median {m.median_s:g} s, hang {m.hang_fraction:g}, timeout {m.timeout_s:g} s)"
            for m, share in self.parts)

    def scaled(self, factor: float) -> "MixedReward":
        return MixedReward(tuple((m.scaled(factor), share) for m, share in self.parts), self.workers)
