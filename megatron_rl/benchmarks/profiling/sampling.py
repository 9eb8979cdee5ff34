"""What the loop's processes do while it runs, sampled from outside: the operating system's CPU
accounting of every process and thread (psutil over /proc) and py-spy's stacks.

Nothing here changes the processes it watches: :class:`ProcessSampler` reads each descendant's
(or, with :func:`started_since`, each new process's of the machine) CPU time every ``interval``
seconds (user + system, the kernel's own accounting, 10 ms ticks), its main thread's CPU time (the
main thread's id is the pid) and, every ``thread_every`` samples, every thread's;
:class:`SpyRecorders` attaches one ``py-spy record`` to each process of interest as it appears
(``--idle`` so that a thread's stack is known at every instant, ``--nonblocking`` so the target is
never paused) and writes Chrome-trace files (timestamps relative to py-spy's start, which is
recorded on the monotonic clock the loop's ``phases.jsonl`` uses).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

ROLES = (
    ("driver", None),
    ("trainer rank", "ray::TrainerRan"),
    ("engine front-end", "ray::EngineActo"),
    ("engine core", "VLLM::EngineCor"),
    ("engine worker", "VLLM::Worker"),
    ("reward worker", "ray::RewardWork"),
)
"""Roles of the loop's processes, by the kernel's process name (15 characters: Ray and vLLM set
them). The driver is the profiled process itself."""

PROFILED_ROLES = {role for role, _ in ROLES}
"""Roles py-spy attaches to (the rest, Ray's own daemons and short-lived children, only get CPU
accounting)."""

RAY_DAEMONS = ("raylet", "gcs_server", "ray::IDLE", "ray::RuntimeEnv", "ray::DashboardA")
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
              "KMP_BLOCKTIME", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")
"""Environment a process was started with that sizes or parks its compute threads."""


def role_of(proc: psutil.Process, root_pid: int, parent_role: str | None) -> str:
    """The role of one process: a loop part by name, Ray's daemons, or a child of a part."""
    if proc.pid == root_pid:
        return "driver"
    try:
        name, cmdline = proc.name(), " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    for role, prefix in ROLES:
        if prefix and name.startswith(prefix):
            return role
    if name.startswith(RAY_DAEMONS) or "ray/dashboard" in cmdline or "ray/autoscaler" in cmdline \
            or "ray/_private/log_monitor" in cmdline or name.startswith("ray::"):
        return "ray runtime"
    if parent_role in ("reward worker", "reward child"):
        return "reward child"  # isolated grader calls, sandboxes
    if parent_role and parent_role.startswith("engine"):
        return "engine helper"  # vLLM's resource tracker
    return "other"


@dataclasses.dataclass
class ProcessRecord:
    """One process seen during the run."""

    pid: int
    ppid: int
    role: str
    name: str
    cmdline: str
    env: dict[str, str]
    first_seen: float
    samples: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)
    """(monotonic time, process CPU seconds, main-thread CPU seconds), cumulative."""
    threads: dict[int, tuple[str, float, float]] = dataclasses.field(default_factory=dict)
    """Thread id -> (name, CPU seconds when first seen, CPU seconds when last seen)."""
    max_threads: int = 0
    gone: bool = False


def _env_of(proc: psutil.Process) -> dict[str, str]:
    try:
        env = proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {}
    return {k: env[k] for k in THREAD_ENV if k in env}


_HZ = os.sysconf("SC_CLK_TCK")


def _cpu_ticks(stat_path: str) -> int | None:
    """utime + stime (clock ticks) from a /proc stat file; None when the process is gone."""
    try:
        with open(stat_path, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])


def _thread_names(pid: int) -> dict[int, str]:
    names = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            names[int(task.name)] = (task / "comm").read_text().strip()
        except (OSError, ValueError):
            continue
    return names


def started_since(since: float) -> Callable[[], list[psutil.Process]]:
    """For :class:`ProcessSampler`'s ``processes``: every process of the machine created at or after
    ``since`` (a psutil create time), whoever started it (Ray nodes started with ``ray start``,
    Slurm's job steps)."""
    def processes() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.create_time() >= since:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    return processes


