"""The simulator against the RollPacker paper's headline figures, without fitting to them.

The paper's setup per model size (Qwen2.5 7B/14B/32B on 16/32/64 H800, rollout TP 1/2/2, max
response 8k/16k/32k, P0=128 x R0=8, veRL baseline, math+code+QA mix) is built from the repo's
mixed recipe of that size (same GPUs, rollout TP, length cap and batch), with the paper's
training layout (TP, PP, CP) and a math + code + LLM-judge reward mix in equal shares. Every
other constant is the simulator's stated one (GPU datasheet, ``GpuEfficiency``, ``TrainModel``'s
MFU, the paper-like length model, the reward models of ``costs``); nothing here is set from the
paper's table. :func:`check` prints simulated vs paper per bar with a PASS/MISS verdict, and
:func:`sensitivity` moves each uncertain input over a plausible range so that a miss can be
traced to the input that explains it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from megatron_rl.config.loading import load_config
from megatron_rl.planning.architectures import resolve_shape
from megatron_rl.planning.memory import GPUS
from rollpacker.simulator.costs import MixedReward, RewardModel, TrainModel
from rollpacker.simulator.engine_model import GpuEfficiency
from rollpacker.simulator.lengths import LogNormalLengths
from rollpacker.simulator.policies import Cluster, Features
from rollpacker.simulator.runner import PAPER_CUMULATIVE, PAPER_ITERATION_S, Summary, build_cluster, run_policy

REPO = Path(__file__).resolve().parents[2]
STAGES = ("tail batching", "+ reward scheduler", "+ planner", "+ stream trainer")
TOLERANCE = {"tail batching": 0.15, "+ stream trainer": 0.10, "baseline_s": 0.15}
"""Bars with a pass criterion (issue 50): tail batching alone and totals (speedup over veRL), the
baseline's iteration seconds; the other stages and the eta=1.25 iteration are shown, not judged."""
PAPER_SHARES_14B = {"math": (0.72, 0.05, 0.23), "code": (0.66, 0.13, 0.21)}
"""The paper's measured rollout/reward/train shares of a veRL step (14B, 16k, 32 H800): a
diagnostic of the simulated baseline's split, not a bar."""


@dataclass(frozen=True)
class PaperSize:
    """One model size of the paper's evaluation."""

    size: str
    recipe: str
    """The repo recipe with the paper's GPUs, rollout TP, max response and batch."""
    train_layout: tuple[int, int, int]
    """The paper's training (TP, PP, CP)."""


SIZES = (PaperSize("7b", "examples/qwen2.5/qwen2.5_7b_mixed_2x8_tp2_rtp1.yaml", (2, 1, 1)),
         PaperSize("14b", "examples/qwen2.5/qwen2.5_14b_mixed_4x8_tp4_rtp2.yaml", (2, 2, 2)),
         PaperSize("32b", "examples/qwen2.5/qwen2.5_32b_mixed_8x8_tp8_rtp2.yaml", (4, 1, 4)))


@dataclass(frozen=True)
class PaperInputs:
    """The inputs the paper does not state, at their nominal values (the simulator's own defaults)."""

    length_median_scale: float = 1.0
    """Times the paper-like median response length (2.8 % of the cap: the paper's 14B/16k trace)."""
    length_sigma_scale: float = 1.0
    """Times both log-sigmas of the length model (prompt 0.9, response 0.7)."""
    length_prompt_share: float = 0.81 / 1.30
    """Share of the log-length variance that belongs to the prompt (0.9^2 of 0.9^2 + 0.7^2); what
    tail batching defers is the prompt part, the response part stays in every round."""
    reward_scale: float = 1.0
    """Times every scoring time (math-verify, sandbox runs and timeouts, judge calls)."""
    mfu: float = 0.4
    """Training MFU (``TrainModel``'s default)."""
    hbm: float = GpuEfficiency().hbm
    """Decode HBM efficiency (``GpuEfficiency``'s default)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"paper check input {f.name}={value}: must be > 0")
        for name in ("length_prompt_share", "mfu", "hbm"):
            if not getattr(self, name) < 1:
                raise ValueError(f"paper check input {name}={getattr(self, name)}: must be < 1")


SENSITIVITY = (("length median x", "length_median_scale", 0.5, 2.0),
               ("length sigma x", "length_sigma_scale", 0.8, 1.2),
               ("prompt share of length variance", "length_prompt_share", 0.4, 0.8),
               ("reward time x", "reward_scale", 0.5, 2.0),
               ("training MFU", "mfu", 0.25, 0.55),
               ("decode HBM efficiency", "hbm", 0.5, 0.85))
"""(title, PaperInputs field, low end, high end) of each uncertain input's plausible range."""
SENSITIVITY_FIGURES = (("tail batching alone (x)", "tail batching"), ("total (x)", "+ stream trainer"),
                       ("baseline iteration (s)", "baseline_s"))
DIRECTIONS = {("length_median_scale", "baseline_s"): 1, ("reward_scale", "baseline_s"): 1,
              ("reward_scale", "tail batching"): -1,
              ("mfu", "baseline_s"): -1, ("mfu", "+ stream trainer"): 1, ("hbm", "baseline_s"): -1,
              ("length_sigma_scale", "tail batching"): 1, ("length_prompt_share", "tail batching"): -1}
"""The documented direction (+1 up, -1 down) in which raising an input moves a figure; the
tests recompute each and fail when one moves the other way."""


