"""Calibration of the simulator against a measured baseline / tail-batching run pair
(``rollpacker-benchmark`` output; see ``rollpacker-calibrate-simulator``).

Engine: in a baseline round every request is submitted at the start and the engine decodes all
of them as one continuous batch, so with the round's response lengths sorted, decode iteration
``i`` runs ``B_i = #{L >= i}`` sequences holding ``C_i = B_i * (prompt + i - 1)`` context tokens,
and the request finishing ``k``-th (rank-matched to the ``k``-th shortest length ``L``) finishes at

    admission + sum_{i<=L} (step_s + per_seq_s * B_i + per_ctx_token_s * C_i)

which is linear in the constants: a non-negative least-squares fit over all finish events of the
baseline run. The admission intercept (prefill, tokenization, submission of the round) becomes
``prefill_token_s`` per prompt token. Training: ``time/train + time/logprob`` against trained
tokens per step (linear). Weight sync, reward and unaccounted per-step time: measured means.
Steps whose rollout throughput is below half the run's median (engine warm-up) are left out of
the fits and of both runs' loop times.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from rollpacker.simulator.costs import RewardModel, TrainModel
from rollpacker.simulator.engine_model import EngineModel
from rollpacker.simulator.fitting import nnls
from rollpacker.simulator.lengths import EmpiricalLengths
from rollpacker.simulator.policies import Cluster, Features, PolicyState, simulate_step


@dataclass
class RunData:
    path: Path
    config: dict
    metrics: list[dict]
    timeline: list[dict]

    @property
    def loop_s(self) -> float:
        return sum(r["time/step"] for r in self.metrics)


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
    return rows


def load_run(run_dir: str | Path) -> RunData:
    d = Path(run_dir)
    cfg_path = d / "config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    metrics, timeline = _jsonl(d / "metrics.jsonl"), _jsonl(d / "rollout_timeline.jsonl")
    if not metrics or len(metrics) != len(timeline):
        raise ValueError(f"{d}: {len(metrics)} metrics rows vs {len(timeline)} timeline rows")
    return RunData(d, config, metrics, timeline)


def warmup_steps(run: RunData) -> set[int]:
    """Steps whose rollout tokens/s is below half the run's median (engine warm-up, compilation)."""
    tps = [r.get("rollout/tokens_per_s", 0.0) for r in run.metrics]
    mid = median(tps)
    return {i for i, x in enumerate(tps) if x < 0.5 * mid}


def finish_time_features(lengths: list[int], prompt_tokens: int) -> list[list[float]]:
    """Per request, shortest first: [iterations, sum of batch sizes, sum of context tokens,
    prompt tokens admitted] up to its finish (see the module docstring)."""
    ls = sorted(lengths)
    n, longest = len(ls), ls[-1]
    alive, j = [], 0
    for i in range(1, longest + 1):
        while j < n and ls[j] < i:
            j += 1
        alive.append(n - j)
    cum_b, cum_c, sb, sc = [0.0], [0.0], 0.0, 0.0
    for i, b in enumerate(alive, start=1):
        sb += b
        sc += b * (prompt_tokens + i - 1)
        cum_b.append(sb)
        cum_c.append(sc)
    return [[float(L), cum_b[L], cum_c[L], float(n * prompt_tokens)] for L in ls]


def fit_engine(run: RunData, prompt_tokens: int, max_num_seqs: int, skip: set[int],
               kv_capacity_tokens: int = 10**9) -> tuple[EngineModel, float]:
    """Engine constants from a baseline run's finish events; also returns the RMS error (s)."""
    rows, y = [], []
    for step, tl in enumerate(run.timeline):
        lengths = tl.get("response_lengths") or []
        reqs = tl.get("requests") or []
        if step in skip or not lengths or len(reqs) != len(lengths) or any(r[2] == "abort" for r in reqs):
            continue  # only rounds where every launched request was trained (baseline rounds)
        start = tl["window"][0]
        rows += finish_time_features(lengths, prompt_tokens)
        y += sorted(r[1] - start for r in reqs)
    if len(rows) < 4:
        raise ValueError(f"{run.path}: need baseline rounds with finish events and response lengths to fit the engine")
    step_s, per_seq_s, per_ctx_s, prefill_s = nnls(rows, y)
    rms = math.sqrt(sum((sum(c * x for c, x in zip((step_s, per_seq_s, per_ctx_s, prefill_s), r)) - t) ** 2
                        for r, t in zip(rows, y)) / len(y))
    return EngineModel(step_s, per_seq_s, per_ctx_s, prefill_s, kv_capacity_tokens, max_num_seqs), rms


