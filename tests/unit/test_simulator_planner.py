"""The simulator's rollout-TP decisions are the RL loop's planner's (rollpacker.planner).

The simulator used to carry its own copy of the online rule, which drifted from the planner (it
never went below the recipe's TP, kept comparing preemptions across a TP change, ignored the
planner.* options). These tests feed the simulator rounds and check each round ran at the TP the
planner, given the same rounds, chooses: with preemption counts scripted to hit every branch of
the rule, and with the preemptions the simulated engines really produce.
"""
import random
from pathlib import Path

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.planning.architectures import BUILTIN_SHAPES
from megatron_rl.planning.memory import GPUS
from rollpacker import planner as planner_mod
from rollpacker.simulator import policies
from rollpacker.simulator.engine_model import EngineModel
from rollpacker.simulator.lengths import LogNormalLengths
from rollpacker.simulator.policies import Features, PolicyState, simulate_step
from rollpacker.simulator.runner import build_cluster

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples/qwen2.5/qwen2.5_14b_math_4x8_tp4_rtp2.yaml"
# Small batches and short responses keep each simulated round cheap; the layout stays the
# recipe's (32 rollout GPUs as 16 engines x TP2, 8 GPUs a node: legal TPs 1/2/4/8).
# planner.min_tp=1 lets the rule go below the recipe's TP 2 (the default floor is the smallest
# starting TP), so every branch of the rule is reachable.
SMALL = ["data.prompts_per_step=4", "data.responses_per_prompt=2", "rollout.max_new_tokens=512",
         "data.max_prompt_tokens=256", "planner.min_tp=1"]


def cluster(*overrides: str):
    cfg = load_config(RECIPE, [*SMALL, *overrides])
    return cfg, build_cluster(cfg, BUILTIN_SHAPES["qwen2.5-14b"], GPUS["h800"],
                              LogNormalLengths.paper_like(cfg.rollout.max_new_tokens, 128))


def run_scripted(monkeypatch, cl, feat: Features, counts: list[int]) -> list:
    """Simulate len(counts) steps; round i reports counts[i] preemptions (the rest of the round
    is simulated as usual)."""
    script = iter(counts)
    real = policies._run_round

    def scripted_round(*args, **kwargs):
        rnd = real(*args, **kwargs)
        rnd.preemptions = next(script)
        return rnd

    monkeypatch.setattr(policies, "_run_round", scripted_round)
    state, rng = PolicyState(), random.Random(0)
    return [simulate_step(cl, feat, state, rng) for _ in counts]


def planner_replay(cfg, sizes: list[int], rounds: list[tuple[str, int]]) -> list[int]:
    """The TP the loop's planner (built for ``cfg`` as the trainer builds it) gives each round,
    observing the rounds as ElasticTP does: tp_for before the round, observe after it."""
    planner = planner_mod.planner_for_run(cfg, sizes)
    tps = []
    for kind, preemptions in rounds:
        tps.append(planner.tp_for(kind))
        planner.observe(kind, preemptions)
    return tps


def test_planner_sizes_are_the_loops_legal_sizes():
    _, cl = cluster()
    arch = BUILTIN_SHAPES["qwen2.5-14b"].arch
    assert cl.make_planner().sizes == planner_mod.legal_tp_sizes(arch, 8, 32) == [1, 2, 4, 8]
    _, capped = cluster("planner.max_tp=4")
    assert capped.make_planner().sizes == [1, 2, 4] and capped.max_tp == 4


# Paper rule over TPs 1/2/4/8 from TP 2: growth 1.05, 4 quiet rounds.
#   100: first round, baseline   200: rose -> 4   300: first at TP 4 (no baseline: counts at
#   different TPs are not comparable) -> keep   4 x 0 -> 2   4 x 0 -> 1 (below the recipe's TP 2,
#   still legal)   10: first at TP 1 -> keep   400: rose -> 2   400: first at TP 2 -> keep
COUNTS = [100, 200, 300, 0, 0, 0, 0, 0, 0, 0, 0, 10, 400, 400]
TPS = [2, 2, 4, 4, 4, 4, 4, 2, 2, 2, 2, 1, 1, 2]


