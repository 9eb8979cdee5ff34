"""The check's runner: every part in its own process with its own time budget, a result row per
part, one table, one summary line. Torch-free: the parent never touches CUDA, so a part that
crashes the GPU context, hangs in NCCL or runs out of memory takes only itself down.

A part is a function ``fn(ctx) -> dict`` registered in :data:`PARTS` (see ``parts.py``); it runs
as ``python -m tests.gpu.check.run_part NAME`` (CPU mode: forked from one process that imported
torch and megatron-core, ``forked.py``) and writes its row as JSON. Row statuses:

* ``pass`` / ``fail``: the part ran and its checks held / did not (``fail`` names which);
* ``skip``: the part cannot run in this mode (e.g. the distributed optimizer on CPU), with the
  reason; does not fail the run;
* ``error``: the part raised (the row carries the exception's last line, the log its traceback);
* ``timeout``: killed at its budget; ``blocked``: a part it needs did not pass; ``deadline``:
  not started because the run's overall deadline had passed. All three fail the run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.gpu.check.forked import ForkedPart, PartForker, kill_session

REPO = Path(__file__).resolve().parents[3]
"""The repository root: every part runs as ``python -m tests.gpu.check.run_part`` from here, and
``-m`` puts the working directory first on sys.path, so the part imports ``tests.gpu.check``,
``megatron_rl`` and ``rollpacker`` from this tree. That is how the check runs on the lent GPU
machine, which gets a copy of the tree and installs nothing of it (tests/gpu/run_on_device.sh);
here the same files are also the editable install's."""
FAILING = ("fail", "error", "timeout", "blocked", "deadline")


@dataclass(frozen=True)
class PartSpec:
    """How the runner schedules one part."""

    name: str
    """Row name (also the ``run_part`` argument)."""
    budget_s: dict[str, float]
    """Time budget per mode ('gpu', 'cpu'): the part is killed when it runs longer."""
    needs: tuple[str, ...] = ()
    """Parts that must pass first (e.g. the model set-up)."""
    what: str = ""
    """One line for the table's legend: what the part checks."""
    cpu_skip: str = ""
    """Why the part cannot run on CPU at all (then CPU mode reports it skipped without starting it)."""


