"""One training step of the baseline or of RollPacker on the simulated cluster.

Baseline (veRL): P0 fresh prompts x R0 responses, wait for the last response, score them all
(synchronous reward), train, sync weights. RollPacker, feature by feature (as in the paper's
cumulative table):

* tail batching: short rounds launch eta_P*P0 prompts x ceil(eta_R*R0) responses and end when
  P0 prompts have R0 finished responses (the rest is aborted, unfinished prompts are queued);
  a long round trains P0 queued prompts x R0 with no over-provisioning when the queue holds P0;
* reward scheduler: each response is scored as it finishes (the step waits only for the reward
  tail) with the adaptive timeout;
* planner: the RL loop's own :class:`~rollpacker.planner.ElasticTPPlanner`, driven as
  ``rollpacker.elastic_tp`` drives it: ``tp_for(round type)`` before a round, ``observe(round
  type, the round's preemptions)`` after it (per round type: preemptions up > ``growth`` ->
  next larger legal TP, ``quiet_rounds`` rounds without preemption -> next smaller); a TP change
  pays one more weight sync;
* stream trainer: in long rounds, once ``stream_start`` of the prompts are complete, half of the
  engines hand their running requests to the others (recompute: prompt + generated tokens are
  prefilled again) and their GPUs train on completed prompts while the rest still generate.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

from rollpacker.planner import ElasticTPPlanner
from rollpacker.simulator.costs import MixedReward, RewardModel, TrainModel
from rollpacker.simulator.engine_model import EngineModel
from rollpacker.simulator.engine_sim import EngineRun, SimRequest, simulate_engine
from rollpacker.simulator.lengths import LengthModel, PromptDraw
from rollpacker.simulator.speculation import SpeculativeEngine


@dataclass(frozen=True)
class Features:
    """Which RollPacker mechanisms are on, and the over-provisioning factors."""

    tail_batching: bool = False
    reward_scheduler: bool = False
    planner: bool = False
    stream_trainer: bool = False
    eta_p: float = 1.25
    eta_r: float = 1.25
    stream_start: float = 0.5
    """Fraction of a long round's prompts complete before the stream trainer takes GPUs."""
    spec_acceptance: float = 0.0
    """Speculative decoding in long rounds: per-draft-token acceptance rate (0: off)."""
    spec_tokens: int = 0
    """Speculative decoding in long rounds: draft tokens per sequence and step (0: off)."""


@dataclass
class Cluster:
    """The simulated hardware and workload."""

    rollout_gpus: int
    gpus_per_node: int
    engine_for_tp: Callable[[int], EngineModel]
    base_tp: int
    max_tp: int
    train: TrainModel
    reward: RewardModel | MixedReward
    lengths: LengthModel
    prompts_per_step: int
    responses_per_prompt: int
    total_gpus: int
    planner: Callable[[], ElasticTPPlanner] | None = None
    """Makes the elastic-TP planner of one simulated run (a fresh one per run; ``build_cluster``
    gives the one the RL loop builds for the recipe). None: an :class:`ElasticTPPlanner` over the
    powers of two from ``base_tp`` to ``max_tp``, every round type starting at ``base_tp``."""

    def make_planner(self) -> ElasticTPPlanner:
        """A fresh planner (no rounds observed yet)."""
        if self.planner is not None:
            return self.planner()
        sizes, tp = [], self.base_tp
        while tp <= self.max_tp:
            sizes.append(tp)
            tp *= 2
        return ElasticTPPlanner(sizes=sizes or [self.base_tp])


@dataclass
class StepResult:
    round_type: str
    rollout_s: float
    reward_wait_s: float
    train_s: float
    sync_s: float
    rollout_idle_gpu_s: float
    preemptions: int
    tp: int
    trained_tokens: int

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.reward_wait_s + self.train_s + self.sync_s


@dataclass
class _Round:
    end: float
    kept: list[list[SimRequest]]
    incomplete: list[PromptDraw]
    idle_gpu_s: float
    preemptions: int
    stream_overlap_s: float = 0.0


@dataclass
class PolicyState:
    """What carries over between steps: the long-prompt queue and the planner."""

    queue: list[PromptDraw] = field(default_factory=list)
    next_pid: int = 0
    planner: ElasticTPPlanner | None = None
    """The run's planner (made by ``Cluster.make_planner`` on its first planned step)."""
    last_tp: int = 0