def build(size: PaperSize, inputs: PaperInputs = PaperInputs()) -> Cluster:
    """The paper's cluster for ``size`` under ``inputs``."""
    cfg = load_config(REPO / size.recipe)
    shape = resolve_shape(cfg.model.hf_path)
    gpu = GPUS["h800"]
    base = LogNormalLengths.paper_like(cfg.rollout.max_new_tokens, cfg.data.max_prompt_tokens // 2)
    sigma = math.hypot(base.sigma_prompt, base.sigma_response) * inputs.length_sigma_scale
    lengths = replace(base, median_tokens=base.median_tokens * inputs.length_median_scale,
                      sigma_prompt=sigma * math.sqrt(inputs.length_prompt_share),
                      sigma_response=sigma * math.sqrt(1.0 - inputs.length_prompt_share))
    w = cfg.reward.num_workers
    third = 1.0 / 3.0
    reward = MixedReward(((RewardModel.math(w, cfg.reward.timeout_s), third),
                          (RewardModel.code(w, cfg.reward.code_timeout_max_s), third),
                          (RewardModel.judge(w), 1.0 - 2 * third)), w).scaled(inputs.reward_scale)
    train = TrainModel.from_recipe(cfg, shape, gpu, mfu=inputs.mfu)
    tp, pp, cp = size.train_layout
    # The paper's layout on the same GPUs; full recompute (16k-32k-token sequences); the paper
    # states no trainer offload, so none is charged.
    train = replace(train, pp=pp, dp=train.gpus // (tp * pp * cp), recompute="full", offload_s=0.0)
    cluster = build_cluster(cfg, shape, gpu, lengths, train=train, reward=reward, eff=GpuEfficiency(hbm=inputs.hbm))
    # The stream trainer frees one data-parallel replica of the paper's layout (its TP x PP x CP GPUs).
    return replace(cluster, stream_release_gpus=tp * pp * cp)


def _features() -> dict[str, Features]:
    f = Features(eta_p=1.25, eta_r=1.25)
    out = {"baseline": f, "tail batching": replace(f, tail_batching=True)}
    out["+ reward scheduler"] = replace(out["tail batching"], reward_scheduler=True)
    out["+ planner"] = replace(out["+ reward scheduler"], planner=True)
    out["+ stream trainer"] = replace(out["+ planner"], stream_trainer=True)
    return out


def figures(cluster: Cluster, steps: int, seed: int, stages: tuple[str, ...] = STAGES) -> dict:
    """Speedup over the baseline of each stage, the baseline's and the full stack's mean
    iteration seconds, and the baseline's rollout/reward/train shares."""
    feats = _features()
    base = run_policy(cluster, feats["baseline"], steps, seed, "baseline")
    out: dict = {"baseline_s": base.mean_step_s, "shares": _shares(base)}
    for stage in stages:
        s = run_policy(cluster, feats[stage], steps, seed, stage)
        out[stage] = base.mean_step_s / s.mean_step_s
        if stage == "+ stream trainer":
            out["eta_s"] = s.mean_step_s
    return out


def _shares(s: Summary) -> dict[str, float]:
    total = sum(x.step_s for x in s.steps)
    return {"rollout": sum(x.rollout_s for x in s.steps) / total, "reward": sum(x.reward_wait_s for x in s.steps) / total,
            "train": sum(x.train_s for x in s.steps) / total}


def paper_figures(size: str) -> dict[str, float]:
    """The paper's figures of ``size`` under the keys of :func:`figures`."""
    no_tb, tb = PAPER_ITERATION_S[size]
    return {**PAPER_CUMULATIVE[size], "baseline_s": no_tb, "eta_s": tb}


def check(steps: int = 40, seed: int = 0, inputs: PaperInputs = PaperInputs()) -> dict[str, dict]:
    """:func:`figures` of every size under ``inputs``."""
    return {s.size: figures(build(s, inputs), steps, seed) for s in SIZES}


def verdict(size: str, key: str, simulated: float) -> tuple[float, str]:
    """(relative error vs the paper, 'PASS' / 'MISS' for a judged bar, 'shown' otherwise)."""
    paper = paper_figures(size)[key]
    err = simulated / paper - 1.0
    if key not in TOLERANCE:
        return err, "shown"
    return err, "PASS" if abs(err) <= TOLERANCE[key] else "MISS"


def sensitivity(steps: int = 40, seed: int = 0, sizes: tuple[PaperSize, ...] = SIZES) -> dict[str, dict]:
    """``{size: {field: {"low": figures, "high": figures}}}``: each input at its range's ends,
    the others nominal (baseline, tail batching alone and the full stack only)."""
    stages = ("tail batching", "+ stream trainer")
    out: dict[str, dict] = {}
    for size in sizes:
        out[size.size] = {}
        for _, name, low, high in SENSITIVITY:
            out[size.size][name] = {end: figures(build(size, replace(PaperInputs(), **{name: value})), steps, seed, stages)
                                    for end, value in (("low", low), ("high", high))}
    return out


def explain(size: str, key: str, nominal: float, sens: dict) -> str:
    """The input whose range end moves a missed figure closest to the paper's, and where it lands."""
    paper = paper_figures(size)[key]
    best = None
    for title, name, low, high in SENSITIVITY:
        for end, value in (("low", low), ("high", high)):
            got = sens[size][name][end][key]
            if best is None or abs(got - paper) < abs(best[0] - paper):
                best = (got, title, value)
    if best is None or abs(best[0] - paper) >= abs(nominal - paper):
        return "none closer"
    got, title, value = best
    return f"{title.removesuffix(' x')} {'x' if title.endswith(' x') else ''}{value:g}: " + (
        f"{got:.0f} s" if key == "baseline_s" else f"{got:.2f}")


def nominal_inputs() -> dict[str, float]:
    return {f.name: getattr(PaperInputs(), f.name) for f in fields(PaperInputs)}

