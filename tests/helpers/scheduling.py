"""The order in which tests/run.sh's xdist workers take the test modules: longest first.

``--dist loadfile`` keeps a module on one worker. Left to itself, xdist hands modules out sorted
by their number of tests, so the one-test training-job modules (the longest: minutes each) come
last and the run ends with one worker on a long module and the other idle. Here modules go out
longest first, by the seconds ``tests/module_durations.json`` records for them (written from a
run's timeline: ``python -m tests.helpers.timeline FILE --durations tests/module_durations.json``),
so the short modules fill the end. A module the file does not know goes first: it may be long.

A worker is also given its next module only when its current one is down to the test it holds
back (an xdist worker runs a test once it knows the next one, for the fixtures' teardown), not
two tests ahead as xdist does: a long test near a module's end then no longer keeps a second long
module waiting on a busy worker while the other worker runs out of work.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

DURATIONS = Path(__file__).resolve().parents[1] / "module_durations.json"
"""Seconds per test module (setup to teardown, summed) from a recorded run."""


def run_sh_worker_options() -> list[str]:
    """The ``workers=(...)`` array of tests/run.sh (its xdist options), with the default worker count."""
    text = (Path(__file__).resolve().parents[1] / "run.sh").read_text()
    match = re.search(r"^workers=\((.*)\)$", text, re.M)
    assert match, "tests/run.sh has no `workers=(...)` line"
    return re.sub(r'"\$\{TEST_WORKERS:-(\d+)\}"', r"\1", match.group(1)).split()  # the default, whatever it is


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """``{module path: seconds}``; an absent file gives ``{}`` (every module unknown: file order)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    bad = [k for k, v in data.items() if not isinstance(v, (int, float)) or v < 0]
    if bad:
        raise ValueError(f"{path}: seconds must be non-negative numbers; not for {bad[:3]}")
    return data


def module_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def longest_first(items: list, durations: dict[str, float]) -> list:
    """``items`` regrouped module by module, unknown modules first, then the longest recorded;
    a module's own tests keep their order, and modules of equal rank keep theirs."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(module_of(item.nodeid), len(first_seen))

    def rank(item) -> tuple[float, int]:
        module = module_of(item.nodeid)
        return -durations.get(module, float("inf")), first_seen[module]

    return sorted(items, key=rank)  # stable: a module's tests stay in file order


def make_scheduler(config, log):
    """``--dist loadfile`` with the collection's order kept (:func:`longest_first` made it) and the
    next module handed out only at a module's last test."""
    from xdist.scheduler import LoadFileScheduling

    class LongestFirstFileScheduling(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # keep the collection's (longest-first) order

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) > 1:  # more than the test held back
                return
            self._assign_work_unit(node)

    return LongestFirstFileScheduling(config, log)
