"""The test run's timeline (tests/helpers/timeline): spans recorded, lock waits seen, summary sums."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.helpers import job_lock, timeline


def _span(worker, nodeid, start, end):
    return {"kind": "test", "worker": worker, "start": start, "end": end, "nodeid": nodeid, "test": ""}


def test_nothing_is_recorded_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    timeline.record("test", 1.0, 2.0, nodeid="x")
    assert list(tmp_path.iterdir()) == []


def test_a_wait_for_the_jobs_lock_is_recorded_with_the_test_that_waited(tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(timeline.ENV, str(path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    # Another process holds the lock exclusively for ~1.5 s; a job here must wait for it.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(job_lock.lock_path())!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.5)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with job_lock.shared_jobs():
        pass
    holder.wait(10)
    with job_lock.exclusive_jobs():  # free now: no wait recorded, the hold is
        time.sleep(0.1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["mode"]) for r in rows] == [("lock_wait", "shared"), ("lock_held", "exclusive")]
    wait = rows[0]
    assert 0.7 < wait["end"] - wait["start"] < 5, wait
    assert wait["test"].endswith("test_a_wait_for_the_jobs_lock_is_recorded_with_the_test_that_waited"), wait
    assert rows[1]["end"] - rows[1]["start"] >= 0.1


def test_the_summary_finds_idle_gaps_the_tail_and_the_longest_module():
    rows = [_span("gw0", "tests/a.py::t1", 100.0, 110.0), _span("gw0", "tests/a.py::t2", 110.0, 130.0),
            _span("gw1", "tests/b.py::t1", 100.0, 105.0), _span("gw1", "tests/c.py::t1", 115.0, 120.0),
            {"kind": "lock_wait", "worker": "gw1", "start": 105.0, "end": 115.0, "mode": "exclusive",
             "test": "tests/c.py::t1"}]
    summary = timeline.summarize(rows)
    assert summary["wall_s"] == 30.0
    assert summary["workers"]["gw0"] == {"collect_s": 0.0, "first_s": 0.0, "last_s": 30.0, "busy_s": 30.0, "idle_before_end_s": 0.0,
                                         "gaps": []}
    gw1 = summary["workers"]["gw1"]
    assert gw1["gaps"] == [(5.0, 10.0)] and gw1["idle_before_end_s"] == 10.0 and gw1["busy_s"] == 10.0
    assert list(summary["modules"].items()) == [("tests/a.py", 30.0), ("tests/b.py", 5.0), ("tests/c.py", 5.0)]
    assert summary["lock_waits"] == {"tests/c.py::t1 (exclusive)": 10.0}


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