def fit_train(run: RunData, prompt_tokens: int, skip: set[int]) -> tuple[TrainModel, RewardModel]:
    """Train time (train + old logprobs) per token and fixed costs from metrics.jsonl."""
    rows = [r for i, r in enumerate(run.metrics) if i not in skip]
    if len(rows) < 2:
        raise ValueError(f"{run.path}: need at least 2 steps to fit the training time")
    tokens = [r["train/num_tokens"] for r in rows]
    secs = [r["time/train"] + r.get("time/logprob", 0.0) for r in rows]
    fixed, per_token = nnls([[1.0, t] for t in tokens], secs)
    samples = median(r.get("train/num_seqs", r.get("batch/samples_trained", 1.0)) for r in rows)
    parts = ("time/rollout", "time/logprob", "time/train", "time/weight_sync", "time/reward")
    other = sum(r["time/step"] - sum(r.get(k, 0.0) for k in parts) for r in rows) / len(rows)
    # The simulator trains on prompt + response tokens; the measured tokens are responses only.
    # Every trained batch holds ``samples`` prompts, so shifting the intercept by their prompt
    # tokens keeps the fitted line exact (it may go negative: prompts are cheap on this trainer).
    fixed_s = fixed - per_token * samples * prompt_tokens + other
    sync_s = sum(r.get("time/weight_sync", 0.0) for r in rows) / len(rows)
    reward_s = sum(r.get("time/reward", 0.0) for r in rows) / len(rows)
    train = TrainModel(params=0, num_layers=0, hidden=0, gpus=1, peak_flops=1.0, fixed_s=fixed_s, sync_s=sync_s,
                       s_per_token=max(per_token, 1e-12))
    return train, RewardModel(workers=1, median_s=reward_s / max(samples, 1.0), sigma=0.0)


def replay_lengths(run: RunData, responses_per_prompt: int, max_new_tokens: int, prompt_tokens: int
                   ) -> EmpiricalLengths:
    """A baseline run's trained lengths, one group per prompt, in the run's prompt order."""
    groups = []
    for tl in run.timeline:
        ls = tl.get("response_lengths") or []
        groups += [ls[i:i + responses_per_prompt] for i in range(0, len(ls), responses_per_prompt)]
    return EmpiricalLengths(groups, max_new_tokens, prompt_tokens, str(run.path / "rollout_timeline.jsonl"),
                            sequential=True)


@dataclass
class Prediction:
    baseline_s: float
    tail_s: float
    measured_baseline_s: float
    measured_tail_s: float
    phases: dict
    seed_speedups: list[float]
    """Predicted speedup of each seed alone (spread from the replayed within-prompt draws)."""

    @property
    def predicted(self) -> float:
        return self.baseline_s / self.tail_s

    @property
    def measured(self) -> float:
        return self.measured_baseline_s / self.measured_tail_s

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


def predict_pair(engine: EngineModel, train: TrainModel, reward: RewardModel, base: RunData, tail: RunData,
                 prompt_tokens: int, seeds: int = 8) -> Prediction:
    """Simulate both policies over the pair's steps with the baseline's lengths replayed; loop
    times (sum of step times, warm-up steps left out) averaged over ``seeds``."""
    data, tb = base.config.get("data", {}), tail.config.get("tail_batching", {})
    p0, r0 = int(data.get("prompts_per_step", 16)), int(data.get("responses_per_prompt", 8))
    max_new = int(base.config.get("rollout", {}).get("max_new_tokens", 1 << 30))
    lengths = replay_lengths(base, r0, max_new, prompt_tokens)
    cl = Cluster(1, 1, lambda tp: engine, 1, 1, train, reward, lengths, p0, r0, 1)
    feats = {"baseline": Features(), "tail": Features(tail_batching=True, eta_p=float(tb.get("eta_prompts", 1.25)),
                                                      eta_r=float(tb.get("eta_responses", 1.25)))}
    skip = warmup_steps(base) | warmup_steps(tail)
    steps = min(len(base.metrics), len(tail.metrics))
    loop = {k: 0.0 for k in feats}
    phases = {f"{k}/{p}": 0.0 for k in feats for p in ("rollout", "train")}
    per_seed = []
    for seed in range(seeds):
        mine = {k: 0.0 for k in feats}
        for name, feat in feats.items():
            rng, state = random.Random(seed), PolicyState()
            for i in range(steps):
                res = simulate_step(cl, feat, state, rng)
                if i not in skip:
                    mine[name] += res.step_s
                    loop[name] += res.step_s / seeds
                    phases[f"{name}/rollout"] += res.rollout_s / seeds
                    phases[f"{name}/train"] += res.train_s / seeds
        per_seed.append(mine["baseline"] / mine["tail"])
    kept = lambda run: [r for i, r in enumerate(run.metrics[:steps]) if i not in skip]  # noqa: E731
    for name, run in (("baseline", base), ("tail", tail)):
        phases[f"{name}/rollout measured"] = sum(r["time/rollout"] for r in kept(run))
        phases[f"{name}/train measured"] = sum(r["time/train"] + r.get("time/logprob", 0.0) for r in kept(run))
    return Prediction(loop["baseline"], loop["tail"], sum(r["time/step"] for r in kept(base)),
                      sum(r["time/step"] for r in kept(tail)), phases, per_seed)
