"""The test run's timeline (tests/helpers/timeline): spans recorded, lock waits seen, summary sums."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import timeline


def _span(worker, nodeid, start, end):
    return {"kind": "test", "worker": worker, "start": start, "end": end, "nodeid": nodeid, "test": ""}


def test_nothing_is_recorded_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    timeline.record("test", 1.0, 2.0, nodeid="x")
    assert list(tmp_path.iterdir()) == []


def test_the_summary_finds_idle_gaps_the_tail_and_the_longest_module():
    rows = [_span("gw0", "tests/a.py::t1", 100.0, 110.0), _span("gw0", "tests/a.py::t2", 110.0, 130.0),
            _span("gw1", "tests/b.py::t1", 100.0, 105.0), _span("gw1", "tests/c.py::t1", 115.0, 120.0),
            {"kind": "collect", "worker": "gw1", "start": 95.0, "end": 99.0, "test": ""}]
    summary = timeline.summarize(rows)
    assert summary["wall_s"] == 30.0
    assert summary["workers"]["gw0"] == {"collect_s": 0.0, "first_s": 0.0, "last_s": 30.0, "busy_s": 30.0, "idle_before_end_s": 0.0,
                                         "gaps": []}
    gw1 = summary["workers"]["gw1"]
    assert gw1["gaps"] == [(5.0, 10.0)] and gw1["idle_before_end_s"] == 10.0 and gw1["busy_s"] == 10.0
    assert gw1["collect_s"] == 4.0
    assert list(summary["modules"].items()) == [("tests/a.py", 30.0), ("tests/b.py", 5.0), ("tests/c.py", 5.0)]


def test_the_command_prints_the_summary_and_draws_the_lanes(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"kind": "collect", "worker": "gw1", "start": -4.0, "end": -1.5, "test": ""},
        _span("gw0", "tests/a.py::t1", 0.0, 50.0), _span("gw1", "tests/b.py::t1", 0.0, 20.0))))
    out = subprocess.run([sys.executable, "-m", "tests.helpers.timeline", str(path), "--png", str(tmp_path / "t.png")],
                         capture_output=True, text=True, cwd=os.getcwd(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "wall 50.0 s" in out.stdout and "gw1: collection 2.5 s, tests 0.0-20.0 s" in out.stdout and "done 30.0 s before" in out.stdout
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_a_file_without_test_spans_is_refused_naming_it(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("not json\n")
    out = subprocess.run([sys.executable, "-m", "tests.helpers.timeline", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and f"{path}:1: not a JSON line" in out.stderr


def test_modules_over_their_record_are_listed_slowest_first():
    modules = {"tests/a.py": 100.0, "tests/b.py": 30.0, "tests/c.py": 5.0, "tests/d.py": 41.0, "tests/new.py": 9.0}
    recorded = {"tests/a.py": 40.0, "tests/b.py": 20.0, "tests/c.py": 1.0, "tests/d.py": 20.0}
    # a: 2.5x; d: 2.05x; b: 1.5x (under); c: 5x but only 4 s more (under the floor); new: no record.
    assert timeline.over_record(modules, recorded, 2.0) == [("tests/a.py", 100.0, 40.0), ("tests/d.py", 41.0, 20.0)]