def test_scripted_rounds_run_at_the_planners_tp(monkeypatch):
    cfg, cl = cluster()
    steps = run_scripted(monkeypatch, cl, Features(planner=True), COUNTS)
    assert [s.round_type for s in steps] == ["baseline"] * len(COUNTS)
    assert [s.preemptions for s in steps] == COUNTS
    assert [s.tp for s in steps] == TPS
    assert TPS == planner_replay(cfg, [1, 2, 4, 8], [("baseline", c) for c in COUNTS])


def test_planner_options_reach_the_simulated_planner(monkeypatch):
    # growth 2.5: 100 -> 200 -> 300 never rises enough; 2 quiet rounds halve; start at TP 4.
    overrides = ("planner.growth=2.5", "planner.quiet_rounds=2", "planner.initial_tp=baseline:4")
    cfg, cl = cluster(*overrides)
    counts = [100, 200, 300, 0, 0, 0, 0]
    steps = run_scripted(monkeypatch, cl, Features(planner=True), counts)
    assert [s.tp for s in steps] == [4, 4, 4, 4, 4, 2, 2]
    assert [s.tp for s in steps] == planner_replay(cfg, [1, 2, 4, 8], [("baseline", c) for c in counts])
    with pytest.raises(ValueError, match="not among the legal rollout TP sizes"):
        cluster("planner.initial_tp=short:16")


def test_planner_off_keeps_the_recipe_tp(monkeypatch):
    _, cl = cluster()
    steps = run_scripted(monkeypatch, cl, Features(), COUNTS[:6])
    assert {s.tp for s in steps} == {2}


def test_simulated_preemptions_drive_the_same_decisions_as_the_planner():
    """No scripting: engines with a KV cache small enough that rounds preempt (two TP-2 engines of
    16k tokens; TP scales the KV cache). Each round type is planned on its own; the simulator's TPs
    equal the planner's on the same (round type, preemptions) sequence."""
    cfg = load_config(RECIPE, ["rollout.num_engines=2", "data.prompts_per_step=16", "data.responses_per_prompt=8", "planner.min_tp=1",
                               "rollout.max_new_tokens=4096", "data.max_prompt_tokens=256"])
    engine = EngineModel(step_s=0.01, per_seq_s=5e-5, per_ctx_token_s=5e-8, prefill_token_s=3e-5,
                         kv_capacity_tokens=16_000, max_num_seqs=256, tp=2, gpus=2)
    cl = build_cluster(cfg, BUILTIN_SHAPES["qwen2.5-14b"], GPUS["h800"], LogNormalLengths.paper_like(4096, 128),
                       engine=engine)
    assert cl.make_planner().sizes == [1, 2, 4]  # 4 rollout GPUs
    state, rng = PolicyState(), random.Random(0)
    steps = [simulate_step(cl, Features(tail_batching=True, planner=True), state, rng) for _ in range(30)]
    rounds = [(s.round_type, s.preemptions) for s in steps]
    assert [s.tp for s in steps] == planner_replay(cfg, [1, 2, 4], rounds)
    # The run exercised the rule: both round types changed TP, short rounds both ways.
    tps = {kind: [s.tp for s in steps if s.round_type == kind] for kind in ("short", "long")}
    assert len(set(tps["long"])) > 1, tps
    assert any(b > a for a, b in zip(tps["short"], tps["short"][1:])), tps
    assert any(b < a for a, b in zip(tps["short"], tps["short"][1:])), tps


def test_by_default_the_rule_never_halves_below_the_smallest_starting_tp():
    """The planner knows nothing of memory: without planner.min_tp it stops at the recipe's TP 2
    (known to fit), where the same quiet rounds would otherwise take it to TP 1."""
    cfg = load_config(RECIPE, [o for o in SMALL if not o.startswith("planner.min_tp")])
    sizes = planner_mod.legal_tp_sizes(BUILTIN_SHAPES["qwen2.5-14b"].arch, 8, 32)
    rounds = [("long", c) for c in COUNTS]
    floored = planner_replay(cfg, sizes, rounds)
    free = planner_replay(load_config(RECIPE, SMALL), sizes, rounds)
    assert min(free) == 1 and min(floored) == 2 and max(floored) == 4
    assert floored[:11] == free[:11]  # identical until the halving that would cross the floor
    with pytest.raises(ValueError, match="planner.min_tp=4: starting TPs"):
        planner_replay(load_config(RECIPE, [*SMALL, "planner.min_tp=4"]), sizes, rounds)
