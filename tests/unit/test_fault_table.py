"""docs/faults.md's table is what the fault tests measured (docs/results/faults.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.tools.fault_table import END, START, main, render, update

REPO = Path(__file__).resolve().parents[2]


def test_docs_table_matches_the_measured_figures() -> None:
    figures = json.loads((REPO / "docs" / "results" / "faults.json").read_text())
    page = (REPO / "docs" / "faults.md").read_text()
    assert update(page, figures) == page, "docs/faults.md is stale: run python -m megatron_rl.tools.fault_table"
    assert {f["outcome"].split(":")[0] for f in figures["faults"]} <= {"recovered", "stopped cleanly"}
    for f in figures["faults"]:  # every figure names a test that exists
        path, name = f["test"].split("::")
        assert f"def {name}(" in (REPO / path).read_text(), f["test"]


def test_render_and_update(tmp_path: Path) -> None:
    figures = {"faults": [{"fault": "x killed", "outcome": "recovered", "detect_s": 0.44, "recover_s": None,
                           "test": "t.py::test_x", "note": "n"}], "measured_on": "box"}
    table = render(figures)
    assert "* **x killed**: recovered. Detected in 0.4 s, recovered / stopped in n/a (`test_x`; n)." in table
    assert "Measured on box." in table and max(len(line) for line in table.splitlines()) <= 150
    page = tmp_path / "p.md"
    page.write_text(f"intro\n{START}\nold\n{END}\nrest\n")
    (tmp_path / "f.json").write_text(json.dumps(figures))
    assert main([str(tmp_path / "f.json"), str(page)]) == 0
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("\nrest\n") and "old" not in text and table in text
    with pytest.raises(ValueError, match="markers"):
        update("no markers", figures)
