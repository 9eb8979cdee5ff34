"""GPU rules of the H800 recipes' RollPacker mechanisms (examples/qwen2.5/qwen2.5_*b_*.yaml): every recipe turns
on the elastic-TP planner with the paper's online rule, and its switch moments fit 80 GB; every recipe streams with
the paper's settings, releasing the fewest engines whose GPUs are whole data-parallel replicas, and both handoff
moments (megatron_rl.planning.moments: a freed GPU training, a GPU generating) fit, quoted in its header."""
from pathlib import Path

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.distributed.gpu_layout import run_layout
from megatron_rl.distributed.replica_release import releasable_counts, release_units, replica_ranks
from megatron_rl.planning.architectures import resolve_shape
from megatron_rl.planning.memory import GPUS, estimate_memory
from megatron_rl.planning.moments import HANDOFF_GENERATE, HANDOFF_TRAIN, plan_moments

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "examples/qwen2.5").glob("qwen2.5_*b_*.yaml"))
SWITCH = ("elastic TP switch: new engines start", "elastic TP switch: push into new engines")
HANDOFF = (HANDOFF_TRAIN, HANDOFF_GENERATE)


def _plan(recipe: Path, overrides=()):
    cfg = load_config(recipe, list(overrides))
    shape = resolve_shape(cfg.model.hf_path)
    return cfg, plan_moments(cfg, shape, estimate_memory(cfg, shape, GPUS["h800"]))


def _header(recipe: Path) -> str:
    """The recipe's leading comment block, joined into one line."""
    lines = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def test_all_nine_recipes_are_checked():
    assert len(RECIPES) == 9


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_the_planner_is_on_with_the_papers_rule_and_its_switch_fits(recipe):
    cfg, plan = _plan(recipe)
    pl = cfg.planner
    # The paper's online rule: preemptions up > 1.05x double a round type's TP, 4 quiet rounds halve it.
    assert pl.enabled and (pl.growth, pl.quiet_rounds) == (1.05, 4)
    # Every round type starts at the recipe's rollout TP, the floor the memory plan sizes the switch at.
    assert (pl.initial_tp, pl.profile, pl.min_tp) == ("", "", 0)
    moments = {m.name: m for m in plan.moments}
    assert all(moments[name].checked and moments[name].total_gib <= 80 for name in SWITCH)
    assert not plan.problems
    header = _header(recipe)
    for name in SWITCH:  # the header quotes the planner's switch figures
        assert f"{moments[name].total_gib:.1f}" in header, name


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_streams_on_the_gpus_it_frees_and_both_handoff_moments_fit(recipe):
    cfg, plan = _plan(recipe)
    st, p = cfg.stream, cfg.parallel
    # The paper's start rule.
    assert st.enabled and (st.rounds, st.start_fraction_min, st.start_fraction_max, st.check_interval) == (
        "long", 0.2, 0.5, 0.05)
    layout = run_layout(cfg)
    units = release_units(layout, replica_ranks(p.tensor_model_parallel_size, p.context_parallel_size,
                                                p.data_parallel_size, p.pipeline_model_parallel_size))
    assert st.release_engines == releasable_counts(units, len(layout.engine_gpus))[0]  # one replica's engines
    moments = {m.name: m for m in plan.moments}
    assert all(moments[name].checked and moments[name].total_gib <= 80 for name in HANDOFF) and not plan.problems
    header = _header(recipe)
    assert f"handoff moments per GPU {moments[HANDOFF_TRAIN].total_gib:.1f} (a freed GPU training) and " \
           f"{moments[HANDOFF_GENERATE].total_gib:.1f} (a GPU generating)" in header


def test_the_14b_recipes_run_the_kv_cache_share_their_rollout_wants():
    """The old handoff (the whole trainer training beside a generating engine) made the 14B recipes shrink every
    round's KV cache (gpu_memory_utilization 0.48); on the freed GPUs they run at 0.5 again."""
    for recipe in (r for r in RECIPES if "_14b_" in r.name):
        cfg, plan = _plan(recipe)
        assert cfg.rollout.gpu_memory_utilization == 0.5 and cfg.stream.enabled and not plan.problems
