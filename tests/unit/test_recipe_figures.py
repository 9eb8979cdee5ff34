"""docs/results/recipes.json (the recipe table of docs/cluster.md) is what the recipes and the planner give now:
a recipe change fails here until `python -m megatron_rl.tools.recipe_figures` re-records the file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from megatron_rl.tools import recipe_figures

REPO = Path(__file__).resolve().parents[2]


def test_the_recorded_recipe_figures_are_current():
    assert recipe_figures.stale() == [], "run python -m megatron_rl.tools.recipe_figures"


def test_the_figures_follow_the_recipes_and_the_planner():
    figures = recipe_figures.compute()
    recipes = sorted(p.stem for p in (REPO / "examples" / "qwen2.5").glob("*.yaml"))
    assert [row["title"] for row in figures["rows"]] == recipes
    summary = figures["summary"]
    for stem, cells in summary.items():
        handoff = cells["stream handoff (GiB per GPU)"]
        if stem.startswith("tiny_cpu"):
            assert handoff is None
            continue
        # A GPU recipe streams exactly where the planner's handoff moment fits the H800.
        assert isinstance(handoff, float) and cells["stream trainer"].startswith("on") == (handoff <= 80), stem
        assert cells["planner"] == "on", stem
    assert summary["tiny_cpu"]["planner"] == "off" and summary["tiny_cpu_full"]["planner"].startswith("on")


def test_a_changed_recipe_makes_the_file_stale(tmp_path: Path):
    recipes = tmp_path / "qwen2.5"
    shutil.copytree(REPO / "examples" / "qwen2.5", recipes)
    out = tmp_path / "recipes.json"
    out.write_text(json.dumps(recipe_figures.record(recipes)))
    assert recipe_figures.stale(out, recipes) == []
    recipe = recipes / "qwen2.5_7b_math_2x8_tp2_rtp1.yaml"
    recipe.write_text(recipe.read_text().replace("gpu_memory_utilization: 0.55", "gpu_memory_utilization: 0.5"))
    assert recipe_figures.stale(out, recipes) == ["summary"]
    assert recipe_figures.stale(tmp_path / "missing.json", recipes) == [f"{tmp_path / 'missing.json'} missing"]
