"""Modules go to tests/run.sh's xdist workers longest first (tests/helpers/scheduling)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import scheduling
from tests.helpers.scheduling import run_sh_worker_options

REPO = Path(__file__).resolve().parents[2]


def _items(*nodeids):
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_modules_are_regrouped_longest_first_unknown_ones_before_them():
    items = _items("a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "c.py::t2", "d.py::t1", "e.py::t1")
    ordered = scheduling.longest_first(items, {"a.py": 1.0, "b.py": 300.0, "c.py": 20.0, "e.py": 20.0})
    assert [i.nodeid for i in ordered] == ["d.py::t1", "b.py::t1", "c.py::t1", "c.py::t2", "e.py::t1",
                                           "a.py::t1", "a.py::t2"]


def test_the_recorded_durations_name_existing_modules_with_seconds(tmp_path):
    durations = scheduling.load_durations()
    assert durations, f"{scheduling.DURATIONS} is missing or empty"
    missing = [m for m in durations if not (REPO / m).is_file()]
    assert not missing, f"{scheduling.DURATIONS} names modules that do not exist: {missing}"
    bad = tmp_path / "d.json"
    bad.write_text(json.dumps({"tests/x.py": "long"}))
    with pytest.raises(ValueError, match=r"d.json: seconds must be non-negative numbers; not for \['tests/x.py'\]"):
        scheduling.load_durations(bad)


CONFTEST = '''
import pytest
from tests.helpers import scheduling

DURATIONS = {"test_long.py": 100.0, "test_mid.py": 50.0}

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return scheduling.make_scheduler(config, log)

def pytest_collection_modifyitems(config, items):
    items[:] = scheduling.longest_first(items, {**DURATIONS, **{m: 1.0 for m in ("test_a.py", "test_b.py")}})
'''

MODULE = '''
import os, time

def _record(name):
    with open(os.path.join(os.path.dirname(__file__), "ran.txt"), "a") as f:
        f.write(f"{{__name__}} {{name}} {{os.environ['PYTEST_XDIST_WORKER']}} {{time.time()}}\\n")

''' + "{tests}"


def _module(count: int, sleep_s: float) -> str:
    return MODULE.format(tests="".join(f"def test_{i}():\n    _record('test_{i}')\n    time.sleep({sleep_s})\n\n"
                                       for i in range(count)))


def test_two_workers_start_with_the_two_longest_modules(tmp_path):
    """Under xdist's own order the many-test modules would go first (it sorts by test count)."""
    # Run from the repository's root (`python -m` puts it on the path: the generated conftest imports
    # tests.helpers), on the generated modules only, with an empty ini of their own.
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_long.py").write_text(_module(1, 1.0))
    (tmp_path / "test_mid.py").write_text(_module(2, 0.3))
    for name in ("test_a", "test_b"):
        (tmp_path / f"{name}.py").write_text(_module(8, 0.0))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", str(tmp_path / "pytest.ini"), *run_sh_worker_options(), str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    assert len(rows) == 1 + 2 + 16, rows
    first = {}
    for module, _, worker, _ in sorted(rows, key=lambda r: float(r[3])):
        first.setdefault(worker, module)
    assert sorted(first.values()) == ["test_long", "test_mid"], rows
