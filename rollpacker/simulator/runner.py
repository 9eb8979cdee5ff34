"""Build a simulated cluster from a recipe, run policies for many steps, and summarise.

Every policy runs the same number of steps on the same random prompt stream (same seed), so the
comparison isolates the policy. Step time is a wall-clock mean over the steps; bubble fraction is
GPU idle time (engines with nothing left to generate while others finish, plus every GPU while
the step waits for rewards) over GPU time.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from megatron_rl.config.schema import RunConfig
from megatron_rl.planning.architectures import ModelShape
from megatron_rl.planning.memory import GpuSpec
from rollpacker.config import PlannerConfig, StreamConfig
from rollpacker.planner import legal_tp_sizes, planner_for_run
from rollpacker.simulator.costs import MixedReward, RewardModel, TrainModel
from rollpacker.simulator.engine_model import EngineModel, GpuEfficiency
from rollpacker.simulator.lengths import LengthModel
from rollpacker.simulator.policies import Cluster, Features, PolicyState, StepResult, simulate_step

# The paper's cumulative speedups over veRL and sensitivity iteration times (16 nodes x 8 H800,
# vLLM 0.8.4, Megatron 0.12, math+code+QA mix), keyed by model size.
PAPER_CUMULATIVE = {
    "7b": {"tail batching": 1.30, "+ reward scheduler": 2.01, "+ planner": 2.01, "+ stream trainer": 2.03},
    "14b": {"tail batching": 1.48, "+ reward scheduler": 1.99, "+ planner": 2.02, "+ stream trainer": 2.22},
    "32b": {"tail batching": 2.21, "+ reward scheduler": 2.48, "+ planner": 2.52, "+ stream trainer": 2.56},
}
PAPER_ITERATION_S = {"7b": (82.0, 47.0), "14b": (277.0, 88.0), "32b": (673.0, 170.0)}
"""(no tail batching, eta_P = eta_R = 1.25) average iteration seconds."""


@dataclass
class Summary:
    name: str
    steps: list[StepResult]
    total_gpus: int

    @property
    def mean_step_s(self) -> float:
        return sum(s.step_s for s in self.steps) / len(self.steps)

    @property
    def sync_per_step(self) -> float:
        """Mean weight-sync seconds per step (a rollout-TP switch pays one more sync)."""
        return sum(s.sync_s for s in self.steps) / len(self.steps)

    def mean_of(self, round_type: str) -> float | None:
        xs = [s.step_s for s in self.steps if s.round_type == round_type]
        return sum(xs) / len(xs) if xs else None

    @property
    def bubble_fraction(self) -> float:
        idle = sum(s.rollout_idle_gpu_s + s.reward_wait_s * self.total_gpus for s in self.steps)
        return idle / (self.total_gpus * sum(s.step_s for s in self.steps))

    def line(self, baseline: "Summary | None" = None) -> str:
        parts = [f"{self.name:<22} step {self.mean_step_s:8.1f} s", f"bubble {self.bubble_fraction:5.1%}"]
        for kind in ("short", "long"):
            m = self.mean_of(kind)
            if m is not None:
                parts.append(f"{kind} {m:7.1f} s x{sum(s.round_type == kind for s in self.steps)}")
        mean = lambda f: sum(f(s) for s in self.steps) / len(self.steps)  # noqa: E731
        parts.append(f"rollout {mean(lambda s: s.rollout_s):6.1f} reward {mean(lambda s: s.reward_wait_s):5.1f} "
                     f"train {mean(lambda s: s.train_s):6.1f} sync {mean(lambda s: s.sync_s):5.1f} s")
        parts.append(f"preempt/step {mean(lambda s: s.preemptions):6.0f}")
        tps = sorted({s.tp for s in self.steps})
        parts.append("rollout TP " + "/".join(map(str, tps)))
        if baseline is not None:
            parts.append(f"x{baseline.mean_step_s / self.mean_step_s:.2f}")
        return "  ".join(parts)


def build_cluster(cfg: RunConfig, shape: ModelShape, gpu: GpuSpec, lengths: LengthModel, *,
                  engine: EngineModel | None = None, train: TrainModel | None = None,
                  reward: RewardModel | None = None, eff: GpuEfficiency = GpuEfficiency()) -> Cluster:
    """A Cluster of the recipe: GPU-derived engine costs unless measured ``engine`` constants are
    given (then other TP sizes scale them), FLOP-based training unless ``train`` is given."""
    r, c = cfg.rollout, cfg.cluster
    rollout_gpus = r.tensor_parallel_size * r.num_engines
    if engine is None:
        def engine_for_tp(tp: int) -> EngineModel:
            return EngineModel.for_gpu(shape, gpu, tp, r.gpu_memory_utilization, r.max_num_seqs, eff)
    else:
        def engine_for_tp(tp: int) -> EngineModel:
            return engine if tp == engine.tp else engine.with_tp(tp)
    longest = cfg.data.max_prompt_tokens + r.max_new_tokens
    base = engine_for_tp(r.tensor_parallel_size)
    if base.kv_capacity_tokens < longest:
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size}: an engine's KV cache holds "
                         f"{base.kv_capacity_tokens} tokens, less than one {longest}-token sequence "
                         "(see rollpacker-plan-cluster)")
    sizes = planner_tp_sizes(cfg, shape, engine_for_tp)
    planner_for_run(cfg, sizes)  # a bad planner.initial_tp / profile fails here, not mid-simulation
    if reward is None:
        reward = reward_for(cfg)
    train = train or TrainModel.from_recipe(cfg, shape, gpu)
    return Cluster(rollout_gpus, c.gpus_per_node, engine_for_tp, r.tensor_parallel_size, sizes[-1],
                   train, reward, lengths, cfg.data.prompts_per_step,
                   cfg.data.responses_per_prompt, max(rollout_gpus, c.num_nodes * c.gpus_per_node),
                   stream_release_gpus=stream_release_gpus(cfg, train), planner=lambda: planner_for_run(cfg, sizes))


def stream_release_gpus(cfg: RunConfig, train: TrainModel) -> int:
    """GPUs the stream trainer frees: the recipe's released engines' GPUs, or (none set) one data-parallel
    replica of the simulated trainer layout (``train.gpus // train.dp``: the smallest release that frees a
    whole replica on a colocated layout)."""
    released = cfg.section(StreamConfig).release_engines * cfg.rollout.tensor_parallel_size
    return released or max(1, train.gpus // max(1, train.dp))


def reward_for(cfg: RunConfig) -> RewardModel | MixedReward:
    """The reward time model of the recipe's ``reward.kind``; 'mixed' (math rows to math-verify,
    code rows to the sandbox) is taken as half math, half code (the data file's mix is not known here)."""
    rw = cfg.reward
    math_r = RewardModel.math(rw.num_workers, rw.timeout_s)
    code_r = RewardModel.code(rw.num_workers, rw.code_timeout_max_s)
    if rw.kind == "code":
        return code_r
    if rw.kind == "mixed":
        return MixedReward(((math_r, 0.5), (code_r, 0.5)), rw.num_workers)
    if rw.kind == "judge":
        return RewardModel.judge(rw.num_workers)
    return math_r


def planner_tp_sizes(cfg: RunConfig, shape: ModelShape, engine_for_tp: Callable[[int], EngineModel]) -> list[int]:
    """The rollout TP sizes the simulated planner moves between: the RL loop's legal sizes
    (:func:`~rollpacker.planner.legal_tp_sizes` over one node's GPUs, ``planner.max_tp``) whose
    engine's KV cache holds one longest (prompt + response) sequence. The loop's planner does not
    check memory: at a TP that cannot hold a sequence its engines would not start (vLLM refuses a
    ``max_model_len`` beyond its KV cache), which the simulator cannot model, so it leaves those out."""
    r = cfg.rollout
    legal = legal_tp_sizes(shape.arch, cfg.cluster.gpus_per_node, r.tensor_parallel_size * r.num_engines,
                           cfg.section(PlannerConfig).max_tp)
    longest = cfg.data.max_prompt_tokens + r.max_new_tokens
    return [tp for tp in legal if engine_for_tp(tp).kv_capacity_tokens >= longest]


def run_policy(cl: Cluster, feat: Features, steps: int, seed: int, name: str) -> Summary:
    rng, state = random.Random(seed), PolicyState()
    return Summary(name, [simulate_step(cl, feat, state, rng) for _ in range(steps)], cl.total_gpus)


def cumulative(cl: Cluster, steps: int, seed: int, eta_p: float, eta_r: float,
               spec: tuple[float, int] | None = None) -> list[Summary]:
    """Baseline, then RollPacker's mechanisms added one by one (the paper's table order); with
    ``spec`` = (acceptance, draft tokens), speculative decoding of long rounds last."""
    f = Features(eta_p=eta_p, eta_r=eta_r)
    stages = [("baseline (veRL)", f), ("tail batching", replace(f, tail_batching=True))]
    stages.append(("+ reward scheduler", replace(stages[-1][1], reward_scheduler=True)))
    stages.append(("+ planner", replace(stages[-1][1], planner=True)))
    stages.append(("+ stream trainer", replace(stages[-1][1], stream_trainer=True)))
    if spec is not None:
        stages.append(("+ speculation (long)", replace(stages[-1][1], spec_acceptance=spec[0], spec_tokens=spec[1])))
    return [run_policy(cl, feat, steps, seed, name) for name, feat in stages]


def sweep(cl: Cluster, steps: int, seed: int, eta_ps: list[float], eta_rs: list[float]) -> list[tuple[float, float, Summary]]:
    """Full RollPacker over an eta_P x eta_R grid."""
    out = []
    for ep in eta_ps:
        for er in eta_rs:
            feat = Features(True, True, True, True, eta_p=ep, eta_r=er)
            out.append((ep, er, run_policy(cl, feat, steps, seed, f"eta_P={ep:g} eta_R={er:g}")))
    return out
