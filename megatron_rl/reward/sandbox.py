"""Run untrusted Python (model-written solutions) against tests, contained, with a verdict the
solution cannot forge.

**Two processes per run.** The *solution process* (:mod:`sandbox_child`, serving with
:mod:`sandbox_server`) is the only place untrusted code runs. The *judge process*
(:mod:`sandbox_judge`) runs the prompt's tests and reaches the solution only over a pipe pair
(:mod:`sandbox_wire`): it asks for module attributes, calls, attribute reads, iteration, or a
run of the whole program on one stdin, and gets back **plain data** (None, bool, int, float,
complex, str, bytes and lists/tuples/dicts/sets of them, plus a few stdlib value types; the
sender picks them by exact type, the judge rebuilds them from their parts) or opaque handles
(:mod:`sandbox_remote`). So ``assert candidate(x) == y`` compares two of the judge's own objects
with the judge's ``==``: that is the defence against an ``__eq__`` that always says yes (and
``int`` subclasses, ``__repr__``/``__del__`` that raise, ``abs(f(x) - y) < eps`` answered by a
``__sub__``). The solution process never sees the tests or the expected outputs. The judge
writes the verdict on a pipe only it holds; a run passes only when that verdict says every test
passed (and the solution process reported the layers it was confined with).

**Threat model.** The solution is hostile and may do anything inside its process, native code
included: patch ``json``/``os.write``/builtins or this runner's code, walk frames, install
signal handlers, exit early (``sys.exit(0)``, ``os._exit(0)``), print or write fake verdicts
on every descriptor, raise SystemExit/KeyboardInterrupt/BaseException anywhere, try to kill the
parent, fork, open sockets, read the host's files or fill the disk. None of it yields a pass,
because everything that decides the verdict lives in another process it cannot reach. The
dataset's tests are trusted not to be hostile, but the judge is confined too (rlimits, landlock,
seccomp). Layers of the solution process, outermost first:

* **Namespaces** (``unshare``; as root, else inside a user namespace): new network (only a
  downed loopback), PID (it sees only itself: the judge and the parent have no PID there,
  ``kill(-1)`` reaches nothing), mount, IPC and UTS namespaces, and a **private root**
  (:mod:`sandbox_confine`): only the interpreter, the system libraries, the time-zone data and
  four device nodes, read-only, plus a tmpfs of ``disk_mb`` MiB as the sandbox directory (the
  total-disk-use limit: ENOSPC past it). The repo, /etc, ~/.ssh do not exist there. As real
  root it then drops to ``nobody``.
* **landlock** (when the kernel has it; both processes): files only beneath the allowed paths,
  no TCP, no signals to and no abstract sockets of processes outside its domain, no ptrace of
  them.
* **seccomp** (x86-64; both processes): no fork/vfork/exec or clone of a process (threads are
  fine), no sockets, no ptrace or cross-process memory access, no mount/namespace/keyring/bpf/
  kernel-administration calls.
* **rlimits**: CPU seconds, address space, largest file, 64 open files, processes, no core.
* **Audit hook**: a Python-level layer with clear error messages (files outside the sandbox
  directory and the read-only paths, sockets, new processes, signals to others, ctypes,
  sub-interpreters, tracing, gc walks). It captures the C functions it calls, so patching
  ``os.path`` or builtins does not change its answers, but against native code it is no
  boundary. Frame introspection is allowed: ``typing``, ``dataclasses``, ``enum``,
  ``namedtuple``, ``logging``, ``traceback``, ``fractions``, ``decimal``, ``statistics`` use it,
  and there is nothing to find.
* **Supervisor** (:mod:`sandbox_run`): wall-clock limit, stdout/stderr capped at
  ``output_bytes`` (killed at the cap), without a private root the sandbox directory's size
  polled every 0.1 s against ``disk_mb`` (killed past it; it can overshoot by what the program
  writes in 0.1 s, each file at most ``file_mb``), both process groups SIGKILLed after every
  run, and an optional ``threading.Event`` to cancel a run (status 'cancelled').

**Isolation modes** (``reward.sandbox_isolation``). 'auto': namespaces when a probe run with
them passes here, else without (logged once); 'namespaces': require them (the constructor
raises where they do not work); 'audit': never use them. Without namespaces the solution process
shares the host's file system, network and PID namespace: landlock then keeps it to the sandbox
directory and the read-only paths and away from the judge and the parent, seccomp keeps it from
forking, sockets and ptrace, and the disk limit is the polling one. On a kernel with neither
landlock nor seccomp the audit hook alone guards files, network, processes and the judge: it
stops ordinary Python, not a native exploit. Which layers every run gets is decided by a probe
run at construction (:attr:`Sandbox.layers`); a run whose process cannot apply one of them ends
with 'error' instead of running with less.

**What the tests can do.** Test code runs in the judge, so it uses the solution the way Python
code uses an object: call it, read and set attributes, index, iterate, ``len``, truth, ``str``,
``isinstance``, catch its exceptions (the judge re-raises them as the built-in class of the
same name, or as a class made for the solution's own exception class), pass callbacks (they
stay in the judge; the solution calls back). Plain containers passed as arguments travel by
value and the changes the call made are copied back (``rotate(nums)``). Between two of the
solution's objects, ``==``, ordering and arithmetic are the solution's; arithmetic results must
be its objects again. pytest-style tests get ``raises``, ``approx``, ``mark.parametrize``,
``fixture``, ``capsys`` (:mod:`sandbox_pytest`); ``tmp_path``, ``monkeypatch`` and async tests
are not supported, and module attributes that hold containers are read as copies.

**What remains possible.** (1) Weak tests: a solution that satisfies the tests without solving
the problem (answers hard-coded for the visible inputs, a truthy object for ``assert f(x)``)
passes, as it would anywhere. (2) Whatever the tests take from the solution is the solution's:
helpers of the prompt the tests call, its objects' attributes and methods, and expected values
the tests build with its classes (``assert f() == Point(1, 2)`` with the solution's ``Point``
compares as the solution says; a handle never equals plain data). It cannot shadow builtins or
stdlib modules for the tests. (3) A handle answers each forwarded question (``len``, ``in``,
truth) on its own, so it may answer inconsistently where no plain value could; and it may
hand back any object the tests gave it. (4) Kernel exploits from inside the namespaces /
landlock / seccomp (it is not a VM). (5) With the audit hook as the only layer, Python-level
holes in the hook (one known: ``_imp.create_builtin`` rebuilds ``posix`` with
``pidfd_open``, and a pidfd signal is not an audited event, so the parent could be killed;
landlock, seccomp or the PID namespace each stop that). (6) Resource use up to the limits, and time: a slow or sleeping solution
costs wall time and scores the timeout reward.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("auto", "namespaces", "audit")
JOB_KINDS = ("asserts", "pytest", "stdio")
_HERE = Path(__file__).resolve().parent
_PROCESS_MODULES = ("sandbox_child", "sandbox_server", "sandbox_judge", "sandbox_remote", "sandbox_pytest",
                    "sandbox_wire", "sandbox_confine")
_NOBODY = 65534
_PROBE_TIMEOUT_S = 20.0
_CANCEL_POLL_S = 0.1
"""How often a run checks its cancel event and (without a private root) the disk use."""
_MAX_FILES = 100_000
_probe_cache: dict = {}


@dataclass
class SandboxLimits:
    """Resource limits of one sandbox run."""

    wall_s: float = 10.0
    """Wall-clock limit of the whole run (both interpreters' start-up included)."""
    cpu_s: float = 10.0
    """CPU-time limit of each process (RLIMIT_CPU; the kernel kills the program when it is used up)."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) in MiB of each process."""
    file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE) in MiB."""
    disk_mb: int = 64
    """Most MiB the program may write in total (all files in the sandbox directory)."""
    output_bytes: int = 1 << 20
    """Most bytes of stdout + stderr kept; a program printing more is killed. Also the cap of
    what one stdin/stdout case may print."""
    nproc: int = 512
    """RLIMIT_NPROC: processes + threads of the run's real uid (enforced for a non-root uid)."""


