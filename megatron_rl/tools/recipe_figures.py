"""What each recipe in examples/qwen2.5/ turns on, with the planner's stream-handoff figure, as a results file.

    python -m megatron_rl.tools.recipe_figures            # write docs/results/recipes.json
    python -m megatron_rl.tools.recipe_figures --check    # exit 1 when the file no longer matches the recipes

The figures are computed, not measured: the handoff moment (the trainer training beside a generating engine on one
GPU) comes from :func:`megatron_rl.planning.moments.plan_moments` on the recipe with ``stream.enabled=true``, for
the H800 (80 GB) the GPU recipes target. No engine starts and no GPU is needed. The results file is rendered into
docs/cluster.md by ``python -m megatron_rl.tools.results_tables``; tests/unit/test_recipe_figures.py fails when a
recipe changes and the file was not re-recorded.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from megatron_rl.config.loading import load_config
from megatron_rl.planning.architectures import resolve_shape
from megatron_rl.planning.memory import GPUS, estimate_memory
from megatron_rl.planning.moments import handoff_gib, plan_moments

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "examples" / "qwen2.5"
OUT = REPO / "docs" / "results" / "recipes.json"
GPU = "h800"
COLUMNS = ["planner", "stream trainer", "stream handoff (GiB per GPU)", "speculation, history routing",
           "offload / sleep"]
# The parts of the file the recipes determine (what --check and the test compare); the rest is provenance.
COMPUTED_KEYS = ("columns", "rows", "summary", "models")


def _handoff_gib(recipe: Path) -> float | None:
    """The larger of the planner's two stream-handoff moments per GPU (a freed GPU training, a GPU generating)
    with the stream trainer forced on (None on CPU recipes)."""
    cfg = load_config(recipe, ["stream.enabled=true"])
    if cfg.cluster.device != "cuda":
        return None
    shape = resolve_shape(cfg.model.hf_path)
    plan = plan_moments(cfg, shape, estimate_memory(cfg, shape, GPUS[GPU]))
    return round(handoff_gib(plan), 1)


def _on_off(flag: bool, detail: str = "") -> str:
    return ("on" + (f", {detail}" if detail else "")) if flag else "off"


def recipe_cells(recipe: Path) -> dict:
    """{column: cell} for one recipe, read from its config as loaded (defaults included)."""
    cfg = load_config(recipe, [])
    planner, stream, rollout = cfg.planner, cfg.stream, cfg.rollout
    handoff = _handoff_gib(recipe)
    fits = handoff is None or handoff <= GPUS[GPU].memory_gib
    stream_detail = (f"{stream.release_engines} of {rollout.num_engines} engines released"
                     if stream.enabled and stream.release_engines else "")
    spec = rollout.speculative
    speculating = spec.method != "off"
    drafts = f"{spec.method}, {spec.rounds} rounds" if speculating else "no drafts"
    history = bool(getattr(cfg.tail_batching, "history_routing", False))
    offload = [part for part, on in (("trainer offloaded", cfg.trainer.offload_during_rollout),
                                     (f"engines sleep (L{rollout.sleep_level})", rollout.sleep_during_train)) if on]
    return {
        "planner": _on_off(planner.enabled, f"starts at TP {planner.initial_tp}" if planner.initial_tp else ""),
        "stream trainer": _on_off(stream.enabled, stream_detail) + ("" if fits else f" (handoff > {GPUS[GPU].memory_gib:.0f} GB)"),
        "stream handoff (GiB per GPU)": handoff,
        "speculation, history routing": "off" if not speculating and not history
        else f"{drafts}; history {_on_off(history)}",
        "offload / sleep": ", ".join(offload) or "off",
    }


def compute(recipes_dir: Path = RECIPES) -> dict:
    """The computed part of the results file: one row per recipe (file stem), one summary cell per column."""
    recipes = sorted(recipes_dir.glob("*.yaml"))
    if not recipes:
        raise FileNotFoundError(f"no recipes (*.yaml) in {recipes_dir}")
    summary = {r.stem: recipe_cells(r) for r in recipes}
    models = {r.stem: load_config(r, []).model.hf_path for r in recipes}
    rows = [{"title": stem, "format": "{:.1f}"} for stem in summary]
    return {"columns": COLUMNS, "rows": rows, "summary": summary, "models": models}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def record(recipes_dir: Path = RECIPES) -> dict:
    """The whole results file: the computed figures and their provenance."""
    computed = compute(recipes_dir)
    return {
        "name": "recipes",
        "title": "What each recipe turns on",
        "command": "python -m megatron_rl.tools.recipe_figures",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": _commit(),
        "hardware": f"any machine (the planner's figures for the {GPU.upper()}, {GPUS[GPU].memory_gib:.0f} GB; "
                    "no engine, no GPU)",
        "model": {"path": ", ".join(sorted(set(computed["models"].values())))},
        "source": "computed",
        "label_header": "recipe",
        **computed,
    }


def stale(path: Path = OUT, recipes_dir: Path = RECIPES) -> list[str]:
    """The computed keys in which ``path`` differs from what the recipes give now (empty: up to date)."""
    if not path.is_file():
        return [f"{path} missing"]
    recorded, now = json.loads(path.read_text()), compute(recipes_dir)
    return [key for key in COMPUTED_KEYS if recorded.get(key) != now[key]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the file is stale")
    parser.add_argument("--out", type=Path, default=OUT, help="results file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale(args.out)
        if differ:
            print(f"stale: {args.out} ({', '.join(differ)}); run python -m megatron_rl.tools.recipe_figures",
                  file=sys.stderr)
        return 1 if differ else 0
    args.out.write_text(json.dumps(record(), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