class ProcessSampler(threading.Thread):
    """Samples the CPU time of ``root_pid`` and all its descendants until :meth:`stop`.

    ``on_new(record)`` is called (from this thread) for every process seen for the first time.
    ``processes``, when given, lists the processes to sample instead of the descendants (e.g.
    :func:`started_since`). ``per_thread=False`` keeps of the thread snapshots only each process's
    thread count (``max_threads``), not every thread's CPU time and name. A pid taken again by a
    new process gets a new record: the earlier one moves to :attr:`ended`.
    """

    def __init__(self, root_pid: int, interval: float = 0.1, thread_every: int = 10, on_new=None,
                 processes: Callable[[], list[psutil.Process]] | None = None, per_thread: bool = True) -> None:
        super().__init__(name="process-sampler", daemon=True)
        self.root_pid = root_pid
        self.interval = interval
        self.thread_every = thread_every
        self.on_new = on_new
        self.per_thread = per_thread
        self.records: dict[int, ProcessRecord] = {}
        """The latest process of each pid."""
        self.ended: list[ProcessRecord] = []
        """Records of processes whose pid a later process took."""
        self._processes = processes or self._tree
        self._stop_event = threading.Event()
        self._procs: dict[int, psutil.Process] = {}

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def run(self) -> None:
        tick = 0
        while not self._stop_event.is_set():
            self._sample(with_threads=tick % self.thread_every == 0)
            tick += 1
            self._stop_event.wait(self.interval)
        self._sample(with_threads=True)

    def _tree(self) -> list[psutil.Process]:
        try:
            root = self._procs.setdefault(self.root_pid, psutil.Process(self.root_pid))
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def all_records(self) -> list[ProcessRecord]:
        """Every process seen, those whose pid was taken again included."""
        return [*self.ended, *self.records.values()]

    def _sample(self, with_threads: bool) -> None:
        # The tree walk reads every /proc entry: new processes are looked for only with the
        # thread snapshot; known ones are read every tick (two small /proc reads each).
        if with_threads or not self._procs:
            for proc in self._processes():
                try:
                    known = self.records.get(proc.pid)
                    if known is not None and (known.gone or self._procs[proc.pid].create_time() != proc.create_time()):
                        known.gone = True  # its pid was taken again
                        self.ended.append(self.records.pop(proc.pid))
                        known = None
                    if known is None:
                        self._procs[proc.pid] = proc
                        self._new_record(proc, time.monotonic())
                    else:
                        self._reclassify(known, self._procs[proc.pid])
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        for pid, record in self.records.items():
            if record.gone:
                continue
            ticks = _cpu_ticks(f"/proc/{pid}/stat"), _cpu_ticks(f"/proc/{pid}/task/{pid}/stat")
            if ticks[0] is None:
                record.gone = True
                continue
            record.samples.append((time.monotonic(), ticks[0] / _HZ, (ticks[1] or 0) / _HZ))
            if with_threads:
                self._sample_threads(record)

    def _sample_threads(self, record: ProcessRecord) -> None:
        try:
            proc = self._procs[record.pid]
            threads = proc.threads() if self.per_thread else None
            count = len(threads) if threads is not None else proc.num_threads()
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
            return
        record.max_threads = max(record.max_threads, count)
        if threads is None:
            return
        names = _thread_names(record.pid)
        for t in threads:
            cpu = t.user_time + t.system_time
            name, first, _ = record.threads.get(t.id, (names.get(t.id, "?"), cpu, cpu))
            record.threads[t.id] = (name, first, cpu)

    def _reclassify(self, record: ProcessRecord, proc: psutil.Process) -> None:
        """Ray workers start as ``ray::IDLE`` and vLLM's processes as ``python``; they take their
        names (and roles) later. A process first seen between its fork and its exec carries its
        parent's command line; an exec of another Python program keeps the name ``python``, so a
        changed command line counts too. A process forked from a loop part (vLLM's TP workers
        from a forked engine core, ``rollout.cpu_engine_start``) starts with that part's name and
        takes its own a moment later: its role follows a new name of another part (it is profiled
        already). A part renamed otherwise (Ray renames an actor's process as it ends) keeps its role."""
        if record.role in PROFILED_ROLES:
            name = proc.name()
            if name != record.name:
                parent = self.records.get(record.ppid)
                role = role_of(proc, self.root_pid, parent.role if parent else None)
                if role in PROFILED_ROLES:
                    record.name, record.role = name, role
            return
        name, cmdline = proc.name(), " ".join(proc.cmdline())[:300]
        if not cmdline or (name == record.name and cmdline == record.cmdline):
            return  # an exiting process reads an empty command line: keep what it ran
        parent = self.records.get(record.ppid)
        record.name, record.cmdline = name, cmdline
        record.role = role_of(proc, self.root_pid, parent.role if parent else None)
        if record.role in PROFILED_ROLES:
            record.env = _env_of(proc)
            if self.on_new is not None:
                self.on_new(record)

    def _new_record(self, proc: psutil.Process, now: float) -> ProcessRecord:
        ppid = proc.ppid()
        parent = self.records.get(ppid)
        record = ProcessRecord(pid=proc.pid, ppid=ppid, role=role_of(proc, self.root_pid, parent.role if parent else None),
                               name=proc.name(), cmdline=" ".join(proc.cmdline())[:300], env=_env_of(proc),
                               first_seen=now)
        self.records[proc.pid] = record
        if self.on_new is not None:
            self.on_new(record)
        return record


class SpyRecorders:
    """One ``py-spy record`` per process of interest, writing ``<out_dir>/<pid>.json``."""

    def __init__(self, out_dir: Path, rate: int = 50, native: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rate = rate
        self.native = native
        self.exe = shutil.which("py-spy") or str(Path(os.sys.executable).with_name("py-spy"))
        if not Path(self.exe).exists():
            raise FileNotFoundError("py-spy not found: pip install py-spy (a dependency of this project, in requirements/cpu.lock)")
        self.started: dict[int, tuple[subprocess.Popen, float, Path]] = {}
        self._lock = threading.Lock()

    def attach(self, record: ProcessRecord) -> None:
        if record.role not in PROFILED_ROLES:
            return
        out = self.out_dir / f"{record.pid}.json"
        cmd = [self.exe, "record", "--pid", str(record.pid), "--idle", "--rate", str(self.rate),
               "--format", "chrometrace", "--output", str(out), "--nolineno"]
        cmd += ["--native"] if self.native else ["--nonblocking"]
        with self._lock:
            # py-spy's timestamps count from its own start: remember when that was.
            started = time.monotonic()
            log = open(self.out_dir / f"{record.pid}.log", "wb")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.started[record.pid] = (proc, started, out)

    def stop(self, timeout: float = 30.0) -> dict[int, tuple[float, Path]]:
        """Stop every recorder still running (SIGINT: py-spy writes its file) and return
        pid -> (start time, trace file) of those that wrote one."""
        with self._lock:
            for proc, _, _ in self.started.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            written = {}
            for pid, (proc, started, out) in self.started.items():
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                if out.is_file() and out.stat().st_size > 0:
                    written[pid] = (started, out)
            return written