def simulate_step(cl: Cluster, feat: Features, state: PolicyState, rng: random.Random) -> StepResult:
    p0, r0 = cl.prompts_per_step, cl.responses_per_prompt
    if feat.tail_batching and len(state.queue) >= p0:
        kind, prompts, per_prompt, need = "long", state.queue[:p0], r0, p0
        state.queue = state.queue[p0:]
    else:
        kind = "short" if feat.tail_batching else "baseline"
        n = math.ceil(feat.eta_p * p0) if feat.tail_batching else p0
        per_prompt = math.ceil(feat.eta_r * r0) if feat.tail_batching else r0
        prompts = [cl.lengths.new_prompt(state.next_pid + i, rng) for i in range(n)]
        state.next_pid += n
        need = p0
    if feat.planner:
        if state.planner is None:
            state.planner = cl.make_planner()
        tp = state.planner.tp_for(kind)  # as ElasticTP.before_round
    else:
        tp = cl.base_tp
    engine = cl.engine_for_tp(tp)
    if kind == "long" and feat.spec_tokens > 0:
        engine = SpeculativeEngine.wrap(engine, feat.spec_acceptance, feat.spec_tokens)
    rnd = _run_round(cl, engine, prompts, per_prompt, need, r0, rng,
                     stream=feat.stream_trainer and kind == "long", stream_start=feat.stream_start)
    state.queue.extend(rnd.incomplete)
    batch = [r for group in rnd.kept for r in group]
    durations = cl.reward.durations(len(batch), rng, adaptive=feat.reward_scheduler)
    if feat.reward_scheduler:
        reward_wait = max(0.0, cl.reward.completion_time([r.finish or 0.0 for r in batch], durations) - rnd.end)
    else:
        reward_wait = cl.reward.completion_time([0.0] * len(batch), durations)
    seqs = [r.prompt_tokens + r.target_tokens for r in batch]
    full_train = cl.train.time(seqs)
    train_s = full_train - min(rnd.stream_overlap_s, full_train - cl.train.fixed_s)
    sync_s = cl.train.sync_s * (2 if state.last_tp and tp != state.last_tp else 1)
    state.last_tp = tp
    if feat.planner:
        state.planner.observe(kind, rnd.preemptions)  # as ElasticTP.after_round
    return StepResult(kind, rnd.end, reward_wait, train_s, sync_s, rnd.idle_gpu_s, rnd.preemptions, tp, sum(seqs))


def _run_round(cl: Cluster, engine: EngineModel, prompts: list[PromptDraw], per_prompt: int, need: int,
               r0: int, rng: random.Random, stream: bool, stream_start: float) -> _Round:
    n_engines = max(1, cl.rollout_gpus // engine.gpus)
    buckets: list[list[SimRequest]] = [[] for _ in range(n_engines)]
    rid = 0
    for p in prompts:
        for _ in range(per_prompt):
            req = SimRequest(rid, p.prompt_tokens, cl.lengths.response_length(p, rng), pid=p.pid)
            buckets[rid % n_engines].append(req)  # the engine pool spreads requests round-robin
            rid += 1
    runs = [simulate_engine(engine, b) for b in buckets]
    by_pid: dict[int, list[SimRequest]] = {p.pid: [] for p in prompts}
    for run in runs:
        for r in run.finished:
            by_pid[r.pid].append(r)
    done_at = {pid: sorted(rs, key=lambda r: r.finish)[r0 - 1].finish for pid, rs in by_pid.items() if len(rs) >= r0}
    order = sorted(done_at, key=done_at.get)
    end = done_at[order[need - 1]]
    kept_ids = set(order[:need])
    kept = [sorted(by_pid[pid], key=lambda r: r.finish)[:r0] for pid in order[:need]]
    incomplete = [p for p in prompts if p.pid not in kept_ids]
    preempt = sum(r.preemptions for r in runs)
    overlap = 0.0
    if stream:
        end, runs, overlap, preempt = _stream(cl, engine, buckets, runs, sorted(done_at.values()), need, stream_start, end)
    idle = sum(engine.gpus * max(0.0, end - min(run.busy_until, end)) for run in runs)
    # (In stream mode ``runs`` are the engines still generating; the freed GPUs are training.)
    return _Round(end, kept, incomplete, idle, preempt, overlap)


def _stream(cl: Cluster, engine: EngineModel, buckets: list[list[SimRequest]], runs: list[EngineRun],
            completions: list[float], need: int, start_frac: float, end: float
            ) -> tuple[float, list[EngineRun], float, int]:
    """Free half of the engines once ``start_frac`` of the prompts are complete, migrate their
    unfinished requests (recompute) to the others, and train on the freed GPUs meanwhile."""
    if len(buckets) < 2:
        return end, runs, 0.0, sum(r.preemptions for r in runs)
    t_s = completions[max(0, math.ceil(start_frac * need) - 1)]
    partial = [simulate_engine(engine, [_copy(r) for r in b], stop_at=t_s) for b in buckets]
    remaining = [sum(r.remaining for r in p.unfinished) for p in partial]
    order = sorted(range(len(buckets)), key=lambda i: remaining[i])
    freed, kept = order[: len(buckets) // 2], order[len(buckets) // 2:]
    migrated = [SimRequest(r.rid, r.prompt_tokens + r.generated, r.remaining, pid=r.pid, arrival=t_s)
                for i in freed for r in partial[i].unfinished]
    new_buckets = {i: [_copy(r) for r in buckets[i]] for i in kept}
    for j, r in enumerate(migrated):
        new_buckets[kept[j % len(kept)]].append(r)
    new_runs = [simulate_engine(engine, reqs) for reqs in new_buckets.values()]
    new_end = max(end, max(run.busy_until for run in new_runs))
    # Freed GPUs train on completed prompts from t_s on, at their share of the trainer's
    # throughput; simulate_step caps this at the batch's training work.
    overlap = len(freed) * engine.gpus / cl.total_gpus * (new_end - t_s)
    preempt = sum(r.preemptions for r in new_runs)
    return new_end, new_runs, overlap, preempt


def _copy(r: SimRequest) -> SimRequest:
    """A fresh (not yet started) copy: simulations mutate their requests."""
    return SimRequest(r.rid, r.prompt_tokens, r.target_tokens, pid=r.pid, arrival=r.arrival)
