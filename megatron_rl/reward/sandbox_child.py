"""The program that runs *inside* the code sandbox (stdlib only; started with ``python -I -S``).

It is launched by :mod:`megatron_rl.reward.sandbox` in a fresh, throwaway directory, reads one
JSON job from stdin, then, before any untrusted code runs:

1. sets resource limits (CPU seconds, address space, file size, open files, processes, no core),
2. drops to an unprivileged uid/gid when the parent asked for it (root on a cluster node),
3. installs a Python audit hook that refuses files outside the sandbox directory (reads are
   also allowed under the interpreter's stdlib), sockets, new processes and signals, ctypes,
   and the introspection calls (frames, tracers, gc) that could reach this runner's state.

It then runs the job (``asserts``: one program, e.g. solution + asserts; ``pytest``: solution
saved as ``solution.py`` and every ``test_*`` function of the test module called;
``stdio``: the program run once per (stdin, expected stdout) case) and prints a verdict line
``<nonce> <json>`` last. The nonce came with the job and exists only in this runner's memory, so
a program that exits early (``os._exit(0)``) or prints a fake verdict cannot pass.

The audit hook is a second line of defence inside the interpreter; the process-level limits,
namespaces and uid drop set up by the parent are the first (see the sandbox module docstring).
"""
import io
import json
import os
import resource
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DENIED_EVENTS = (
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "os.kill",
    "os.killpg", "subprocess.Popen", "pty.spawn", "signal.pthread_kill", "ctypes.", "socket.",
    "sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents", "os.chroot", "os.setuid", "os.setgid",
    "resource.setrlimit", "resource.prlimit", "fcntl.ioctl", "mmap.__new__",
    "sys.remote_exec", "webbrowser.open", "urllib.Request", "ftplib.", "http.client.", "smtplib.",
    "os.putenv", "os.unsetenv",
)
_DENIED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess", "_socket", "socket", "multiprocessing"}
# Frame-bearing attributes: reaching any frame gives access to this runner's locals (the nonce).
_DENIED_ATTRS = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"}
_PATH_WRITE_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "os.chflags": (0,), "os.mkfifo": (0,), "os.mknod": (0,), "shutil.rmtree": (0,),
    "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (1,), "os.setxattr": (0,),
    "os.removexattr": (0,),
}
_PATH_READ_EVENTS = {"os.listdir": 0, "os.scandir": 0, "os.chdir": 0, "glob.glob": 0, "os.getxattr": 0,
                     "os.listxattr": 0, "shutil.copyfile": 0}
_DEVICES = {"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"}


_PYTEST_SHIM = '''"""The few pytest helpers test files of code datasets use (pytest itself is not available)."""
import math


class _Raises:
    def __init__(self, expected, match=None):
        self.expected, self.match = expected, match

    def __enter__(self):
        return self

    def __exit__(self, typ, value, tb):
        if typ is None:
            raise AssertionError(f"DID NOT RAISE {self.expected}")
        if not issubclass(typ, self.expected):
            return False
        if self.match is not None:
            import re
            if not re.search(self.match, str(value)):
                raise AssertionError(f"{value!r} does not match {self.match!r}")
        self.value = value
        return True


def raises(expected, *args, match=None, **kwargs):
    if args:
        with _Raises(expected, match):
            args[0](*args[1:], **kwargs)
        return None
    return _Raises(expected, match)


class approx:
    def __init__(self, expected, rel=1e-6, abs=1e-12):
        self.expected, self.rel, self.abs = expected, rel, abs

    def _close(self, a, b):
        return math.isclose(a, b, rel_tol=self.rel, abs_tol=self.abs)

    def __eq__(self, other):
        if isinstance(self.expected, (list, tuple)):
            return len(other) == len(self.expected) and all(self._close(a, b) for a, b in zip(other, self.expected))
        return self._close(other, self.expected)


class _Mark:
    def parametrize(self, names, values):
        def wrap(fn):
            single = "," not in names if isinstance(names, str) else len(names) == 1
            fn._sandbox_params = [(v,) if single else tuple(v) for v in values]
            return fn
        return wrap

    def __getattr__(self, name):
        return lambda *a, **k: (a[0] if len(a) == 1 and callable(a[0]) and not k else (lambda fn: fn))


mark = _Mark()
'''


