"""tests/run.sh's xdist options keep each test module on one worker.

Module-scoped fixtures (an engine, an SPMD run, a Ray session) and tests that depend on the
order within their module (a fault test counting the restarts of the module's engine) break
when a module's tests spread over workers. This runs pytest with the worker options that
tests/run.sh passes, on two generated modules, and reads which worker ran each test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.scheduling import run_sh_worker_options

REPO = Path(__file__).resolve().parents[2]

MODULE = '''
import os

def _record(name):
    with open(os.path.join(os.path.dirname(__file__), "ran.txt"), "a") as f:
        f.write(f"{__name__} {name} {os.environ.get('PYTEST_XDIST_WORKER', 'none')}\\n")

''' + "".join(f"def test_{i}():\n    _record('test_{i}')\n\n" for i in range(6))


def test_run_sh_keeps_each_module_on_one_worker(tmp_path: Path) -> None:
    options = run_sh_worker_options()
    assert options[:2] == ["-n", "2"], options
    for name in ("test_first_module", "test_second_module"):
        (tmp_path / f"{name}.py").write_text(MODULE)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), *options],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    assert len(rows) == 12, rows
    workers: dict[str, set[str]] = {}
    for module, _, worker in rows:
        workers.setdefault(module, set()).add(worker)
    assert all(w != {"none"} for w in workers.values()), "the tests ran without xdist workers"
    spread = {m: sorted(w) for m, w in workers.items() if len(w) > 1}
    assert not spread, f"a module's tests ran on more than one worker: {spread}"

