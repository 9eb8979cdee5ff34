"""One sandbox run: start the solution and judge processes, supervise them, read the verdict.

The parent's half of a run (:mod:`megatron_rl.reward.sandbox` documents the design). The
processes are wired with four pipes: judge -> solution and solution -> judge (the wire), judge
-> parent (the verdict; only the judge holds its write end) and solution -> parent (the layers
it applied, written and closed before any untrusted code runs). Jobs travel as anonymous
temporary files on each process's stdin, so the judge's job (tests, expected outputs) is never
on a path the solution could open.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import marshal
import os
import py_compile
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from megatron_rl.reward.sandbox.job import SandboxLimits, SandboxResult, layer_names

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.1
"""How often a run checks its cancel event and (without a private root) the disk use."""
CONFINED_DIR = Path(__file__).resolve().parent / "confined"
"""The code of the two confined interpreters: the one directory their bootstrap puts on
``sys.path`` (the interpreters start with ``-I -S``: the standard library and nothing else), so
no project or third-party module is importable there."""
_MAX_FILES = 100_000
_MAX_WIRE_BYTES = 256 << 20
_JUDGE_LOG_BYTES = 64 << 10
_EXIT_GRACE_S = 0.2
_compiled = False

_BOOT = "import sys; sys.path.insert(0, {here!r}); import {module}; {module}.main()"


def _boot(module: str) -> list[str]:
    return ["-c", _BOOT.format(here=str(CONFINED_DIR), module=module)]


def precompile_confined() -> None:
    """Byte-compile the confined interpreters' modules once per process (they run with ``-B``
    and would otherwise compile them on every start). Best effort: a read-only checkout just
    runs slower."""
    global _compiled
    if _compiled:
        return
    for source in sorted(CONFINED_DIR.glob("*.py")):
        cached = importlib.util.cache_from_source(str(source))
        try:
            if not os.path.exists(cached) or os.path.getmtime(cached) < source.stat().st_mtime:
                py_compile.compile(str(source), cfile=cached, doraise=True)
        except (OSError, py_compile.PyCompileError) as exc:
            logger.debug("cannot byte-compile %s: %s", source, exc)
    _compiled = True


def _widen(fd: int) -> None:
    """Give a wire pipe a 1 MiB buffer (the kernel's usual maximum): a large argument or result
    then crosses in a few context switches instead of one per 64 KiB."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
    except (OSError, AttributeError):
        pass


def _env(home: str) -> dict:
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
            "PYTHONIOENCODING": "utf-8"}


def _job_file(payload: dict):
    f = tempfile.TemporaryFile()
    f.write(marshal.dumps(payload))
    f.seek(0)
    return f


def execute(plan: dict, job: dict, limits: SandboxLimits, cancel: threading.Event | None, *, base_dir,
            system_paths: list[str], python: str) -> SandboxResult:
    """Run ``job`` under ``plan`` (see ``Sandbox._choose_plan``) and return the result."""
    layers = layer_names(plan)
    work = os.path.realpath(tempfile.mkdtemp(prefix="rl-sandbox-", dir=base_dir))
    judge_dir = os.path.realpath(tempfile.mkdtemp(prefix="rl-judge-", dir=base_dir))
    pipes: list[int] = []
    procs: list[subprocess.Popen] = []
    try:
        os.chmod(work, 0o700)
        if plan["uid"] and not plan["root"]:
            os.chown(work, *plan["uid"])
        return _run(plan, job, limits, cancel, layers, work, judge_dir, pipes, procs, system_paths, python)
    finally:
        for proc in procs:
            _kill(proc)
            if proc.returncode is None:
                _reap(proc)
        for fd in pipes:
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(judge_dir, ignore_errors=True)