@dataclass
class SandboxResult:
    """Outcome of one sandbox run."""

    status: str
    """'passed', 'failed', 'timeout', 'output_limit' (stdout/stderr over ``output_bytes`` or
    files over ``disk_mb``), 'error' (the sandbox itself failed) or 'cancelled'."""
    cases_passed: int = 0
    """Test cases (an asserts program = 1 case, test functions, stdio cases) that passed."""
    cases_total: int = 0
    """Test cases run or planned."""
    detail: str = ""
    """First failure, the limit hit, or the error."""
    elapsed_s: float = 0.0
    """Wall-clock seconds of the run."""
    returncode: int | None = None
    """Exit status of the solution process (negative: killed by that signal)."""
    stdout: str = ""
    """What the solution printed (at most ``output_bytes``)."""
    stderr: str = ""
    """The solution's stderr (at most ``output_bytes``)."""
    isolation: list[str] = field(default_factory=list)
    """Layers that were active (see :attr:`Sandbox.layers`)."""

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
    """The ``unshare`` command prefix that works here and the namespaces it gives (probed once)."""
    if "ns" not in _probe_cache:
        prefix: list[str] = []
        layers: list[str] = []
        unshare = shutil.which("unshare")
        if unshare:
            base = [unshare, "--fork", "--kill-child", "--net", "--pid", "--mount", "--ipc", "--uts"]
            user = base[:1] + ["--user", "--map-root-user"] + base[1:]
            if os.geteuid() == 0 and _works(base + ["true"]):
                prefix, layers = base, ["netns", "pidns", "mntns", "ipcns"]
            elif _works(user + ["true"]):
                prefix, layers = user, ["userns", "netns", "pidns", "mntns", "ipcns"]
        _probe_cache["ns"] = (prefix, layers)
    return _probe_cache["ns"]  # type: ignore[return-value]


