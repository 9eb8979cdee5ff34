"""Where a command's CPU goes, by process: every process of the machine sampled while the command runs.

    python -m tests.helpers.cpu_census [--period 1.0] [--out census.jsonl] [--top 25] -- bash tests/run.sh tests/integration/test_x.py

On the 2-core box the suite's wall time is its CPU seconds over two cores, so what a test module costs is
the CPU of every process it starts: Ray's daemons and workers, trainer ranks, vLLM's engine actor, engine
core and workers, reward workers, subprocess jobs. Each process's own user + system CPU (psutil, never its
children's) is read every ``--period`` seconds until it exits; a process that lived shorter than a period
may be missed. A process that existed before the command counts only what it spent since. Prints the
command's wall time, the CPU seconds per kind of process (Ray titles, vLLM titles, the command line's
module) and the heaviest processes; ``--out`` keeps one JSON line per process (pid, ppid, name, command
line, start, end, CPU) for a closer look (e.g. by the timeline of a test run, ``tests/helpers/timeline``).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil


def kind_of(name: str, cmdline: str) -> str:
    """A process's kind: its Ray or vLLM title, the Python module or script it runs, else its name."""
    for title in ("VLLM::EngineCore", "VLLM::Worker", "ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent"):
        if name.startswith(title[:15]) or cmdline.startswith(title):
            return title
    match = re.match(r"ray::(\w+)", cmdline) or re.match(r"ray::(\w+)", name)
    if match:
        return f"ray::{match.group(1)}"
    if "pytest-xdist" in name or "pytest-xdist" in cmdline:
        return "pytest worker"
    match = re.search(r"python[\d.]*\s+(?:-\S+\s+)*-m\s+(\S+)", cmdline)
    if match:
        return f"python -m {match.group(1)}"
    match = re.search(r"python[\d.]*\s+(?:-\S+\s+)*(\S+\.py)", cmdline)
    if match:
        return f"python {Path(match.group(1)).name}"
    if "spawn_main" in cmdline:
        return "multiprocessing child"
    if re.search(r"python[\d.]*\s+(?:-\S+\s+)*-c\b", cmdline):
        return "python -c"
    return name or "?"


class Census:
    """Samples every process's CPU in a thread until :meth:`stop`."""

    def __init__(self, period: float) -> None:
        self.period = period
        # Processes alive before the command count only what they spend after. Their keys, not a time comparison:
        # psutil's create_time derives from /proc/stat's btime, whole seconds, so it can read up to a second early.
        self.before = {(p.info["pid"], p.info["create_time"]) for p in psutil.process_iter(["pid", "create_time"])}
        self.rows: dict[tuple[int, float], dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-census", daemon=True)

    def start(self) -> Census:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def _sample(self) -> None:
        now = time.time()
        for proc in psutil.process_iter(["pid", "ppid", "name", "cmdline", "cpu_times", "create_time"]):
            info = proc.info
            if info["cpu_times"] is None or info["create_time"] is None:
                continue
            cpu = info["cpu_times"].user + info["cpu_times"].system
            row = self.rows.get((info["pid"], info["create_time"]))
            if row is None:
                row = self.rows[(info["pid"], info["create_time"])] = {
                    "pid": info["pid"], "ppid": info["ppid"], "start": info["create_time"],
                    "cpu0": cpu if (info["pid"], info["create_time"]) in self.before else 0.0}
            cmdline = " ".join(info["cmdline"] or [])[:300]
            # Titles change (vLLM's and Ray's processes retitle themselves): keep the latest.
            row.update(name=info["name"] or row.get("name", ""), cmd=cmdline or row.get("cmd", ""), end=now, cpu=cpu)

    def processes(self) -> list[dict]:
        return [{**row, "kind": kind_of(row["name"], row["cmd"]), "spent": row["cpu"] - row["cpu0"]}
                for row in self.rows.values()]


def report(processes: list[dict], wall_s: float, top: int) -> str:
    by_kind, count = Counter(), Counter()
    for p in processes:
        by_kind[p["kind"]] += p["spent"]
        count[p["kind"]] += 1
    total = sum(by_kind.values())
    lines = [f"wall {wall_s:.0f} s, CPU {total:.0f} s ({total / max(wall_s, 1e-9):.2f} cores on average)",
             "CPU s   share  processes  kind"]
    lines += [f"{cpu:7.1f} {100 * cpu / max(total, 1e-9):5.1f} % {count[kind]:6d}     {kind}"
              for kind, cpu in by_kind.most_common(top) if cpu >= 0.05]
    lines.append("heaviest processes (CPU s, lifetime s, kind, command line):")
    for p in sorted(processes, key=lambda p: -p["spent"])[:10]:
        lines.append(f"{p['spent']:7.1f} {p['end'] - p['start']:7.0f}  {p['kind']}  {p['cmd'][:100]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.cpu_census", description=__doc__.split("\n\n")[0])
    parser.add_argument("--period", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, help="write one JSON line per process here")
    parser.add_argument("--top", type=int, default=25, help="kinds of process to list")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    census = Census(args.period).start()
    start = time.monotonic()
    try:
        rc = subprocess.call(command)
    finally:
        wall = time.monotonic() - start
        census.stop()
    processes = census.processes()
    if args.out:
        args.out.write_text("".join(json.dumps(p) + "\n" for p in processes))
    print(report(processes, wall, args.top), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