def _run(plan, job, limits, cancel, layers, work, judge_dir, pipes, procs, system_paths, python) -> SandboxResult:
    """Spawn both processes (their descriptors and processes are left in ``pipes`` / ``procs``
    for the caller to clean up), supervise them and judge the outcome."""
    kind = job["kind"]
    cpu = max(1, int(limits.cpu_s + 0.999))
    rlimits = {"cpu_s": cpu, "memory_mb": limits.memory_mb, "file_mb": limits.file_mb, "nproc": limits.nproc}
    require = [name for name in ("private_root", "rlimits", "uid_drop", "landlock", "seccomp") if name in layers]
    j2s, s2j, verdict, report = os.pipe(), os.pipe(), os.pipe(), os.pipe()
    pipes.extend(j2s + s2j + verdict + report)
    for fd in (j2s[1], s2j[1]):
        _widen(fd)
    solution_job = {
        "kind": kind, "solution": job["solution"], "setup": job.get("setup", ""),
        "output_cap": limits.output_bytes, "max_bytes": _MAX_WIRE_BYTES, "read_roots": system_paths,
        "fds": {"from_judge": j2s[0], "to_judge": s2j[1], "report": report[1]},
        "confine": {"require": require, "rlimits": rlimits, "seccomp": "seccomp" in layers,
                    "uid": list(plan["uid"]) if plan["uid"] else None,
                    "root": {"new_root": work, "read_only": system_paths, "work_dir": work,
                             "disk_mb": limits.disk_mb, "owner": list(plan["uid"]) if plan["uid"] else None}
                    if plan["root"] else None,
                    "landlock": {"ro": system_paths, "rw": [work]} if "landlock" in layers else None}}
    judge_job = {
        "kind": kind, "tests": job.get("tests", ""), "setup": job.get("setup", ""),
        "entry_point": job.get("entry_point", ""), "cases": [list(c) for c in job.get("cases", ())],
        "max_bytes": _MAX_WIRE_BYTES,
        "fds": {"from_solution": s2j[0], "to_solution": j2s[1], "verdict": verdict[1]},
        "confine": {"require": [n for n in require if n in ("rlimits", "landlock", "seccomp")],
                    "rlimits": rlimits, "seccomp": "seccomp" in layers,
                    "landlock": {"ro": system_paths, "rw": [judge_dir]} if "landlock" in layers else None}}
    start = time.monotonic()
    with _job_file(solution_job) as s_in, _job_file(judge_job) as j_in:
        try:
            procs.append(subprocess.Popen(
                plan["prefix"] + [python, "-I", "-S", "-B", *_boot("sandbox_child")], cwd=work, env=_env(work),
                stdin=s_in, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                pass_fds=(j2s[0], s2j[1], report[1])))
            procs.append(subprocess.Popen(
                [python, "-I", "-S", "-B", *_boot("sandbox_judge")], cwd=judge_dir, env=_env(judge_dir),
                stdin=j_in, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                close_fds=True, pass_fds=(s2j[0], j2s[1], verdict[1])))
        except OSError as exc:
            return SandboxResult("error", detail=f"cannot start the sandbox: {exc}", isolation=layers)
    for fd in (j2s[0], j2s[1], s2j[0], s2j[1], verdict[1], report[1]):
        os.close(fd)
        pipes.remove(fd)
    solution, judge_proc = procs
    streams = _supervise(solution, judge_proc, verdict[0], report[0], start + limits.wall_s, limits,
                         cancel, None if plan["root"] else work)
    s_usage, j_usage = _reap(solution), _reap(judge_proc)
    result = _judge(streams, solution.returncode, _cpu_hit(s_usage, solution.returncode, cpu)
                    or _cpu_hit(j_usage, judge_proc.returncode, cpu), limits)
    applied = streams["layers"]
    result.elapsed_s = time.monotonic() - start
    result.isolation = layers if applied is None else \
        plan["ns"] + [x for x in applied if type(x) is str] + ([] if plan["root"] else ["disk_poll"])
    return result


def _supervise(solution, judge, verdict_fd: int, report_fd: int, deadline: float, limits: SandboxLimits,
               cancel, poll_dir: str | None) -> dict:
    """Read every stream until both processes are done. Once the judge has closed the verdict
    pipe nothing the solution does counts: it gets ``_EXIT_GRACE_S`` to exit by itself (it does
    when the judge's end of the wire closes; its last output is flushed), then is killed. A
    limit, the deadline or ``cancel`` kills both at once."""
    s_out, s_err, j_out = solution.stdout.fileno(), solution.stderr.fileno(), judge.stdout.fileno()
    bufs = {s_out: bytearray(), s_err: bytearray(), j_out: bytearray(), verdict_fd: bytearray(),
            report_fd: bytearray()}
    caps = {j_out: _JUDGE_LOG_BYTES, verdict_fd: 1 << 20, report_fd: 1 << 16}
    open_fds, reason = set(bufs), ""
    kill_at = drain_until = None
    poll_s = CANCEL_POLL_S if cancel is not None or poll_dir else 0.5

    def stop(why: str, grace: float = 0.0) -> None:
        nonlocal reason, kill_at, drain_until
        reason = reason or why
        now = time.monotonic()
        kill_at, drain_until = now + grace, now + grace + 2.0

    while open_fds:
        now = time.monotonic()
        if drain_until is not None and now >= drain_until:
            break
        if kill_at is not None and now >= kill_at:
            _kill(solution), _kill(judge)
            kill_at = float("inf")
        if drain_until is None:
            if cancel is not None and cancel.is_set():
                stop("cancelled")
            elif now >= deadline:
                stop("timeout")
            elif poll_dir and _over_disk(poll_dir, limits.disk_mb):
                stop("disk_limit")
            if reason:
                continue
        limit = drain_until if drain_until is not None else deadline
        wait = max(0.0, min(limit - now, poll_s, (kill_at - now) if kill_at and kill_at != float("inf") else poll_s))
        ready, _, _ = select.select(list(open_fds), [], [], wait)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                if fd == verdict_fd and drain_until is None:
                    stop("", _EXIT_GRACE_S)
            elif len(bufs[fd]) < caps.get(fd, limits.output_bytes + 1):
                bufs[fd].extend(chunk)
        if drain_until is None and len(bufs[s_out]) + len(bufs[s_err]) > limits.output_bytes:
            stop("output_limit")
    _kill(solution), _kill(judge)
    for stream in (solution.stdout, solution.stderr, judge.stdout):
        stream.close()
    try:
        report = json.loads(bytes(bufs[report_fd]) or b"{}")
    except ValueError:
        report = {}
    report = report if isinstance(report, dict) else {}
    layers = report.get("layers")
    return {"stdout": bytes(bufs[s_out][:limits.output_bytes]), "stderr": bytes(bufs[s_err][:limits.output_bytes]),
            "judge_log": bytes(bufs[j_out]), "verdict": bytes(bufs[verdict_fd]), "reason": reason,
            "report": report, "layers": layers if isinstance(layers, list) else None}