def kernel_filters() -> list[str]:
    """'landlock' and/or 'seccomp' when this kernel offers them (probed once)."""
    if "kernel" not in _probe_cache:
        from megatron_rl.reward import sandbox_confine

        found = ["landlock"] if sandbox_confine.landlock_abi() >= 1 else []
        try:
            with open("/proc/self/status") as f:
                has_seccomp = any(line.startswith("Seccomp:") for line in f)
        except OSError:
            has_seccomp = False
        if has_seccomp and os.uname().machine == "x86_64":
            found.append("seccomp")
        _probe_cache["kernel"] = found
    return list(_probe_cache["kernel"])


def drop_uid() -> tuple[int, int] | None:
    """(uid, gid) to run untrusted code as without a private root: when this process is root
    and ``nobody`` can start the interpreter from the host's file system (probed once)."""
    if "uid" not in _probe_cache:
        ids = None
        if os.geteuid() == 0:
            with tempfile.TemporaryDirectory() as cwd:
                if _works([_python(), "-I", "-S", "-c", "pass"], cwd=cwd, user=_NOBODY, group=_NOBODY, extra_groups=[]):
                    ids = (_NOBODY, _NOBODY)
        _probe_cache["uid"] = ids
    return _probe_cache["uid"]  # type: ignore[return-value]


def _precompile() -> None:
    """Byte-compile the modules the sandbox processes import (they run with ``-B`` and would
    otherwise compile them on every start). Best effort: a read-only checkout just runs slower."""
    if "compiled" in _probe_cache:
        return
    for name in _PROCESS_MODULES:
        source = str(_HERE / f"{name}.py")
        cached = importlib.util.cache_from_source(source)
        try:
            if not os.path.exists(cached) or os.path.getmtime(cached) < os.path.getmtime(source):
                py_compile.compile(source, cfile=cached, doraise=True)
        except (OSError, py_compile.PyCompileError) as exc:
            logger.debug("cannot byte-compile %s: %s", source, exc)
    _probe_cache["compiled"] = True


def _python() -> str:
    """The real interpreter (not a virtualenv's link to it): its prefix is what gets mounted."""
    return os.path.realpath(sys.executable)


def _system_paths() -> list[str]:
    """What the program may read besides its own directory (bound read-only in the private root,
    allowed by landlock and by the audit hook): the interpreter's installation and the
    directories its shared libraries and time-zone data come from (nested duplicates dropped)."""
    candidates = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix),
                  os.path.dirname(_python()), "/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib",
                  "/usr/share/zoneinfo"}
    real = sorted({os.path.realpath(p) for p in candidates if os.path.exists(p)})
    return [p for p in real if not any(p != q and p.startswith(q + "/") for q in real)]


