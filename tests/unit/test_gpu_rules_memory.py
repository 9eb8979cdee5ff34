"""GPU rules of device memory: every moment of a step of the three Qwen2.5 recipes fits an 80 GB
GPU (megatron_rl.planning.moments), the push moment only in the order the loop now makes it
(engine weights woken alone, KV cache after the trainer left: vllm/v1/worker/gpu_worker.py
``wake_up(tags)``), and context parallelism is refused before anything starts."""
from pathlib import Path

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.config.validation import validate
from megatron_rl.config.values import ConfigError
from megatron_rl.planning.architectures import resolve_shape
from megatron_rl.planning.memory import GPUS, PlanError, estimate_memory
from megatron_rl.planning.moments import plan_moments, push_staging_gib
from megatron_rl.planning.plan import make_plan

REPO = Path(__file__).resolve().parents[2]
RECIPES = {size: REPO / f"examples/qwen2.5/qwen2.5_{size}" for size in (
    "7b_math_2x8_tp2_rtp1.yaml", "14b_math_4x8_tp4_rtp2.yaml", "32b_math_8x8_tp8_rtp2.yaml")}
STEP = ["rollout", "to training", "train", "push (engine weights woken)", "push done, KV cache woken",
        "elastic TP switch: new engines start", "elastic TP switch: push into new engines",
        "stream handoff, freed GPU (trainer trains)", "stream handoff, generating GPU (engine generates)"]


def _moments(recipe: Path, overrides=(), push_order="ordered"):
    cfg = load_config(recipe, list(overrides))
    shape = resolve_shape(cfg.model.hf_path)
    return cfg, shape, plan_moments(cfg, shape, estimate_memory(cfg, shape, GPUS["h800"]), push_order)


@pytest.mark.parametrize("recipe", sorted(RECIPES.values()), ids=lambda p: p.stem)
def test_every_moment_of_a_step_fits_80_gb(recipe):
    cfg, shape, plan = _moments(recipe)
    assert [m.name for m in plan.moments] == STEP
    assert not plan.problems
    for m in plan.moments:
        if m.checked:
            assert 0 < m.total_gib <= 80, m.name
    push = plan.moments[3]
    # The push holds the engine weights and both sides' staging, never the KV cache while it sleeps.
    assert cfg.rollout.sleep_during_train and cfg.rollout.sleep_level == 2
    assert "engine KV cache + reserve" not in push.parts and push.parts["engine weights"] > 0
    assert push.parts["push staging (engine)"] == pytest.approx(push_staging_gib(cfg, shape)["push staging (engine)"])
    # make_plan (the dry run's plan) prints every moment.
    lines = make_plan(cfg).lines()
    assert any(line.startswith("memory moments of a step") for line in lines)
    assert sum(any(line.startswith(f"  {name}:") for line in lines) for name in STEP) == len(STEP)


def test_the_old_push_order_exceeds_80_gb_on_32b_and_the_plan_refuses_it():
    """Waking weights + KV cache while the trainer is still resident (the order before) is the
    moment that does not fit the 32B recipe; the ordered push does."""
    _, _, old = _moments(RECIPES["32b_math_8x8_tp8_rtp2.yaml"], push_order="all_at_once")
    moment = next(m for m in old.moments if m.name.startswith("push"))
    assert moment.total_gib > 80 and {"engine KV cache + reserve", "trainer gradients"} <= set(moment.parts)
    assert [p.split(" needs")[0] for p in old.problems] == ["moment 'push (weights + KV woken, trainer resident)'"]
    _, _, new = _moments(RECIPES["32b_math_8x8_tp8_rtp2.yaml"])
    assert new.moments[3].total_gib < 80 < moment.total_gib
    # With the offload on, the tensor push frees the trainer's grad buffers before the weights wake.
    assert "trainer gradients" not in new.moments[3].parts and "trainer weights" in new.moments[3].parts


def test_a_moment_over_the_budget_fails_the_plan_naming_it():
    # Keeping the trainer resident through the rollout: the rollout moment is over 80 GB.
    with pytest.raises(PlanError, match=r"moment 'rollout' needs 9\d\.\d GiB per GPU > 80 GiB") as info:
        make_plan(load_config(RECIPES["32b_math_8x8_tp8_rtp2.yaml"], ["trainer.offload_during_rollout=false"]))
    assert "memory moments of a step" in str(info.value)
    # Engines that do not sleep through training: the train moment holds their whole pool.
    with pytest.raises(PlanError, match=r"moment 'train' needs \d+\.\d GiB"):
        make_plan(load_config(RECIPES["7b_math_2x8_tp2_rtp1.yaml"], ["rollout.sleep_during_train=false"]))


