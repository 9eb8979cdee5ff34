"""A timeline of a test run: which test ran when on which xdist worker, and each worker's collection.

Recorded only when ``TEST_TIMELINE`` names a file (``TEST_TIMELINE=/tmp/t.jsonl bash tests/run.sh``):
one JSON line per test (setup to teardown) and per worker's collection, appended with one
``write`` each so the two workers' lines never interleave. ``python -m tests.helpers.timeline FILE
[--png OUT] [--durations OUT]`` prints where the wall time went (each worker's busy and idle spans,
the modules that ran longest), draws the two workers' lanes and writes the
modules' seconds for ``tests/helpers/scheduling``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path

ENV = "TEST_TIMELINE"
"""The variable that names the timeline file; unset: nothing is recorded."""


def record(kind: str, start: float, end: float, **fields) -> None:
    """Append one span (wall-clock seconds since the epoch) when ``TEST_TIMELINE`` is set."""
    path = os.environ.get(ENV)
    if not path:
        return
    row = {"kind": kind, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "pid": os.getpid(),
           "start": start, "end": end,
           "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" (")[0], **fields}
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def now() -> float:
    return time.time()


# ----------------------------------------------------------------------------- the summary
def load(path: str | Path) -> list[dict]:
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise SystemExit(f"{path}:{number}: not a JSON line ({err})") from None
    if not any(r["kind"] == "test" for r in rows):
        raise SystemExit(f"{path}: no test spans (was TEST_TIMELINE set for the run?)")
    return rows


def summarize(rows: list[dict], gap_s: float = 2.0) -> dict:
    """Per worker: collection, span, busy (inside tests), idle gaps longer than ``gap_s``; per
    module: seconds."""
    tests = [r for r in rows if r["kind"] == "test"]
    t0 = min(r["start"] for r in tests)
    end = max(r["end"] for r in tests)
    workers: dict[str, dict] = {}
    for worker in sorted({r["worker"] for r in tests}):
        own = sorted((r for r in tests if r["worker"] == worker), key=lambda r: r["start"])
        gaps, last = [], own[0]["start"]
        for r in own:
            if r["start"] - last > gap_s:
                gaps.append((round(last - t0, 1), round(r["start"] - last, 1)))
            last = max(last, r["end"])
        collect = [r for r in rows if r["kind"] == "collect" and r["worker"] == worker]
        workers[worker] = {"collect_s": round(sum((r["end"] - r["start"] for r in collect), 0.0), 1),
                           "first_s": round(own[0]["start"] - t0, 1), "last_s": round(last - t0, 1),
                           "busy_s": round(sum(r["end"] - r["start"] for r in own), 1),
                           "idle_before_end_s": round(end - last, 1), "gaps": gaps}
    modules: dict[str, float] = defaultdict(float)
    for r in tests:
        modules[r["nodeid"].split("::")[0]] += r["end"] - r["start"]
    return {"wall_s": round(end - t0, 1), "workers": workers,
            "modules": dict(sorted(((m, round(s, 1)) for m, s in modules.items()), key=lambda kv: -kv[1]))}


def over_record(modules: dict[str, float], recorded: dict[str, float], factor: float,
                floor_s: float = 10.0) -> list[tuple[str, float, float]]:
    """``(module, seconds, recorded seconds)`` of each module that took more than ``factor`` times its
    record (and at least ``floor_s`` more: a 2 s module at 5 s is not news), slowest first."""
    slow = [(m, s, recorded[m]) for m, s in modules.items()
            if m in recorded and s > factor * recorded[m] and s - recorded[m] >= floor_s]
    return sorted(slow, key=lambda row: -row[1] / max(row[2], 0.1))


def draw(rows: list[dict], png: Path, top: int = 12) -> None:
    """One lane per worker: its collection, then its tests, the longest ``top`` modules coloured and named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tests = [r for r in rows if r["kind"] == "test"]
    t0 = min(r["start"] for r in rows if r["kind"] in ("test", "collect"))
    lanes = sorted({r["worker"] for r in tests})
    named = list(summarize(rows)["modules"])[:top]
    colours = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.9 * len(lanes)))
    for y, worker in enumerate(lanes):
        for r in (r for r in rows if r["worker"] == worker):
            left, width = r["start"] - t0, r["end"] - r["start"]
            if r["kind"] == "test":
                module = r["nodeid"].split("::")[0]
                colour = colours(named.index(module)) if module in named else "0.8"
                ax.barh(y, width, left=left, height=0.6, color=colour, edgecolor="none")
            elif r["kind"] == "collect":
                ax.barh(y, width, left=left, height=0.6, color="black", edgecolor="none")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(i)) for i in range(len(named))]
    ax.legend(handles + [plt.Rectangle((0, 0), 1, 1, color="black")],
              [m.replace("tests/", "") for m in named] + ["collection"],
              fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_title("tests/run.sh: tests per xdist worker (seconds since the first worker started collecting)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("timeline", help="the file TEST_TIMELINE named")
    parser.add_argument("--png", type=Path, help="also draw the workers' lanes here")
    parser.add_argument("--modules", type=int, default=15, help="modules to list (longest first)")
    parser.add_argument("--durations", type=Path,
                        help="write each module's seconds here (tests/module_durations.json: the order "
                             "tests/helpers/scheduling hands modules out in)")
    parser.add_argument("--over-record", type=float, metavar="FACTOR",
                        help="list the modules that took more than FACTOR times their seconds in "
                             "tests/module_durations.json (what a loaded machine or a slower CPU moved)")
    args = parser.parse_args(argv)
    rows = load(args.timeline)
    summary = summarize(rows)
    print(f"wall {summary['wall_s']} s from the first test's start to the last test's end")
    for worker, w in summary["workers"].items():
        idle = sum(g[1] for g in w["gaps"])
        print(f"  {worker}: collection {w['collect_s']} s, tests {w['first_s']}-{w['last_s']} s, busy {w['busy_s']} s, idle gaps {idle:.1f} s "
              f"({len(w['gaps'])}), done {w['idle_before_end_s']} s before the end")
    print("longest modules (s):")
    for module, seconds in list(summary["modules"].items())[:args.modules]:
        print(f"  {seconds:7.1f}  {module}")
    if args.over_record:
        from tests.helpers.scheduling import load_durations

        slow = over_record(summary["modules"], load_durations(), args.over_record)
        unknown = [m for m in summary["modules"] if m not in load_durations()]
        print(f"modules over {args.over_record:g}x their recorded seconds: {len(slow)}"
              + (f"; not recorded: {', '.join(unknown)}" if unknown else ""))
        for module, seconds, recorded in slow:
            print(f"  {seconds:7.1f} s, recorded {recorded:.1f} s ({seconds / max(recorded, 0.1):.1f}x)  {module}")
    if args.durations:
        args.durations.write_text(json.dumps(summary["modules"], indent=1) + "\n")
        print(f"wrote {args.durations} ({len(summary['modules'])} modules)")
    if args.png:
        draw(rows, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
