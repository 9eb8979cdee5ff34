"""Renders docs/faults.md's list of faults from what the fault-injection tests measured.

The tests (tests/integration/test_faults.py) write one entry per fault to the JSON file named by
``FAULT_FIGURES``; this tool puts the table between the page's ``fault-table`` markers::

    FAULT_FIGURES=$PWD/docs/results/faults.json bash tests/run.sh tests/integration/test_faults.py
    python -m megatron_rl.tools.results_tables   # every generated table, this one included

tests/unit/test_fault_table.py fails when the page and the JSON file disagree.
"""
from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

START = "<!-- fault-table:start (python -m megatron_rl.tools.results_tables) -->"
END = "<!-- fault-table:end -->"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} s"


def _wrap(text: str) -> str:
    """One bullet, wrapped so that no line of the page passes 150 characters."""
    return textwrap.fill(text, width=150, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def render(figures: dict) -> str:
    """The list of faults (one bullet each) and the line naming the machine, for a figures file's content."""
    lines = []
    for f in figures["faults"]:
        test = f["test"].split("::")[-1]
        note = f"; {f['note']}" if f.get("note") else ""
        lines.append(_wrap(f"* **{f['fault']}**: {f['outcome']}. Detected in {_seconds(f['detect_s'])}, recovered / stopped in "
                           f"{_seconds(f['recover_s'])} (`{test}`{note})."))
    lines.append("")
    lines.append(_wrap(f"Measured on {figures.get('measured_on', 'an unrecorded machine')}."))
    bursts = figures.get("bursts", {})
    if bursts:
        lines += ["", "Reward pool under a burst of code responses (a share of them sandbox attacks):", ""]
        for name, b in bursts.items():
            lines.append(_wrap(
                f"* **{name}** (`{b['command']}`): {b['responses']} responses ({b['hostile']} attacks), {b['workers']} workers; "
                f"verdicts kept {b['verdicts']} of {b['responses']}, wrong verdicts {b['num_wrong']}; throughput "
                f"{b['throughput_per_s']:.1f} /s; queue wait mean / max {b['queue_wait_mean_s']:.1f} s / {b['queue_wait_max_s']:.1f} s; "
                f"driver RSS peak {b['driver_rss_peak_mb']:.0f} MB ({b['driver_rss_growth_kb_per_response']:.1f} kB growth per "
                f"response); workers RSS peak {b['workers_rss_peak_mb']:.0f} MB."))
    return "\n".join(lines)


def update(page: str, figures: dict) -> str:
    """``page`` with the text between the markers replaced by :func:`render`."""
    if START not in page or END not in page:
        raise ValueError(f"the page has no {START!r} ... {END!r} markers")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{render(figures)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figures", help="the JSON file the fault tests wrote (FAULT_FIGURES)")
    parser.add_argument("page", help="the markdown page to update (docs/faults.md)")
    args = parser.parse_args(argv)
    page = Path(args.page)
    page.write_text(update(page.read_text(), json.loads(Path(args.figures).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