def _over_disk(path: str, disk_mb: int) -> bool:
    """Whether the files under ``path`` take more than ``disk_mb`` MiB (allocated blocks, so a
    sparse file counts what it really uses) or number over ``_MAX_FILES``."""
    total, count, stack = 0, 0, [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    count += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue
        if total > disk_mb << 20 or count > _MAX_FILES:
            return True
    return False


def _reap(proc: subprocess.Popen, timeout_s: float = 10.0):
    """Wait for ``proc`` (already killed or exiting); its rusage (CPU seconds of it and its
    reaped descendants) or None. ``os.wait4`` tells a CPU-limit kill apart from other deaths
    even when ``unshare`` in between reports the child's signal as a plain exit status."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.monotonic() >= deadline:
            _kill(proc)
            deadline = time.monotonic() + timeout_s
        time.sleep(0.002)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process's group and the process itself (it may have left the group)."""
    for fn, target in ((os.killpg, proc.pid), (os.kill, proc.pid)):
        try:
            fn(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _cpu_hit(cpu_s, returncode, limit: int) -> bool:
    """Whether a process was ended by its RLIMIT_CPU. The kernel checks the limit against
    tick-sampled CPU time, which on a loaded machine runs ahead of the precise time rusage
    reports; so a process that died abnormally after using most of its limit counts too
    (``unshare`` turns the child's SIGXCPU into a plain exit status)."""
    if cpu_s is None:
        return False
    return returncode == -signal.SIGXCPU or cpu_s >= limit - 0.05 or \
        (cpu_s >= 0.75 * limit and returncode not in (0, None))


def _judge(streams: dict, returncode, cpu_hit: bool, limits: SandboxLimits) -> SandboxResult:
    base = dict(returncode=returncode, stdout=streams["stdout"].decode("utf-8", "replace").rstrip("\n"),
                stderr=streams["stderr"].decode("utf-8", "replace"))
    reason = streams["reason"]
    if reason == "timeout":
        return SandboxResult("timeout", detail=f"wall-clock limit {limits.wall_s:g} s", **base)
    if reason == "cancelled":
        return SandboxResult("cancelled", detail="cancelled by the caller; the program was killed", **base)
    if reason == "output_limit":
        return SandboxResult("output_limit", detail=f"output over {limits.output_bytes} bytes", **base)
    if reason == "disk_limit":
        return SandboxResult("output_limit", detail=f"files over {limits.disk_mb} MiB (or {_MAX_FILES} files)", **base)
    if "error" in streams["report"]:
        return SandboxResult("error", detail=str(streams["report"]["error"])[:500], **base)
    try:
        verdict = json.loads(streams["verdict"] or b"null")
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict) or verdict.get("sandbox_error"):
        if cpu_hit:
            return SandboxResult("timeout", detail=f"CPU limit {limits.cpu_s:g} s", **base)
        log = streams["judge_log"].decode("utf-8", "replace").strip().splitlines()[-3:]
        why = verdict.get("error", "") if isinstance(verdict, dict) else "the judge ended without a verdict"
        return SandboxResult("error", detail=f"{why} {' | '.join(log)}".strip()[:500], **base)
    done, total = int(verdict.get("cases_passed", 0)), int(verdict.get("cases_total", 0))
    if verdict.get("passed") is True and total > 0:
        if streams["layers"] is None:
            return SandboxResult("error", detail="the solution process did not report its isolation", **base)
        return SandboxResult("passed", done, total, **base)
    if cpu_hit:
        return SandboxResult("timeout", done, total, detail=f"CPU limit {limits.cpu_s:g} s", **base)
    detail = str(verdict.get("error", ""))
    if returncode not in (None, 0) and "ended" in detail:
        detail += f" (exit status {returncode})"
    return SandboxResult("failed", done, total, detail=detail, **base)
