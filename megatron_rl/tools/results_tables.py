"""Renders every results file in docs/results/ into its table in the docs.

A page shows a results file between two marker comments; the name is the file's stem, optionally
followed by ``:VIEW`` (a subset of the rows, listed in the file's ``views``)::

    <!-- results:peers -->
    ... generated ...
    <!-- /results:peers -->

    python -m megatron_rl.tools.results_tables          # rewrite every page's tables (and the fault table)
    python -m megatron_rl.tools.results_tables --check  # exit 1 naming each stale page

A results file (written by a benchmark's ``--record PATH``, see :mod:`megatron_rl.tools.results_record`,
or transcribed from older docs, ``"source": "transcribed from docs"``) holds the provenance
(``command``, ``date``, ``commit``, ``hardware``, ``model``), the ``columns``, the ``rows`` (title,
figure key, format) and either ``runs`` (raw figures per run: ``{run label: {column: figures}}``,
each cell the median [range] over runs) or, where the raw runs were not kept, ``summary``
(``{row title: {column: cell}}``, a cell a number, ``[median, min, max]``, text or null). A file
with ``"joins": NAME`` has no block of its own: its rows follow NAME's in NAME's table.
tests/unit/test_results_tables.py fails when a page and its file disagree.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
FAULTS = RESULTS / "faults.json"
FAULTS_PAGE = REPO / "docs" / "faults.md"
_BLOCK = re.compile(r"<!-- results:([\w.-]+)(?::([\w.-]+))? -->\n.*?<!-- /results:\1(?::\2)? -->", re.S)


def pages(repo: Path = REPO) -> list[Path]:
    """The pages that may show results: README.md and docs/*.md."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def _figure(figures: dict, key):
    """``figures[key]``; a list key reads nested dicts (``["split", "train"]``)."""
    for part in key if isinstance(key, list) else [key]:
        if not isinstance(figures, dict):
            return None
        figures = figures.get(part)
    return figures


def _spread(values: list, fmt: str) -> str:
    """``median [min-max]`` of the numbers (the median alone when they agree), '-' without any."""
    values = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not values:
        return "-"
    med, lo, hi = statistics.median(values), min(values), max(values)
    return fmt.format(med) if lo == hi else f"{fmt.format(med)} [{fmt.format(lo)}-{fmt.format(hi)}]"


def _cell(value, fmt: str) -> str:
    """A transcribed cell: a number, [median, min, max], text, or null."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # kept as the page gave it: a range equal at the shown precision stays
        med, lo, hi = value
        return f"{fmt.format(med)} [{fmt.format(lo)}-{fmt.format(hi)}]"
    return fmt.format(value)


def _row_cells(result: dict, row: dict) -> list[str]:
    fmt = row.get("format", "{}")
    columns = result["columns"]
    if "runs" in result and "key" in row:
        runs = list(result["runs"].values())
        cells = []
        for column in columns:
            if isinstance(column, dict) and "ratio" in column:  # per run, one column's figure over another's
                num, den = column["ratio"]
                ratios = [a / b for a, b in ((_figure(r[num], row["key"]), _figure(r[den], row["key"])) for r in runs)
                          if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b]
                cells.append(_spread(ratios, column.get("format", "{:.2f}x")))
            else:
                name = _column_name(column)
                cells.append(_spread([_figure(r[name], row["key"]) for r in runs], _column_format(column, fmt)))
        return cells
    summary = result.get("summary", {}).get(row["title"])
    if summary is None:
        raise ValueError(f"results {result.get('name')!r}: row {row['title']!r} has neither runs nor a summary")
    return [_cell(summary.get(_column_name(c)), _column_format(c, fmt)) for c in columns]


def _column_name(column) -> str:
    return column["name"] if isinstance(column, dict) else column


def _column_format(column, row_format: str) -> str:
    """A column's own format (a ratio's, or one per column where each row is one case) before the row's."""
    return column.get("format", row_format) if isinstance(column, dict) else row_format


def provenance(result: dict, link_prefix: str = "") -> str:
    """The lines under a table: the command, the machine, the model, and the file with the rest
    (commit, date, model hash, raw figures): a page names no commit, the file does."""
    parts = [f"`{result['command']}`" if result.get("command") else "command not recorded",
             f"on {result['hardware']}" if result.get("hardware") else "machine not recorded"]
    model = result.get("model") or {}
    if model.get("path"):
        parts.append(f"model {model['path']}")
    if result.get("runs_note"):
        parts.append(result["runs_note"])
    source = " (transcribed from older docs)" if result.get("source") == "transcribed from docs" else ""
    line = (f"From {'; '.join(parts)}. Commit, date, model hash and raw figures{source}: "
            f"[{result['name']}.json]({link_prefix}results/{result['name']}.json).")
    return textwrap.fill(line, width=150, break_long_words=False, break_on_hyphens=False)


def _view_rows(result: dict, view: str | None) -> list[dict]:
    rows = result["rows"]
    if view is None:
        return rows
    wanted = result.get("views", {}).get(view)
    if wanted is None:
        raise ValueError(f"results {result['name']!r} has no view {view!r} (views: {sorted(result.get('views', {}))})")
    return [r for r in rows if r["title"] in wanted]


def _joined_rows(result: dict, joined: dict, view: str | None) -> list[str]:
    """Table lines of ``joined``'s rows under ``result``'s columns (matched by name; '-' where it has none)."""
    names = [_column_name(c) for c in joined["columns"]]
    rows = _view_rows(joined, view) if view is None or view in joined.get("views", {}) else []
    lines = []
    for row in rows:
        by_name = dict(zip(names, _row_cells(joined, row)))
        lines.append(f"| {row['title']} | " + " | ".join(by_name.get(_column_name(c), "-") for c in result["columns"]) + " |")
    return lines


def render(result: dict, view: str | None = None, link_prefix: str = "", joined: list[dict] = ()) -> str:
    """The markdown table of a results file (every row, or the rows of ``views[view]``) and its provenance.
    ``joined``: results files that ``"join"`` this one (figures of other runs for the same arms, e.g. the
    GPU-priced rows of ``rollpacker-price-benchmark``): their rows follow in the same table (in a view,
    the rows of their view of the same name), their provenance after this one's."""
    rows = _view_rows(result, view)
    if result.get("layout") == "list":  # long text figures: one wrapped bullet per row
        lines = [textwrap.fill(f"* **{row['title']}**: " + "; ".join(_row_cells(result, row)), width=150,
                               subsequent_indent="  ", break_long_words=False, break_on_hyphens=False) for row in rows]
        return "\n".join([*lines, "", provenance(result, link_prefix)])
    label = result.get("label_header", "metric")
    lines = [f"| {label} | " + " | ".join(_column_name(c) for c in result["columns"]) + " |",
             "| --- | " + " | ".join("---:" for _ in result["columns"]) + " |"]
    for row in rows:
        lines.append(f"| {row['title']} | " + " | ".join(_row_cells(result, row)) + " |")
    for other in joined:
        lines += _joined_rows(result, other, view)
    lines += ["", provenance(result, link_prefix)]
    lines += [line for other in joined for line in ("", provenance(other, link_prefix))]
    return "\n".join(lines)


OWN_TABLES = {"cumulative.json": "rollpacker.benchmarks.cumulative_table"}
"""Results files rendered by a generator of their own (a page of the plug-in's), checked by its own test."""


def load_results(results_dir: Path = RESULTS) -> dict[str, dict]:
    """Every ``*.json`` results file by name (the fault figures have a table of their own)."""
    found = {}
    for path in sorted(results_dir.glob("*.json")):
        if path.name == FAULTS.name or path.name in OWN_TABLES:
            continue
        data = json.loads(path.read_text())
        for key in ("columns", "rows"):
            if key not in data:
                raise ValueError(f"{path}: no {key!r}")
        data.setdefault("name", path.stem)
        found[path.stem] = data
    for name, data in found.items():
        if data.get("joins") is not None and data["joins"] not in found:
            raise ValueError(f"docs/results/{name}.json: joins {data['joins']!r}, which has no results file")
    return found


def update(page_text: str, results: dict[str, dict], link_prefix: str = "") -> str:
    """``page_text`` with every results block re-rendered; an unknown name fails naming it."""
    def block(match: re.Match) -> str:
        name, view = match.group(1), match.group(2)
        if name not in results:
            raise ValueError(f"<!-- results:{name} -->: no docs/results/{name}.json")
        marker = f"{name}:{view}" if view else name
        joined = [r for r in results.values() if r.get("joins") == name]
        return f"<!-- results:{marker} -->\n{render(results[name], view, link_prefix, joined)}\n<!-- /results:{marker} -->"
    return _BLOCK.sub(block, page_text)


def updated_pages(repo: Path = REPO) -> dict[Path, str]:
    """{page: its text as generated} for every page whose text would change."""
    from megatron_rl.tools import fault_table

    results = load_results(repo / "docs" / "results")
    changed = {}
    for page in pages(repo):
        text = page.read_text()
        new = update(text, results, "docs/" if page.parent == repo else "")
        faults = repo / "docs" / "results" / FAULTS.name
        if page.name == FAULTS_PAGE.name and page.parent.name == "docs" and faults.is_file():
            new = fault_table.update(new, json.loads(faults.read_text()))
        if new != text:
            changed[page] = new
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each stale page")
    parser.add_argument("--repo", type=Path, default=REPO, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    changed = updated_pages(args.repo)
    for page, text in changed.items():
        if args.check:
            print(f"stale: {page.relative_to(args.repo)} (run python -m megatron_rl.tools.results_tables)", file=sys.stderr)
        else:
            page.write_text(text)
            print(f"updated {page.relative_to(args.repo)}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