class Sandbox:
    """Runs jobs in contained processes. Cheap to create after the first (probes are cached per
    process); see the module docstring for ``isolation``. ``kernel_filters=False`` leaves out
    landlock and seccomp (tests of the audit-hook layer alone)."""

    def __init__(self, isolation: str = "auto", base_dir: str | None = None, kernel_filters: bool = True) -> None:
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"reward.sandbox_isolation={isolation!r}: expected one of {ISOLATION_MODES}")
        self._base_dir = base_dir
        self._system = _system_paths()
        _precompile()
        self._plan = self._choose_plan(isolation, kernel_filters)

    def _choose_plan(self, isolation: str, filters: bool) -> dict:
        """The strongest set of layers whose probe run passes here, strongest first: namespaces
        (with the uid drop, then without), then (unless 'namespaces') none; each with the kernel
        filters, then without them. Cached per process."""
        key = ("plan", isolation, filters)
        if key in _probe_cache:
            return _probe_cache[key]
        kernel = globals()["kernel_filters"]() if filters else []
        bases = []
        prefix, ns_layers = namespace_prefix() if isolation != "audit" else ([], [])
        if prefix:
            if "userns" not in ns_layers:  # real root: drop to nobody inside the private root
                bases.append(dict(prefix=prefix, ns=ns_layers, root=True, uid=(_NOBODY, _NOBODY)))
            bases.append(dict(prefix=prefix, ns=ns_layers, root=True, uid=None))
        if isolation == "namespaces" and not bases:
            raise RuntimeError("reward.sandbox_isolation='namespaces' but `unshare` namespaces do not work here "
                               "(needs root or unprivileged user namespaces); use 'auto' or 'audit'")
        if isolation != "namespaces":
            bases.append(dict(prefix=[], ns=[], root=False, uid=drop_uid()))
        plans = [dict(base, kernel=k) for base in bases for k in ([kernel, []] if kernel else [[]])]
        failures = []
        for plan in plans:
            probe = self._execute(plan, _PROBE_JOB, SandboxLimits(wall_s=_PROBE_TIMEOUT_S))
            if probe.passed:
                if failures:
                    logger.warning("code sandbox: running with layers %s (%s)", _layers(plan), "; ".join(failures))
                _probe_cache[key] = plan
                return plan
            failures.append(f"a probe run with {_layers(plan)} failed: {probe.status} {probe.detail}")
        raise RuntimeError(f"reward.sandbox_isolation={isolation!r}: the code sandbox cannot run here: "
                           + "; ".join(failures))

    @property
    def layers(self) -> list[str]:
        """Isolation layers every run of this sandbox gets: namespaces ('userns', 'netns',
        'pidns', 'mntns', 'ipcns'), 'private_root', 'rlimits', 'uid_drop', 'landlock',
        'seccomp', 'audit_hook', and 'disk_poll' when the disk limit is the polling one."""
        return _layers(self._plan)

    def run(self, job: dict, limits: SandboxLimits, cancel: threading.Event | None = None) -> SandboxResult:
        """Run one job and judge it. ``job``: ``kind`` 'asserts' or 'pytest' with ``solution`` and
        ``tests`` (asserts: optional ``setup``, ``entry_point``), or 'stdio' with ``solution``
        and ``cases`` ([stdin, expected stdout] pairs). ``cancel``: when another thread sets it,
        the run is killed within ``_CANCEL_POLL_S`` and the result has status 'cancelled'."""
        _check_job(job)
        if cancel is not None and cancel.is_set():
            return SandboxResult("cancelled", detail="cancelled before it started", isolation=self.layers)
        return self._execute(self._plan, job, limits, cancel)

    def _execute(self, plan: dict, job: dict, limits: SandboxLimits, cancel=None) -> SandboxResult:
        from megatron_rl.reward.sandbox_run import execute

        return execute(plan, job, limits, cancel, base_dir=self._base_dir, system_paths=self._system,
                       python=_python())


_PROBE_JOB = {"kind": "stdio", "solution": "import typing, json\nprint(int(input()) + 1)\n", "cases": [["41", "42"]]}


def _layers(plan: dict) -> list[str]:
    return (plan["ns"] + (["private_root"] if plan["root"] else []) + ["rlimits"]
            + (["uid_drop"] if plan["uid"] else []) + plan["kernel"] + ["audit_hook"]
            + ([] if plan["root"] else ["disk_poll"]))


def _check_job(job: dict) -> None:
    kind = job.get("kind")
    if kind not in JOB_KINDS:
        raise ValueError(f"sandbox job kind {kind!r}: expected one of {JOB_KINDS}")
    needed = ("solution", "cases") if kind == "stdio" else ("solution", "tests")
    for key in needed:
        if key not in job:
            raise ValueError(f"sandbox job of kind {kind!r} needs {key!r}")
    if kind == "stdio" and not all(isinstance(c, (list, tuple)) and len(c) == 2 and all(isinstance(x, str) for x in c)
                                   for c in job["cases"]):
        raise ValueError("sandbox job 'cases' must be [stdin, expected stdout] string pairs")