def test_feature_moments_are_checked_only_when_the_recipe_turns_the_feature_on():
    recipe = RECIPES["32b_math_8x8_tp8_rtp2.yaml"]
    _, _, plan = _moments(recipe, ["planner.enabled=false", "stream.enabled=false"])
    assert [m.checked for m in plan.moments[-4:]] == [False, False, False, False] and not plan.problems
    # The recipe turns the planner and the stream trainer on (tests/unit/test_gpu_rules_recipes.py).
    _, _, plan = _moments(recipe)
    assert [m.checked for m in plan.moments[-4:]] == [True, True, True, True] and not plan.problems
    # The stream handoff: a freed GPU holds the training trainer alone, a generating GPU the engine beside the
    # trainer as in the rollout (offloaded here); neither holds both, so both are at most the rollout and train.
    freed, generating = plan.moments[-2], plan.moments[-1]
    assert "engine KV cache + reserve" not in freed.parts and "trainer activations" in freed.parts
    assert "trainer activations" not in generating.parts and "engine KV cache + reserve" in generating.parts
    by_name = {m.name: m.total_gib for m in plan.moments}
    assert freed.total_gib <= by_name["train"] and generating.total_gib == pytest.approx(by_name["rollout"])
    # The old handoff (the whole trainer training beside a generating engine) would not have fit.
    from megatron_rl.planning.moments import overlap_gib

    cfg, shape, _ = _moments(recipe)
    assert overlap_gib(estimate_memory(cfg, shape, GPUS["h800"])) > 80
    # An elastic switch fits in the push's order (new engines asleep, weights woken alone) ...
    _, _, plan = _moments(recipe, ["planner.enabled=true"])
    assert all(m.checked for m in plan.moments[5:7]) and not plan.problems
    assert plan.moments[6].total_gib == pytest.approx(plan.moments[3].total_gib)
    # ... but not with engines that keep their pool (no sleep through training): weights, KV cache and trainer.
    _, _, plan = _moments(recipe, ["planner.enabled=true", "rollout.sleep_during_train=false"])
    assert any(p.startswith("moment 'elastic TP switch: push into new engines'") for p in plan.problems)


def test_push_staging_is_bounded_by_the_bucket_config():
    cfg, shape, _ = _moments(RECIPES["32b_math_8x8_tp8_rtp2.yaml"])
    base = push_staging_gib(cfg, shape)
    cfg.rollout.weight_push_buffers *= 2
    more = push_staging_gib(cfg, shape)
    bucket_gib = cfg.rollout.weight_push_bucket_mb / 1024
    assert more["push buffers (trainer)"] - base["push buffers (trainer)"] == pytest.approx(bucket_gib * 2)
    assert more["push staging (engine)"] - base["push staging (engine)"] == pytest.approx(bucket_gib * 2)


@pytest.mark.parametrize("recipe", sorted(RECIPES.values()), ids=lambda p: p.stem)
def test_context_parallelism_is_refused_before_anything_starts(recipe):
    cfg = load_config(recipe, ["parallel.context_parallel_size=2", "parallel.data_parallel_size=1"])
    with pytest.raises(ConfigError, match=r"parallel.context_parallel_size=2: context parallelism is not supported"):
        validate(cfg, device="cuda")
    assert load_config(recipe).parallel.context_parallel_size == 1


def test_push_staging_stays_inside_the_engines_budget():
    """The engine's staging borrows the KV cache's share of its pool while the KV cache sleeps; a
    staging larger than that share, or awake engines, would put it outside vLLM's budget."""
    recipe = RECIPES["14b_math_4x8_tp4_rtp2.yaml"]
    _, _, fits = _moments(recipe)
    assert not fits.problems
    _, _, big = _moments(recipe, ["rollout.weight_push_bucket_mb=8192", "rollout.weight_push_buffers=8"])
    assert any("exceeds the KV cache share" in p for p in big.problems), big.problems
    _, _, awake = _moments(recipe, ["rollout.sleep_during_train=false"])
    assert any("outside vLLM's budget" in p for p in awake.problems), awake.problems
