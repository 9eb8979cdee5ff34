"""The code sandbox as its users see it: :class:`Sandbox` probes which isolation layers work on
this host (once per process), chooses the strongest plan whose probe run passes, and runs jobs
under it (:mod:`~megatron_rl.reward.sandbox.supervisor`). The design, the threat model and what
remains possible are in the package docstring (:mod:`megatron_rl.reward.sandbox`).
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from megatron_rl.reward.sandbox import supervisor
from megatron_rl.reward.sandbox.confined import sandbox_confine
from megatron_rl.reward.sandbox.job import SandboxLimits, SandboxResult, check_job, layer_names

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("auto", "namespaces", "audit")
_NOBODY = 65534
_PROBE_TIMEOUT_S = 20.0
_probe_cache: dict = {}


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
        supervisor.precompile_confined()
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
                    logger.warning("code sandbox: running with layers %s (%s)", layer_names(plan), "; ".join(failures))
                _probe_cache[key] = plan
                return plan
            failures.append(f"a probe run with {layer_names(plan)} failed: {probe.status} {probe.detail}")
        raise RuntimeError(f"reward.sandbox_isolation={isolation!r}: the code sandbox cannot run here: "
                           + "; ".join(failures))

    @property
    def layers(self) -> list[str]:
        """Isolation layers every run of this sandbox gets: namespaces ('userns', 'netns',
        'pidns', 'mntns', 'ipcns'), 'private_root', 'rlimits', 'uid_drop', 'landlock',
        'seccomp', 'audit_hook', and 'disk_poll' when the disk limit is the polling one."""
        return layer_names(self._plan)

    def run(self, job: dict, limits: SandboxLimits, cancel: threading.Event | None = None) -> SandboxResult:
        """Run one job and judge it. ``job``: ``kind`` 'asserts' or 'pytest' with ``solution`` and
        ``tests`` (asserts: optional ``setup``, ``entry_point``), or 'stdio' with ``solution``
        and ``cases`` ([stdin, expected stdout] pairs). ``cancel``: when another thread sets it,
        the run is killed within ``supervisor.CANCEL_POLL_S`` and the result has status 'cancelled'."""
        check_job(job)
        if cancel is not None and cancel.is_set():
            return SandboxResult("cancelled", detail="cancelled before it started", isolation=self.layers)
        return self._execute(self._plan, job, limits, cancel)

    def _execute(self, plan: dict, job: dict, limits: SandboxLimits, cancel=None) -> SandboxResult:
        return supervisor.execute(plan, job, limits, cancel, base_dir=self._base_dir, system_paths=self._system,
                       python=_python())


_PROBE_JOB = {"kind": "stdio", "solution": "import typing, json\nprint(int(input()) + 1)\n", "cases": [["41", "42"]]}