@dataclass
class Row:
    """One part's outcome, as printed and as written to gpu_check.json."""

    part: str
    status: str
    seconds: float = 0.0
    summary: str = ""
    """The key figures (or the failure) in one line."""
    figures: dict[str, Any] = field(default_factory=dict)
    """Every measured number, for the JSON."""
    log_tail: str = ""
    """The end of the part's output when it did not pass."""
    process: str = ""
    """How the part's process began: 'fresh' (its own interpreter) or 'forked' (from the process
    that had imported torch and megatron-core, CPU mode); empty when the part never ran."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Row":
        known = {k: raw[k] for k in ("part", "status", "seconds", "summary", "figures", "log_tail", "process")
                 if k in raw}
        return cls(**known)


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-chars:]


def _kill_group(proc: subprocess.Popen | ForkedPart) -> None:
    """End the part and whatever it started (it leads its own process group)."""
    kill_session(proc.pid)
    proc.wait()


@dataclass
class _Running:
    spec: PartSpec
    proc: subprocess.Popen | ForkedPart
    started: float
    budget: float
    result: Path
    log: Path


class Runner:
    """Schedules parts (at most ``jobs`` at a time, dependencies first) under one deadline."""

    def __init__(self, specs: list[PartSpec], mode: str, workdir: Path, deadline_s: float, jobs: int = 1,
                 budgets: dict[str, float] | None = None, env: dict[str, str] | None = None,
                 fork_parts: bool = False) -> None:
        self.specs = specs
        self.mode = mode
        self.workdir = workdir
        self.deadline_s = deadline_s
        self.jobs = max(1, jobs)
        self.budgets = budgets or {}
        self.env = env or {}
        self.rows: dict[str, Row] = {}
        self.forker = PartForker(self.env) if fork_parts else None
        """With ``fork_parts``, parts are forked from one preloaded process (``forked.py``; CPU
        mode) instead of started fresh."""
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        (workdir / "results").mkdir(parents=True, exist_ok=True)

    def _budget(self, spec: PartSpec) -> float:
        return float(self.budgets.get(spec.name, spec.budget_s[self.mode]))

    def _start(self, spec: PartSpec, budget: float) -> _Running:
        result = self.workdir / "results" / f"{spec.name}.json"
        log = self.workdir / "logs" / f"{spec.name}.log"
        result.unlink(missing_ok=True)
        argv = [spec.name, "--mode", self.mode, "--workdir", str(self.workdir), "--result", str(result)]
        if self.forker is not None:
            proc: subprocess.Popen | ForkedPart = self.forker.start(argv, log, REPO)
        else:
            env = {**os.environ, **self.env}
            with open(log, "w") as handle:
                proc = subprocess.Popen([sys.executable, "-m", "tests.gpu.check.run_part", *argv], cwd=REPO, env=env,
                                        stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        print(f"[gpu_check] start {spec.name} (budget {budget:.0f} s)", flush=True)
        return _Running(spec, proc, time.monotonic(), budget, result, log)

    def _finish(self, run: _Running, timed_out: bool) -> Row:
        seconds = time.monotonic() - run.started
        if timed_out:
            row = Row(run.spec.name, "timeout", seconds, f"killed after its {run.budget:.0f} s budget")
        elif run.result.is_file():
            try:
                row = Row.from_dict(json.loads(run.result.read_text()))
            except (json.JSONDecodeError, TypeError) as exc:
                row = Row(run.spec.name, "error", seconds, f"unreadable result {run.result.name}: {exc}")
            row.seconds = seconds
        else:
            row = Row(run.spec.name, "error", seconds, f"exited with code {run.proc.returncode} and no result "
                      "(crashed: see its log)")
        if row.status in FAILING:
            row.log_tail = _tail(run.log)
        print(f"[gpu_check] {row.status:<7} {row.part} ({seconds:.1f} s): {row.summary}", flush=True)
        return row

    def run(self) -> list[Row]:
        """Run every part; returns the rows in the order of ``specs``."""
        t0 = time.monotonic()
        pending = list(self.specs)
        running: list[_Running] = []
        while pending or running:
            for run in list(running):
                over = time.monotonic() - run.started > run.budget
                if run.proc.poll() is None and not over:
                    continue
                _kill_group(run.proc)  # over budget, or done: then whatever it left behind (an IPC receiver)
                self.rows[run.spec.name] = self._finish(run, timed_out=over and not run.result.is_file())
                running.remove(run)
            for spec in list(pending):
                if len(running) >= self.jobs:
                    break
                if self.mode == "cpu" and spec.cpu_skip:
                    pending.remove(spec)
                    self.rows[spec.name] = Row(spec.name, "skip", 0.0, f"skipped on CPU ({spec.cpu_skip})")
                    print(f"[gpu_check] skip    {spec.name}: {spec.cpu_skip}", flush=True)
                    continue
                states = [self.rows[n].status if n in self.rows else None for n in spec.needs]
                if None in states:
                    continue  # a dependency is still pending or running
                pending.remove(spec)
                bad = [n for n, s in zip(spec.needs, states) if s != "pass"]
                if bad:
                    self.rows[spec.name] = Row(spec.name, "blocked", 0.0, f"needs {', '.join(bad)}, which did not pass")
                    continue
                left = self.deadline_s - (time.monotonic() - t0)
                if left < min(self._budget(spec), 30.0):  # too little left to be worth starting
                    self.rows[spec.name] = Row(spec.name, "deadline", 0.0, f"not started: {left:.0f} s left of the "
                                               f"run's {self.deadline_s:.0f} s deadline")
                    print(f"[gpu_check] deadline {spec.name}: not started", flush=True)
                    continue
                try:
                    running.append(self._start(spec, min(self._budget(spec), left)))
                except OSError as exc:  # no process to run it in (fork failed, no forkserver): a row, not a crash
                    self.rows[spec.name] = Row(spec.name, "error", 0.0, f"could not start its process: {exc}")
                    print(f"[gpu_check] error   {spec.name}: could not start its process: {exc}", flush=True)
            time.sleep(0.2)
        return [self.rows[s.name] for s in self.specs]


def format_table(rows: list[Row], specs: list[PartSpec]) -> list[str]:
    """The Markdown table of every part, then a legend of what each part checks."""
    lines = ["| part | status | s | result |", "| --- | --- | ---: | --- |"]
    for row in rows:
        summary = row.summary.replace("|", "/").replace("\n", " ")
        lines.append(f"| {row.part} | {row.status} | {row.seconds:.1f} | {summary} |")
    lines.append("")
    lines += [f"  {s.name}: {s.what}" for s in specs if s.what]
    return lines


def summary_line(rows: list[Row], mode: str, seconds: float) -> str:
    passed = sum(r.status == "pass" for r in rows)
    failed = sum(r.status in FAILING for r in rows)
    skipped = sum(r.status == "skip" for r in rows)
    return f"gpu_check ({mode}): {passed} passed, {failed} failed, {skipped} skipped in {seconds:.1f} s"
