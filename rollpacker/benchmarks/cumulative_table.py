"""Renders docs/results/cumulative.md's tables from what ``rollpacker-benchmark --compare
cumulative --record`` measured (docs/results/cumulative.json), between the page's markers::

    python -m rollpacker.benchmarks.cumulative_table [docs/results/cumulative.json docs/results/cumulative.md]

tests/unit/test_benchmark_cumulative.py fails when the page and the JSON file disagree.
"""
from __future__ import annotations

import argparse
import json
import statistics
import textwrap
from pathlib import Path

from rollpacker.benchmarks.common import REPO

START = "<!-- cumulative-table:start (python -m rollpacker.benchmarks.cumulative_table) -->"
END = "<!-- cumulative-table:end -->"
WIDTH = 118
"""Prose lines of the rendered text wrap at this width (the docs keep lines under 160 characters)."""
SIM_REFERENCE = "+ reward scheduler"
"""The simulated policy the measured ``tail`` column matches: every measured column scores each
response as it finishes (the reward scheduler is always on in the RL loop)."""

ROWS = [("training-loop time (s)", "loop_time", "{:.1f}"), ("speedup vs `tail`", "speedup", "{:.2f}"),
        ("gain over the column before", "step_gain", "{:.2f}"),
        ("training-loop time less TP switches (s)", "loop_less_switch", "{:.1f}"),
        ("gain over the column before, TP switches excluded", "gain_less_switch", "{:.2f}"),
        ("rollout, short rounds (s)", "rollout_short", "{:.1f}"), ("rollout, long rounds (s)", "rollout_long", "{:.1f}"),
        ("scoring (s)", ("split", "scoring"), "{:.1f}"), ("training (s)", ("split", "train"), "{:.1f}"),
        ("weight sync (s)", ("split", "weight_sync"), "{:.1f}"), ("rest of the step less TP switches (s)", "other_less_switch", "{:.1f}"),
        ("decode steps, short rounds", "short_decode_steps", "{:.0f}"),
        ("decode steps, long rounds", "long_decode_steps", "{:.0f}"),
        ("planner TP switches", "planner_switches", "{:.0f}"), ("engine switch time (s)", "engine_switch_s", "{:.1f}"),
        ("preemptions (planner's count)", "preemptions", "{:.0f}"),
        ("engines released to the trainer", "released_engines", "{:.0f}"),
        ("stream: training hidden under rollout (s)", "stream_hidden_train_s", "{:.1f}"),
        ("stream: training after rollout end (s)", "stream_exposed_train_s", "{:.1f}"),
        ("accepted draft tokens", "accepted_tokens", "{:.0f}"), ("draft acceptance", "acceptance", "{:.3f}"),
        ("train reward (mean)", "train_reward", "{:.3f}"), ("val pass@1 (end)", "pass@1", "{:.3f}")]
"""(title, figure key, format) of each measured row; a tuple key reads ``fig[a][b]``; per run totals."""


def cell(values: list, fmt: str) -> str:
    """``median [min-max]`` of the numbers among ``values``, just the median when the range
    prints as one number, '-' when there are none."""
    values = [v for v in values if isinstance(v, (int, float))]
    if not values:
        return "-"
    med, lo, hi = (fmt.format(x) for x in (statistics.median(values), min(values), max(values)))
    return med if lo == hi else f"{med} [{lo}-{hi}]"


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, break_on_hyphens=False, break_long_words=False)


def _value(fig: dict, key):
    return fig[key[0]][key[1]] if isinstance(key, tuple) else fig.get(key)


def derived_runs(result: dict) -> list[dict[str, dict]]:
    """Every run's figures plus the loop time less the planner's TP switches (``engine_switch_s``:
    a later column pays them too, and their length varies more than the other mechanisms' effect),
    the gain over the column before on that time, and the step's rest less the switches."""
    names, runs = list(result["columns"]), []
    for cols in result["runs"].values():
        out, prev = {}, None
        for name in names:
            fig = dict(cols[name])
            fig["loop_less_switch"] = fig["loop_time"] - fig.get("engine_switch_s", 0.0)
            fig["other_less_switch"] = fig["split"]["other"] - fig.get("engine_switch_s", 0.0)
            fig["gain_less_switch"] = prev["loop_less_switch"] / fig["loop_less_switch"] if prev else 1.0
            out[name] = prev = fig
        runs.append(out)
    return runs


