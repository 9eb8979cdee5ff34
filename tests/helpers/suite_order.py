"""The order test modules are handed to the xdist workers: whole training jobs first, then the
other real-stack modules, then the unit tests (each group in collection order).

Each worker takes the next module when it is nearly done with its current one (``--dist
loadfile``), so whatever runs last decides how long one worker sits idle while the other
finishes. A whole-job module (marker ``loop``) keeps about 1.2 of the 2 cores busy and lasts
minutes; hundreds of unit tests at the end keep both cores busy and finish within seconds of each
other. tests/run.sh passes ``--no-loadscope-reorder``: xdist's default re-sorts modules by their
number of tests, which puts the one-test job modules last.
"""
from __future__ import annotations

from typing import Sequence


def module_rank(item) -> int:
    """0: a whole-job module (marker ``loop``), 1: another real-stack module (``integration``), 2: the rest."""
    if item.get_closest_marker("loop") is not None:
        return 0
    if item.get_closest_marker("integration") is not None:
        return 1
    return 2


def heavy_first(items: Sequence) -> list:
    """``items`` reordered by :func:`module_rank`, keeping each module's tests together and in order
    (the rank of a module is that of its first test)."""
    first_rank: dict[str, int] = {}
    for item in items:
        first_rank.setdefault(item.nodeid.split("::", 1)[0], module_rank(item))
    return sorted(items, key=lambda item: first_rank[item.nodeid.split("::", 1)[0]])
