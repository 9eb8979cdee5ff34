"""GPU rules of the H800 recipes' RollPacker mechanisms (examples/qwen2.5/qwen2.5_*b_*.yaml): every recipe turns
on the elastic-TP planner with the paper's online rule, and its switch moments fit 80 GB; the stream trainer is on
exactly where its handoff moment (megatron_rl.planning.moments: the trainer training beside a generating engine on
one GPU) fits, and a recipe that keeps it off says why in its header with the planner's figure."""
from pathlib import Path

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.planning.architectures import resolve_shape
from megatron_rl.planning.memory import GPUS, estimate_memory
from megatron_rl.planning.moments import plan_moments

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "examples/qwen2.5").glob("qwen2.5_*b_*.yaml"))
SWITCH = ("elastic TP switch: new engines start", "elastic TP switch: push into new engines")
HANDOFF = "stream handoff (trainer trains, engine generates)"


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
def test_the_stream_trainer_is_on_exactly_where_its_handoff_fits(recipe):
    cfg, _ = _plan(recipe)
    st = cfg.stream
    # The paper's start rule, kept in the section whether or not the recipe streams.
    assert (st.rounds, st.start_fraction_min, st.start_fraction_max, st.check_interval) == ("long", 0.2, 0.5, 0.05)
    _, forced = _plan(recipe, ["stream.enabled=true"])
    handoff = next(m for m in forced.moments if m.name == HANDOFF)
    fits = not any(p.startswith(f"moment '{HANDOFF}'") for p in forced.problems)
    assert fits == (handoff.total_gib <= 80)
    assert st.enabled == fits, f"{recipe.name}: the stream handoff needs {handoff.total_gib:.1f} GiB per GPU"
    header = _header(recipe)
    if fits:
        assert f"needs {handoff.total_gib:.1f} GiB per GPU" in header
    else:  # off, and the header says why with the planner's figure
        assert "The stream trainer stays off" in header
        assert f"needs {handoff.total_gib:.1f} GiB per GPU > 80" in header


def test_the_14b_recipes_give_the_kv_cache_share_the_stream_handoff_needs():
    """At the former rollout.gpu_memory_utilization 0.5 the 14B handoff moment was over 80 GB, so streaming
    there depends on the 0.48 the recipes now set; the header names both figures."""
    for recipe in (r for r in RECIPES if "_14b_" in r.name):
        cfg, plan = _plan(recipe)
        assert cfg.rollout.gpu_memory_utilization == 0.48 and cfg.stream.enabled and not plan.problems
        _, before = _plan(recipe, ["rollout.gpu_memory_utilization=0.5"])
        over = next(m for m in before.moments if m.name == HANDOFF)
        assert over.total_gib > 80 and any(p.startswith(f"moment '{HANDOFF}'") for p in before.problems)
        assert f"at 0.5: {over.total_gib:.1f} > 80" in _header(recipe)
