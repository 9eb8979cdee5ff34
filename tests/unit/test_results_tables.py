"""Every results table in the docs is what its file in docs/results/ holds (python -m megatron_rl.tools.results_tables)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_rl.tools import results_tables
from megatron_rl.tools.results_tables import load_results, main, render, update, updated_pages

REPO = Path(__file__).resolve().parents[2]


def test_every_page_matches_its_results_files():
    stale = sorted(str(p.relative_to(REPO)) for p in updated_pages(REPO))
    assert stale == [], f"stale tables (run python -m megatron_rl.tools.results_tables): {stale}"


def test_every_results_file_is_shown_and_carries_its_provenance():
    results = load_results()
    shown = set()
    for page in results_tables.pages():
        shown |= set(re.findall(r"<!-- results:([\w.-]+)", page.read_text()))
    shown |= {name for name, r in results.items() if r.get("joins") in shown}  # rows in the table they join
    assert set(results) <= shown, f"results files no page shows: {sorted(set(results) - shown)}"
    for name, result in results.items():
        assert result.get("command") and "hardware" in result and "commit" in result and "date" in result, name
        assert "runs" in result or result.get("source") in ("transcribed from docs", "computed"), \
            f"{name}: no raw runs and not marked transcribed or computed"


def _result(**extra) -> dict:
    return {"name": "demo", "command": "bench --x", "commit": "c", "date": "d", "hardware": "2 cores",
            "model": {"path": "m", "weights_sha256": "ab" * 32}, "columns": ["a", "b", {"name": "ratio", "ratio": ["a", "b"]}],
            "rows": [{"title": "loop (s)", "key": "loop", "format": "{:.1f}"},
                     {"title": "train (s)", "key": ["split", "train"], "format": "{:.1f}"}], **extra}


def test_a_table_from_raw_runs_is_median_and_range_with_ratios():
    runs = {"seed 1": {"a": {"loop": 10.0, "split": {"train": 2.0}}, "b": {"loop": 5.0, "split": {"train": 2.0}}},
            "seed 2": {"a": {"loop": 12.0, "split": {"train": 2.0}}, "b": {"loop": 4.0, "split": {"train": None}}}}
    table = render(_result(runs=runs))
    assert "| loop (s) | 11.0 [10.0-12.0] | 4.5 [4.0-5.0] | 2.50x [2.00x-3.00x] |" in table
    assert "| train (s) | 2.0 | 2.0 | 1.00x |" in table  # equal values: no range; a missing figure is skipped
    assert "`bench --x`" in table and "on 2 cores" in table and "[demo.json](results/demo.json)" in table
    assert "ab" * 32 not in table  # the page names no hash; the file holds it


def test_a_transcribed_table_keeps_the_cells_as_given():
    summary = {"loop (s)": {"a": [11.0, 10.0, 12.0], "b": 4.5, "ratio": None},
               "train (s)": {"a": [0.0, 0.0, 0.0], "b": "n/a", "ratio": None}}
    table = render(_result(summary=summary, source="transcribed from docs", views={"short": ["loop (s)"]}))
    assert "| loop (s) | 11.0 [10.0-12.0] | 4.5 | - |" in table
    assert "| train (s) | 0.0 [0.0-0.0] | n/a | - |" in table and "transcribed" in table
    short = render(_result(summary=summary, views={"short": ["loop (s)"]}), "short")
    assert "loop (s)" in short and "train (s)" not in short
    with pytest.raises(ValueError, match="no view 'long'"):
        render(_result(summary=summary), "long")
    with pytest.raises(ValueError, match="neither runs nor a summary"):
        render(_result(summary={}))


def test_a_joining_file_adds_its_rows_to_the_table_it_joins():
    base_runs = {"seed 1": {"a": {"loop": 10.0, "split": {"train": 2.0}}, "b": {"loop": 5.0, "split": {"train": 1.0}}}}
    priced = {**_result(runs={"seed 1": {"b": {"gpu": 2.0}, "a": {"gpu": 6.0}}, "seed 2": {"a": {"gpu": 8.0}, "b": {"gpu": 2.0}}}),
              "name": "demo_priced", "joins": "demo", "command": "price runs/x", "columns": ["a", "b"],
              "rows": [{"title": "GPU-priced (s)", "key": "gpu", "format": "{:.1f}"}], "views": {"short": ["GPU-priced (s)"]}}
    table = render(_result(runs=base_runs, views={"short": ["loop (s)"], "long": ["train (s)"]}), joined=[priced])
    lines = table.splitlines()
    assert lines.index("| GPU-priced (s) | 7.0 [6.0-8.0] | 2.0 | - |") == lines.index("| train (s) | 2.0 | 1.0 | 2.00x |") + 1
    assert "`bench --x`" in table and "`price runs/x`" in table and "[demo_priced.json](results/demo_priced.json)" in table
    base = _result(runs=base_runs, views={"short": ["loop (s)"], "long": ["train (s)"]})
    assert "GPU-priced" in render(base, "short", joined=[priced])  # its view of the same name
    assert "GPU-priced" not in render(base, "long", joined=[priced])  # a view it does not have: none of its rows


def test_update_and_check_rewrite_only_the_marked_blocks(tmp_path: Path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    summary = {"loop (s)": {"a": 1.0, "b": 2.0}, "train (s)": {"a": 3.0, "b": 4.0}}
    (tmp_path / "docs" / "results" / "demo.json").write_text(json.dumps(_result(summary=summary, views={"v": ["loop (s)"]})))
    (tmp_path / "README.md").write_text("top\n<!-- results:demo:v -->\nold\n<!-- /results:demo:v -->\nend\n")
    (tmp_path / "docs" / "p.md").write_text("x\n<!-- results:demo -->\n<!-- /results:demo -->\ny\n")
    assert main(["--check", "--repo", str(tmp_path)]) == 1
    assert main(["--repo", str(tmp_path)]) == 0 and main(["--check", "--repo", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("top\n") and readme.endswith("end\n") and "old" not in readme
    assert "(docs/results/demo.json)" in readme and "train (s)" not in readme  # the view, linked from the top level
    page = (tmp_path / "docs" / "p.md").read_text()
    assert "| train (s) | 3.0 | 4.0 | - |" in page and "(results/demo.json)" in page
    with pytest.raises(ValueError, match="no docs/results/gone.json"):
        update("<!-- results:gone -->\n<!-- /results:gone -->", {})
