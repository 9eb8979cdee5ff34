"""tests/run.sh fails a run that prints noise (tests/helpers/noise): a task destroyed while pending, a
task's exception never retrieved, an exception Python could not raise. Each case runs in a pytest
process of its own on a generated module, recorded as tests/run.sh records a run; a clean module passes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import noise

REPO = Path(__file__).resolve().parents[2]

CONFTEST = '''
import importlib.util

# tests/helpers/noise.py by its path (this generated tree is not the repository).
_spec = importlib.util.spec_from_file_location("noise", {path!r})
noise = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(noise)

def pytest_configure(config):
    noise.install()

def pytest_sessionstart(session):
    noise.watch_unraisable()

def pytest_sessionfinish(session, exitstatus):
    noise.flush()
'''

CASES = {
    # A loop closed with a task still running on it (what tests/helpers/fake_engine.py's ticker did).
    "pending task": '''
import asyncio

def test_it():
    loop = asyncio.new_event_loop()
    async def forever():
        while True:
            await asyncio.sleep(0)
    loop.run_until_complete(asyncio.sleep(0, loop.create_task(forever())))
    loop.close()
''',
    # Two failing tasks, one awaited (what the trainer's reward tasks did when the pool gave out).
    "unretrieved exception": '''
import asyncio

async def fail():
    raise RuntimeError("lost")

def test_it():
    async def main():
        first, second = asyncio.ensure_future(fail()), asyncio.ensure_future(fail())
        try:
            await first
        except RuntimeError:
            pass
        await asyncio.sleep(0)
    asyncio.run(main())
''',
    "unraisable exception": '''
class Bad:
    def __del__(self):
        raise ValueError("in __del__")

def test_it():
    Bad()
''',
}

CLEAN = '''
import asyncio

def test_it():
    async def main():
        task = asyncio.ensure_future(asyncio.sleep(0))
        await task
    asyncio.run(main())
'''


def _run(tmp_path: Path, module: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.format(path=str(REPO / "tests" / "helpers" / "noise.py")))
    (tmp_path / "test_generated.py").write_text(module)
    record, log = tmp_path / "noise.tsv", tmp_path / "pytest.log"
    # tests/run.sh ignores UserWarnings (vLLM's and Megatron's), pytest's unraisable-exception warning among them.
    env = {**os.environ, noise.ENV: str(record), "PYTHONWARNINGS": "ignore::UserWarning"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    log.write_text(run.stdout + run.stderr)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]  # the test itself passes
    return subprocess.run([sys.executable, "-m", "tests.helpers.noise", "--record", str(record), str(log)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_passing_run_with_noise_fails_the_check(tmp_path, kind):
    check = _run(tmp_path, CASES[kind])
    assert check.returncode == 1, check.stderr
    assert f"  {kind} " in check.stderr, check.stderr


def test_a_quiet_run_passes_the_check(tmp_path):
    check = _run(tmp_path, CLEAN)
    assert check.returncode == 0 and not check.stderr, check.stderr


def test_the_scan_names_each_kind_and_skips_its_own_report():
    lines = ["Task was destroyed but it is pending!", "Future exception was never retrieved",
             "Exception ignored in: <function Bad.__del__>", "ResourceWarning: unclosed file <_io.TextIOWrapper>",
             "RuntimeWarning: coroutine 'main' was never awaited", "tests/run.sh: noise in the test run (3): ...",
             "12 passed in 3.0s"]
    assert [kind for _, kind, _ in noise.scan(lines)] == [
        "pending task", "unretrieved exception", "unraisable exception", "unclosed resource", "coroutine never awaited"]


def test_run_sh_runs_the_check_after_every_run():
    text = (REPO / "tests" / "run.sh").read_text()
    assert 'tee -a "$RUN_LOG"' in text and "-m tests.helpers.noise --record" in text
    assert text.count("\nafter_run \"$rc\" 1") == 1 and text.count("  after_run \"$rc\" 0") == 1  # whole suite, with arguments
