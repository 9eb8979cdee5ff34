"""Where a command's CPU goes, by kind of process: run a command (the test suite, a training run)
and sample, once a second, the CPU time and thread count of every process it starts, then print
one row per kind (vLLM engine core, engine front-end, trainer rank, reward worker, the driver,
Ray's own processes, other Python)::

    python -m megatron_rl.benchmarks.profiling.command_cpu --out cpu.json -- bash tests/run.sh

``--host`` counts every process that started on the machine after the command did (Ray nodes
started with ``ray start`` and Slurm's job steps are not the command's descendants); without it,
the command and its descendants only. The kernel's accounting (user + system) is read with
psutil; a process's CPU time is its last sample, so one that lives less than an interval may be
missed, and whatever ran in processes older than the command is not counted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megatron_rl.benchmarks.profiling.sampling import ProcessSampler, started_since

KINDS = {
    "engine core": "vLLM engine core (VLLM::EngineCore)",
    "engine front-end": "engine actor (vLLM front-end, ray::EngineActor)",
    "engine worker": "vLLM TP worker of a TP-2 engine (VLLM::Worker_TP*)",
    "trainer rank": "trainer rank (ray::TrainerRank)",
    "reward worker": "reward worker (ray::RewardWorker)",
    "ray runtime": "Ray's own processes (GCS, raylet, dashboard, agents, monitors, idle workers)",
}
"""Row names for the loop roles of ``sampling.role_of``; other processes go by command line."""


@dataclasses.dataclass
class Seen:
    """One process: what it is and its last sample."""

    pid: int
    kind: str
    cpu_s: float = 0.0
    threads: int = 0
    ppid: int = 0
    cmdline: str = ""
    start_s: float = 0.0
    """When the sampler first saw it, seconds after the command started."""
    last_s: float = 0.0
    """Its last sample, seconds after the command started."""

    def as_json(self) -> dict:
        return {"pid": self.pid, "ppid": self.ppid, "kind": self.kind, "cpu_s": round(self.cpu_s, 2),
                "threads": self.threads, "start_s": round(self.start_s, 1), "last_s": round(self.last_s, 1),
                "cmdline": self.cmdline[:400]}


def kind_of(role: str, name: str, cmdline: str) -> str:
    """The table row of a process, from its loop role (``sampling.role_of``), kernel name and command line."""
    if role in KINDS:
        return KINDS[role]
    if "megatron_rl.train" in cmdline:
        return "driver (python -m megatron_rl.train)"
    if "_fork_server_main" in cmdline or role.startswith("reward"):
        return "reward grading processes (fork server, graders)"
    if "pytest" in cmdline:
        return "pytest (its workers run the unit tests and in-process engines' front-ends)"
    if "python" in name or "python" in cmdline.split(" ", 1)[0]:
        return "other Python (spawned ranks of SPMD tests, tools, CLIs)"
    return "other (shells, compilers, Slurm, ...)"


def command_sampler(root_pid: int, host: bool, interval: float) -> ProcessSampler:
    """A sampler of the command's processes (see the module docstring): once an interval, each
    process's CPU time and thread count; its kind as of its latest name (Ray and vLLM rename their
    processes after they start)."""
    since = psutil.Process(root_pid).create_time()
    return ProcessSampler(root_pid, interval, thread_every=1, per_thread=False,
                          processes=started_since(since) if host else None)


def seen_by(sampler: ProcessSampler, started: float = 0.0) -> list[Seen]:
    """Every process the sampler read, with its kind and its last sample (times from ``started``,
    a ``time.monotonic()`` reading)."""
    return [Seen(r.pid, kind_of(r.role, r.name, r.cmdline), r.samples[-1][1], r.max_threads, r.ppid, r.cmdline,
                 r.samples[0][0] - started, r.samples[-1][0] - started)
            for r in sampler.all_records() if r.samples]


def table(seen: list[Seen]) -> list[dict]:
    """One row per kind: processes, CPU seconds, share of the total, CPU each, threads median / max."""
    total = sum(s.cpu_s for s in seen) or 1.0
    rows = []
    for kind in {s.kind for s in seen}:
        group = [s for s in seen if s.kind == kind]
        cpu = sum(s.cpu_s for s in group)
        rows.append({"kind": kind, "processes": len(group), "cpu_s": round(cpu, 1), "share": round(cpu / total, 3),
                     "cpu_s_each": round(cpu / len(group), 2),
                     "threads_median": statistics.median(s.threads for s in group),
                     "threads_max": max(s.threads for s in group)})
    return sorted(rows, key=lambda r: -r["cpu_s"])


def markdown(rows: list[dict]) -> str:
    lines = ["| process kind | processes | CPU s | share | CPU s each | threads (median / max) |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['processes']} | {r['cpu_s']:.0f} | {100 * r['share']:.0f} % | "
                     f"{r['cpu_s_each']:.1f} | {r['threads_median']:.0f} / {r['threads_max']} |")
    lines.append(f"| all | {sum(r['processes'] for r in rows)} | {sum(r['cpu_s'] for r in rows):.0f} | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--host", action="store_true", help="every process started after the command, not only its descendants")
    parser.add_argument("--out", type=Path, help="also write the rows, every process (command line, parent, "
                        "CPU s, threads, first and last sample) and the command's exit code as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- bash tests/run.sh")
    proc = subprocess.Popen(command)
    sampler = command_sampler(proc.pid, args.host, args.interval)
    started = time.monotonic()
    sampler.start()
    proc.wait()
    sampler.stop()  # after one last sample
    seen = seen_by(sampler, started)
    rows = table(seen)
    print(markdown(rows))
    print(f"command exited {proc.returncode} after {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.out:
        processes = [s.as_json() for s in sorted(seen, key=lambda s: -s.cpu_s)]
        args.out.write_text(json.dumps({"command": command, "exit_code": proc.returncode, "rows": rows,
                                        "processes": processes}, indent=2))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
