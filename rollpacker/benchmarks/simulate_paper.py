"""``rollpacker-simulate --paper-check [--record PATH]``: the simulator against the paper's
figures (``rollpacker.simulator.paper_check``), printed per size with a PASS/MISS per judged bar,
the baseline's phase split beside the paper's, and the sensitivity table; ``--record`` writes the
results file (``docs/results/simulator_paper.json``) that ``python -m megatron_rl.tools.results_tables``
renders into docs/simulator.md.
"""
from __future__ import annotations

from rollpacker.simulator import paper_check as pc

COLUMNS = [s.size.upper() for s in pc.SIZES]
CHECK_ROWS = [("tail batching alone (x)", "tail batching"), ("+ reward scheduler (x)", "+ reward scheduler"),
              ("+ planner (x)", "+ planner"), ("+ stream trainer = total (x)", "+ stream trainer"),
              ("baseline iteration (s)", "baseline_s"), ("eta = 1.25, all on: iteration (s)", "eta_s")]
NEAREST = "a miss's nearest input: "
"""Rows naming, per missed bar, the input whose range end moves it closest to the paper's figure."""
SPLIT_ROW = "baseline split rollout / reward / train"
"""The paper measured 72/5/23 % (math) and 66/13/21 % (code) on veRL at 14B."""


def _fmt(key: str, value: float) -> str:
    return f"{value:.0f} s" if key.endswith("_s") else f"{value:.2f}"


def summary(check: dict, sens: dict) -> dict[str, dict[str, str]]:
    """``{row title: {column: cell}}`` of both views, from the raw figures (what the docs show)."""
    out: dict[str, dict[str, str]] = {}
    for title, key in CHECK_ROWS:
        out[title] = {}
        for size, col in zip(check, COLUMNS):
            sim = check[size][key]
            err, verdict = pc.verdict(size, key, sim)
            cell = f"{_fmt(key, sim)} vs {_fmt(key, pc.paper_figures(size)[key])} ({err:+.0%})"
            if verdict != "shown":
                cell += f" {verdict}"
            out[title][col] = cell
    for title, key in CHECK_ROWS:
        if key in pc.TOLERANCE:
            out[f"{NEAREST}{title}"] = {
                col: pc.explain(size, key, check[size][key], sens)
                if pc.verdict(size, key, check[size][key])[1] == "MISS" else "-" for size, col in zip(check, COLUMNS)}
    out[SPLIT_ROW] = {col: "/".join(f"{check[size]['shares'][k]:.0%}".rstrip("%") for k in ("rollout", "reward", "train")) + " %"
                      for size, col in zip(check, COLUMNS)}
    for title, name, low, high in pc.SENSITIVITY:
        for fig_title, key in pc.SENSITIVITY_FIGURES:
            row = f"{title} {low:g} .. {high:g}: {fig_title}"
            out[row] = {col: f"{_fmt(key, check[size][key])} [{_fmt(key, sens[size][name]['low'][key])} .. "
                             f"{_fmt(key, sens[size][name]['high'][key])}]" for size, col in zip(check, COLUMNS)}
    return out


def compute(steps: int, seed: int) -> tuple[dict, dict]:
    return pc.check(steps, seed), pc.sensitivity(steps, seed)


def print_report(check: dict, sens: dict) -> None:
    table = summary(check, sens)
    print("paper setup per size: the mixed recipe's GPUs, rollout TP, max response and P0 x R0; the paper's training "
          "(TP, PP, CP), full recompute; reward mix 1/3 math-verify, 1/3 code sandbox, 1/3 LLM judge on the recipe's "
          "workers, synchronous in the baseline and tail batching alone; nominal inputs "
          + ", ".join(f"{k} {v:g}" for k, v in pc.nominal_inputs().items()))
    print(f"bars judged: tail batching alone within {pc.TOLERANCE['tail batching']:.0%}, total within "
          f"{pc.TOLERANCE['+ stream trainer']:.0%}, baseline iteration within {pc.TOLERANCE['baseline_s']:.0%}")
    width = max(len(t) for t in table)
    check_titles = [t for t in table if t in dict(CHECK_ROWS) or t.startswith(NEAREST) or t == SPLIT_ROW]
    for title in check_titles:
        print(f"{title:<{width}}  " + "  |  ".join(f"{c}: {table[title][c]}" for c in COLUMNS))
    print("\nsensitivity: figure at the nominal inputs [input at its low end .. at its high end]")
    for title in [t for t in table if t not in check_titles]:
        print(f"{title:<{width}}  " + "  |  ".join(f"{c}: {table[title][c]}" for c in COLUMNS))
    print("the paper's veRL split at 14B: 72/5/23 % (math), 66/13/21 % (code)")
    misses = sum(pc.verdict(size, key, check[size][key])[1] == "MISS" for size in check for key in pc.TOLERANCE)
    print(f"\npaper check: {len(check) * len(pc.TOLERANCE) - misses} of {len(check) * len(pc.TOLERANCE)} bars pass")


def record(path: str, check: dict, sens: dict, steps: int, seed: int, command: str) -> None:
    from megatron_rl.tools.results_record import write_record

    table = summary(check, sens)
    rows = [{"title": t} for t in table]
    check_titles = [t for t in table if t in dict(CHECK_ROWS) or t.startswith(NEAREST) or t == SPLIT_ROW]
    write_record(path, name="simulator_paper", command=command, columns=COLUMNS, rows=rows,
                 runs={f"seed {seed}, {steps} steps": {col: {**check[size], "sensitivity": sens[size]}
                                                       for size, col in zip(check, COLUMNS)}},
                 extra={"title": "The simulator against the paper", "label_header": "figure", "summary": table,
                        "steps": steps, "seed": seed, "inputs": pc.nominal_inputs(),
                        "runs_note": "simulated (H800 cost model), not measured; simulated vs paper (error)",
                        "views": {"check": check_titles, "sensitivity": [t for t in table if t not in check_titles]}})