def losers(result: dict) -> list[tuple[str, list[float], list[float]]]:
    """(column, its gains over the column before, the same with TP switches excluded) of each
    column whose median gain is below 1: a mechanism that costs more than it saves in these runs."""
    runs = derived_runs(result)
    out = []
    for name in list(result["columns"])[1:]:
        gains = [cols[name]["step_gain"] for cols in runs]
        if statistics.median(gains) < 1.0:
            out.append((name, gains, [cols[name]["gain_less_switch"] for cols in runs]))
    return out


def render(result: dict) -> str:
    """The measured table, the verdict line and the simulated table of a recorded result."""
    names = list(result["columns"])
    runs = derived_runs(result)
    hw, model, args = result["hardware"], result["model"], result["args"]
    intro = (f"Measured on {hw['cpu']} ({hw['cores']} cores), {result['date_utc']}: model `{Path(model['path']).name}` "
             f"(weights sha256 `{model['weights_sha256'][:12]}`), {result['steps']} steps per run (P0={args['prompts_per_step']}, "
             f"R0={args['responses']}, max_new_tokens={args['max_new_tokens']}), {args['seeds']} seed(s) x {args['runs']} "
             f"pass(es) = {len(runs)} runs per column, interleaved. Median [range] over the runs; ratios within each "
             "(pass, seed); times are run totals. The command:")
    lines = [*_wrap(intro), "", "```bash", result["command"], "```", "",
             "| figure | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---:|" * len(names)]
    for title, key, fmt in ROWS:
        cells = [cell([_value(cols[n], key) for cols in runs], fmt) for n in names]
        if any(c != "-" for c in cells):
            lines.append(f"| {title} | " + " | ".join(cells) + " |")
    bad = losers(result)
    verdict = ("Costs more than it saves in these runs (median gain over the column before below 1): "
               + ("; ".join(f"`{n}` {cell(gains, '{:.2f}x')} ({cell(less, '{:.2f}x')} with TP switches excluded)"
                            for n, gains, less in bad) if bad else "none") + ".")
    lines += ["", *_wrap(verdict)]
    sim = result.get("simulated", {})
    if sim:
        recipes = list(sim)
        note = ("**Simulated, not measured**: `rollpacker.simulator` on the H800 clusters of the recipes below "
                "(its GPU cost model and paper-like lognormal lengths, eta_P = eta_R = 1.25, 40 steps, speculation at the "
                "acceptance measured above); mean step time, speedup over veRL's baseline and, in brackets, over "
                f"`{SIM_REFERENCE}` (tail batching with the reward scheduler, as the measured `tail` column):")
        lines += ["", *_wrap(note), "",
                  "| policy | " + " | ".join(f"`{Path(r).stem}`" for r in recipes) + " |", "|---|" + "---:|" * len(recipes)]
        for i, row in enumerate(sim[recipes[0]]):
            cells = []
            for r in recipes:
                s, tail = sim[r][i], next(x for x in sim[r] if x["policy"] == SIM_REFERENCE)
                cells.append(f"{s['step_s']:.1f} s, x{s['speedup']:.2f} (x{tail['step_s'] / s['step_s']:.2f})")
            lines.append(f"| {row['policy']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def update(page: str, result: dict) -> str:
    """``page`` with the text between the markers replaced by :func:`render`."""
    if START not in page or END not in page:
        raise ValueError(f"the page has no {START!r} ... {END!r} markers")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{render(result)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", nargs="?", default=str(REPO / "docs/results/cumulative.json"))
    parser.add_argument("page", nargs="?", default=str(REPO / "docs/results/cumulative.md"))
    args = parser.parse_args(argv)
    page = Path(args.page)
    page.write_text(update(page.read_text(), json.loads(Path(args.result).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