class _CappedText(io.StringIO):
    """stdout of a stdio case: refuses to grow past ``cap`` characters (huge outputs)."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self._cap = cap

    def write(self, text: str) -> int:
        if self.tell() + len(text) > self._cap:
            raise RuntimeError(f"output exceeds {self._cap} characters")
        return super().write(text)


def _set_limits(limits: dict) -> None:
    cpu = int(limits["cpu_s"])
    memory = int(limits["memory_mb"]) << 20
    fsize = int(limits["file_mb"]) << 20
    for name, value in (("RLIMIT_CPU", (cpu, cpu + 1)), ("RLIMIT_AS", (memory, memory)),
                        ("RLIMIT_FSIZE", (fsize, fsize)), ("RLIMIT_CORE", (0, 0)),
                        ("RLIMIT_NOFILE", (64, 64)), ("RLIMIT_NPROC", (limits["nproc"], limits["nproc"]))):
        resource.setrlimit(getattr(resource, name), value)


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _make_hook(sandbox: str, read_roots: list[str]):
    sandbox = os.path.realpath(sandbox)
    roots = [os.path.realpath(r) for r in read_roots]

    def inside(path, allowed) -> bool:
        if isinstance(path, int):  # an already-open descriptor: opening it was checked
            return True
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            path = os.fspath(path)
        real = os.path.realpath(path)  # resolves '..' and symlinks planted in the sandbox
        return any(real == a or real.startswith(a + os.sep) for a in allowed)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if path is None:
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            if writing:
                ok = inside(path, [sandbox]) or (isinstance(path, str) and path == "/dev/null")
            else:
                ok = inside(path, [sandbox] + roots) or (isinstance(path, str) and path in _DEVICES)
            if not ok:
                raise PermissionError(f"sandbox: {'writing' if writing else 'reading'} {path!r} is not allowed")
            return
        if event == "import":
            if args[0].split(".")[0] in _DENIED_IMPORTS:
                raise ImportError(f"sandbox: module {args[0]!r} is not allowed")
            return
        if event == "object.__getattr__":
            if args[1] in _DENIED_ATTRS:
                raise PermissionError(f"sandbox: attribute {args[1]!r} is not allowed")
            return
        if event in _PATH_WRITE_EVENTS:
            for i in _PATH_WRITE_EVENTS[event]:
                if i < len(args) and args[i] is not None and not inside(args[i], [sandbox]):
                    raise PermissionError(f"sandbox: {event} on {args[i]!r} is not allowed")
        if event in _PATH_READ_EVENTS:
            i = _PATH_READ_EVENTS[event]
            if i < len(args) and args[i] is not None and not inside(args[i], [sandbox] + roots):
                raise PermissionError(f"sandbox: {event} on {args[i]!r} is not allowed")
            return
        if event.startswith(_DENIED_EVENTS):
            raise PermissionError(f"sandbox: {event} is not allowed")

    return hook


def _run_program(source: str, filename: str) -> None:
    code = compile(source, filename, "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


def _run_job(job: dict) -> dict:
    kind = job["kind"]
    if kind == "asserts":
        _run_program(job["program"], "solution.py")
        return {"passed": True, "cases_passed": 1, "cases_total": 1}
    if kind == "pytest":
        with open("solution.py", "w") as f:
            f.write(job["program"])
        with open("pytest.py", "w") as f:  # KodCode tests use pytest.raises/approx/parametrize
            f.write(_PYTEST_SHIM)
        sys.path.insert(0, os.getcwd())
        namespace = {"__name__": "test_solution", "__builtins__": __builtins__}
        exec(compile(job["tests"], "test_solution.py", "exec"), namespace)
        tests = []
        for name, fn in sorted(namespace.items()):
            if name.startswith("test") and callable(fn) and not isinstance(fn, type):
                tests.extend((name, fn, args) for args in getattr(fn, "_sandbox_params", [()]))
        if not tests:
            return {"passed": False, "cases_passed": 0, "cases_total": 0, "error": "no test_* functions"}
        for i, (name, fn, args) in enumerate(tests):
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - any failure fails the case
                return {"passed": False, "cases_passed": i, "cases_total": len(tests),
                        "error": f"{name}: {type(exc).__name__}: {exc}"[:500]}
        return {"passed": True, "cases_passed": len(tests), "cases_total": len(tests)}
    if kind == "stdio":
        code = compile(job["program"], "solution.py", "exec")
        cases = job["cases"]
        real_stdin, real_stdout = sys.stdin, sys.stdout
        for i, (stdin, expected) in enumerate(cases):
            out = _CappedText(job["output_cap"])
            sys.stdin, sys.stdout = io.StringIO(stdin), out
            try:
                exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    raise
            finally:
                sys.stdin, sys.stdout = real_stdin, real_stdout
            if out.getvalue().split() != str(expected).split():
                got = out.getvalue()
                return {"passed": False, "cases_passed": i, "cases_total": len(cases),
                        "error": f"case {i}: expected {str(expected)[:80]!r}, got {got[:80]!r}"}
        return {"passed": True, "cases_passed": len(cases), "cases_total": len(cases)}
    raise ValueError(f"unknown job kind {kind!r}")


def main() -> None:
    job = json.loads(sys.stdin.readline())
    sys.stdin.close()
    sys.stdin = open(os.devnull)
    _set_limits(job["limits"])
    if job.get("uid") is not None:
        _drop_privileges(job["uid"], job["gid"])
    nonce = job.pop("nonce")
    sys.addaudithook(_make_hook(os.getcwd(), job["read_roots"]))
    try:
        verdict = _run_job(job)
    except BaseException as exc:  # noqa: BLE001 - any failure of untrusted code is a verdict
        verdict = {"passed": False, "cases_passed": 0, "cases_total": 1,
                   "error": f"{type(exc).__name__}: {exc}"[:500]}
    sys.stdout.flush()
    # Written to fd 1 directly: user code may have replaced or closed sys.stdout.
    os.write(1, ("\n" + nonce + " " + json.dumps(verdict) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
