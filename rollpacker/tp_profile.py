"""Rollout-TP profiles: measured rollout seconds per round type and TP, for the planner's first
choice (``planner.profile``; the paper starts each round type at the TP a profile says is
fastest, then adapts online).

A profile is JSON ``{"short": {"1": 2.9, "2": 3.4}, "long": {"1": 7.8, "2": 6.1}}``. Make one
from earlier runs with ``rollpacker-rollout-profile --run runs/a --run runs/b --out
profile.json``: every step of those runs contributes its ``time/rollout`` under its round type
and the rollout TP it ran at (``planner/rollout_tp`` in elastic runs, else the run's
``rollout.tensor_parallel_size``), and each (round type, TP) gets the mean.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

Profile = dict[str, dict[int, float]]
"""round type -> {rollout TP: mean rollout seconds}."""


class ProfileError(ValueError):
    """A profile or a run directory that cannot be read; the message names the file and key."""


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile file (see the module docstring)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile file") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or not raw:
        raise ProfileError(f"{path}: expected an object of round type -> {{tp: seconds}}, got {type(raw).__name__}")
    profile: Profile = {}
    for kind, times in raw.items():
        if not isinstance(times, dict) or not times:
            raise ProfileError(f"{path}: {kind!r}: expected a non-empty object of tp -> seconds")
        profile[kind] = {}
        for tp, seconds in times.items():
            if not str(tp).isdigit() or int(tp) < 1:
                raise ProfileError(f"{path}: {kind!r}: TP {tp!r} is not a positive integer")
            if not isinstance(seconds, (int, float)) or seconds <= 0:
                raise ProfileError(f"{path}: {kind!r} TP {tp}: seconds must be a positive number, got {seconds!r}")
            profile[kind][int(tp)] = float(seconds)
    return profile


def fastest_tp(profile: Profile, sizes: list[int]) -> dict[str, int]:
    """Round type -> the legal TP (one of ``sizes``) with the smallest profiled rollout time
    (ties: the smaller TP). Raises ValueError when a round type has no legal TP profiled."""
    out = {}
    for kind, times in profile.items():
        usable = {tp: t for tp, t in times.items() if tp in sizes}
        if not usable:
            raise ValueError(f"elastic TP: profile for {kind!r} rounds has no legal TP "
                             f"(profiled {sorted(times)}, legal {sizes})")
        out[kind] = min(usable, key=lambda tp: (usable[tp], tp))
    return out


def profile_from_runs(run_dirs: list[str | Path]) -> tuple[Profile, dict[str, dict[int, int]]]:
    """Mean ``time/rollout`` per (round type, rollout TP) over every step of ``run_dirs``
    (each with metrics.jsonl and config.json). Returns the profile and the step counts."""
    sums: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for run in map(Path, run_dirs):
        config, metrics = run / "config.json", run / "metrics.jsonl"
        for needed in (config, metrics):
            if not needed.is_file():
                raise ProfileError(f"{needed}: missing (pass run directories written by train.py)")
        base_tp = int(json.loads(config.read_text())["rollout"]["tensor_parallel_size"])
        for line_no, line in enumerate(metrics.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "round_type" not in row or "time/rollout" not in row:
                raise ProfileError(f"{metrics}:{line_no}: row lacks 'round_type' or 'time/rollout'")
            tp = int(row.get("planner/rollout_tp", base_tp))
            sums[row["round_type"]][tp] += float(row["time/rollout"])
            counts[row["round_type"]][tp] += 1
    if not counts:
        raise ProfileError(f"no steps in {[str(r) for r in run_dirs]}")
    profile = {kind: {tp: sums[kind][tp] / n for tp, n in sorted(per_tp.items())} for kind, per_tp in counts.items()}
    return profile, {kind: dict(per_tp) for kind, per_tp in counts.items()}


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write ``profile`` as JSON (TP keys as strings)."""
    Path(path).write_text(json.dumps({k: {str(tp): t for tp, t in v.items()} for k, v in profile.items()}, indent=2))
