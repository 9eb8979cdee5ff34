"""Run untrusted Python (model-written solutions) against tests, contained.

Each run gets a fresh interpreter (``python -I -S -B``: no site-packages, no user site, no
``PYTHON*`` variables, no bytecode writes) in a new session, started in a throwaway directory
that is deleted afterwards, with a scrubbed environment (``HOME`` is the sandbox directory).
The layers, outermost first:

* **Namespaces** (``isolation='auto'`` uses them when they work, ``'namespaces'`` requires them):
  ``unshare --net --pid --kill-child`` when running as root, else the same inside a user namespace
  (``--map-root-user``) when the kernel allows unprivileged ones. A new network namespace has
  only a downed loopback, so no connection can be made even by native code; a new PID namespace
  means every process the program starts dies with it.
* **uid drop**: as root, the runner switches to ``nobody`` (65534) once limits are set, when that
  user can run the interpreter (on this repo's CPU box it cannot: Python lives under /root, so
  this layer is probed and skipped). Then file permissions protect the host and ``RLIMIT_NPROC``
  bounds fork bombs (the kernel ignores it for root).
* **rlimits** (set by the runner): CPU seconds, address space (memory), largest file written,
  64 open files, processes, no core dumps.
* **Audit hook** (always, inside the interpreter): refuses opening files outside the sandbox
  directory (reading the stdlib is allowed), directory listings elsewhere, sockets, new processes,
  signals to other processes, ctypes and frame introspection. This is what blocks the network
  and the filesystem when namespaces are unavailable (``isolation='audit'``): it is a Python-level
  barrier, strong against ordinary code but not a security boundary against native exploits;
  use the namespaces (root or unprivileged user namespaces) on shared machines.
* **Supervisor** (this module): wall-clock limit, stdout/stderr capped at ``output_bytes`` (a
  program that prints forever is killed at the cap), and the whole process group killed with
  SIGKILL on timeout and after every run (stragglers included). A caller may also pass a
  ``threading.Event`` to :meth:`Sandbox.run` and set it from another thread to stop the run
  early (status 'cancelled'; the reward pool does this when a scheduler drops the response).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("auto", "namespaces", "audit")
_CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
_NOBODY = 65534
_PROBE_TIMEOUT_S = 20.0
_CANCEL_POLL_S = 0.1
"""How often a run that can be cancelled checks its cancel event (otherwise every 0.5 s)."""
_probe_cache: dict[str, object] = {}


@dataclass
class SandboxLimits:
    """Resource limits of one sandbox run."""

    wall_s: float = 10.0
    """Wall-clock limit of the whole run (interpreter start-up included)."""
    cpu_s: float = 10.0
    """CPU-time limit (RLIMIT_CPU; the kernel kills the program when it is used up)."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) in MiB."""
    file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE) in MiB."""
    output_bytes: int = 1 << 20
    """Most bytes of stdout + stderr kept; a program printing more is killed."""
    nproc: int = 512
    """RLIMIT_NPROC: processes + threads of the run's real uid, all of its processes counted (so
    a non-root user's Ray workers count too). Enforced by the kernel only for a non-root uid; new
    processes are refused by the audit hook anyway, this bounds native code that bypasses it."""


@dataclass
class SandboxResult:
    """Outcome of one sandbox run."""

    status: str
    """'passed', 'failed', 'timeout', 'output_limit', 'error' (the sandbox itself failed) or
    'cancelled' (the caller's cancel event was set; the program was killed or never started)."""
    cases_passed: int = 0
    """Test cases (asserts program = 1 case, test functions, stdio cases) that passed."""
    cases_total: int = 0
    """Test cases run or planned."""
    detail: str = ""
    """First failure, the limit hit, or the error."""
    elapsed_s: float = 0.0
    """Wall-clock seconds of the run."""
    returncode: int | None = None
    """Exit status of the sandbox process (negative: killed by that signal)."""
    stdout: str = ""
    """Captured stdout (at most ``output_bytes``; the verdict line removed)."""
    stderr: str = ""
    """Captured stderr (at most ``output_bytes``)."""
    isolation: list[str] = field(default_factory=list)
    """Layers that were active: 'netns', 'pidns', 'userns', 'uid_drop', 'rlimits', 'audit_hook'."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _works(cmd: list[str], **popen_kwargs) -> bool:
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=_PROBE_TIMEOUT_S, **popen_kwargs).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def namespace_prefix() -> tuple[list[str], list[str]]:
    """The ``unshare`` command prefix that works here and the layers it gives (probed once)."""
    if "ns" not in _probe_cache:
        prefix: list[str] = []
        layers: list[str] = []
        unshare = shutil.which("unshare")
        if unshare:
            base = [unshare, "--net", "--pid", "--kill-child"]
            user = [unshare, "--user", "--map-root-user", "--net", "--pid", "--kill-child"]
            if os.geteuid() == 0 and _works(base + ["true"]):
                prefix, layers = base, ["netns", "pidns"]
            elif _works(user + ["true"]):
                prefix, layers = user, ["userns", "netns", "pidns"]
        _probe_cache["ns"] = (prefix, layers)
    return _probe_cache["ns"]  # type: ignore[return-value]


def drop_uid() -> tuple[int, int] | None:
    """(uid, gid) to run untrusted code as when this process is root and ``nobody`` can start
    the interpreter; None otherwise (probed once)."""
    if "uid" not in _probe_cache:
        ids = None
        if os.geteuid() == 0:
            with tempfile.TemporaryDirectory() as cwd:
                if _works([sys.executable, "-I", "-S", "-c", "pass"], cwd=cwd, user=_NOBODY,
                          group=_NOBODY, extra_groups=[]):
                    ids = (_NOBODY, _NOBODY)
        _probe_cache["uid"] = ids
    return _probe_cache["uid"]  # type: ignore[return-value]


def _read_roots() -> list[str]:
    """Directories the program may read besides its own: the interpreter's stdlib."""
    paths = sysconfig.get_paths()
    roots = {paths["stdlib"], paths["platstdlib"]}
    return sorted(r for r in roots if r and os.path.isdir(r))


class Sandbox:
    """Runs jobs in contained Python processes. Cheap to create; probes are cached per process.

    ``isolation``: 'auto' (namespaces when available, else the audit hook alone), 'namespaces'
    (refuse to run without them) or 'audit' (never use namespaces).
    """

    def __init__(self, isolation: str = "auto", base_dir: str | None = None) -> None:
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"reward.sandbox_isolation={isolation!r}: expected one of {ISOLATION_MODES}")
        self._prefix, self._layers = ([], []) if isolation == "audit" else namespace_prefix()
        if isolation == "namespaces" and not self._prefix:
            raise RuntimeError("reward.sandbox_isolation='namespaces' but `unshare --net --pid` does not work "
                               "here (needs root or unprivileged user namespaces); use 'auto' or 'audit'")
        self._ids = drop_uid()
        self._base_dir = base_dir
        self._read_roots = _read_roots()

    @property
    def layers(self) -> list[str]:
        """Isolation layers every run of this sandbox gets."""
        extra = ["uid_drop"] if self._ids else []
        return self._layers + extra + ["rlimits", "audit_hook"]

    def run(self, job: dict, limits: SandboxLimits, cancel: threading.Event | None = None) -> SandboxResult:
        """Run one job (see ``sandbox_child``: kind 'asserts' | 'pytest' | 'stdio') and judge it.

        ``cancel``: when another thread sets it, the run's process group is killed within
        ``_CANCEL_POLL_S`` and the result has status 'cancelled'.
        """
        if cancel is not None and cancel.is_set():
            return SandboxResult("cancelled", detail="cancelled before it started", isolation=self.layers)
        workdir = tempfile.mkdtemp(prefix="rl-sandbox-", dir=self._base_dir)
        try:
            return self._run_in(workdir, job, limits, cancel)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _run_in(self, workdir: str, job: dict, limits: SandboxLimits,
                cancel: threading.Event | None = None) -> SandboxResult:
        os.chmod(workdir, 0o700)
        if self._ids:
            os.chown(workdir, *self._ids)
        runner = os.path.join(workdir, "_runner.py")
        shutil.copyfile(_CHILD_SCRIPT, runner)
        nonce = secrets.token_hex(16)
        payload = dict(job, nonce=nonce, read_roots=self._read_roots, output_cap=limits.output_bytes,
                       uid=self._ids[0] if self._ids else None, gid=self._ids[1] if self._ids else None,
                       limits={"cpu_s": max(1, int(limits.cpu_s + 0.999)), "memory_mb": limits.memory_mb,
                               "file_mb": limits.file_mb, "nproc": limits.nproc})
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}
        cmd = self._prefix + [sys.executable, "-I", "-S", "-B", runner]
        start = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        except OSError as exc:
            return SandboxResult("error", detail=f"cannot start the sandbox: {exc}", isolation=self.layers)
        try:
            proc.stdin.write((json.dumps(payload) + "\n").encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out, err, reason, cpu_s = _supervise(proc, start + limits.wall_s, limits.output_bytes, cancel)
        _kill_group(proc)
        elapsed = time.monotonic() - start
        if not reason and cpu_s >= max(1, int(limits.cpu_s + 0.999)) - 0.05:
            reason = "cpu"
        result = _judge(out, err, reason, proc.returncode, nonce, limits)
        result.elapsed_s, result.isolation = elapsed, self.layers
        return result


def _supervise(proc: subprocess.Popen, deadline: float, cap: int,
               cancel: threading.Event | None = None) -> tuple[bytes, bytes, str, float]:
    """Read stdout/stderr until EOF; kill at the deadline, when output passes ``cap`` bytes or
    when ``cancel`` is set.

    Returns (stdout, stderr, reason, cpu_s): reason '' (ended by itself), 'timeout',
    'output_limit' or 'cancelled'; cpu_s the CPU seconds of the run's processes.
    """
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    streams = {out_fd: bytearray(), err_fd: bytearray()}
    open_fds = set(streams)
    reason = ""
    poll_s = 0.5 if cancel is None else _CANCEL_POLL_S
    while open_fds:
        if cancel is not None and cancel.is_set():
            reason = "cancelled"
            break
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        ready, _, _ = select.select(list(open_fds), [], [], min(left, poll_s))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
            else:
                streams[fd].extend(chunk)
        if sum(len(b) for b in streams.values()) > cap:
            reason = "output_limit"
            break
    if reason:
        _kill_group(proc)
    reaped = _reap(proc, time.monotonic() + 10 if reason else deadline)
    if reaped == "timeout":
        reason = reason or "timeout"
    proc.stdout.close()
    proc.stderr.close()
    cpu_s = reaped if isinstance(reaped, float) else 0.0
    return bytes(streams[out_fd][:cap]), bytes(streams[err_fd][:cap]), reason, cpu_s


def _reap(proc: subprocess.Popen, deadline: float) -> float | str:
    """Wait for the run's process until ``deadline`` (then kill it) and return the CPU seconds
    it and its reaped descendants used, or 'timeout'.

    ``os.wait4`` instead of ``Popen.wait``: its rusage tells a CPU-limit kill apart from other
    deaths even when ``unshare`` in between reports the child's signal as a plain exit status.
    """
    timed_out = False
    while True:
        pid, status, usage = os.wait4(proc.pid, 0 if timed_out else os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return "timeout" if timed_out else usage.ru_utime + usage.ru_stime
        if time.monotonic() >= deadline:
            timed_out = True
            _kill_group(proc)
        else:
            time.sleep(0.005)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's whole session/process group (no-op when it is already gone)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _judge(out: bytes, err: bytes, reason: str, returncode: int | None, nonce: str,
           limits: SandboxLimits) -> SandboxResult:
    text = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    verdict = None
    lines = text.split("\n")
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(nonce + " "):
            try:
                verdict = json.loads(lines[i][len(nonce) + 1:])
            except json.JSONDecodeError:
                verdict = None
            del lines[i]
            break
    stdout = "\n".join(lines).rstrip("\n")
    base = dict(returncode=returncode, stdout=stdout, stderr=stderr)
    if reason == "timeout":
        return SandboxResult("timeout", detail=f"wall-clock limit {limits.wall_s:g} s", **base)
    if reason == "cpu":
        return SandboxResult("timeout", detail=f"CPU limit {limits.cpu_s:g} s", **base)
    if reason == "output_limit":
        return SandboxResult("output_limit", detail=f"output over {limits.output_bytes} bytes", **base)
    if reason == "cancelled":
        return SandboxResult("cancelled", detail="cancelled by the caller; the program was killed", **base)
    if verdict is not None:
        status = "passed" if verdict.get("passed") else "failed"
        return SandboxResult(status, int(verdict.get("cases_passed", 0)), int(verdict.get("cases_total", 0)),
                             str(verdict.get("error", "")), **base)
    if returncode is not None and returncode < 0:
        sig = -returncode
        return SandboxResult("failed", detail=f"killed by signal {sig}", **base)
    tail = stderr.strip().splitlines()[-1:] or [""]
    return SandboxResult("failed", detail=f"exited ({returncode}) without a verdict {tail[0][:200]}".strip(), **base)
