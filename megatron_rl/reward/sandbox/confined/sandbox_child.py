"""The solution process of a sandbox run: the only place untrusted code executes.

Started by :mod:`megatron_rl.reward.sandbox.supervisor` as ``python -I -S -B -c "...; main()"``
(inside ``unshare`` namespaces when they are available). It reads its job (marshal, from the trusted
parent: the solution, the setup code, the limits, its pipe descriptors) from stdin, then, before
any untrusted code runs:

1. confines itself (:mod:`sandbox_confine`: private root file system with a size-limited
   writable tmpfs, rlimits, uid drop, landlock, seccomp; whichever the parent asked for), and
   reports the layers it got on the report pipe, which it then closes;
2. installs the audit hook below (a Python-level layer: clear error messages, and the only file
   and process barrier on a box that has neither namespaces nor landlock/seccomp).

Then it loads the solution as module ``solution`` and *serves* the judge process over a pipe
pair (:mod:`sandbox_wire`): the judge asks for module attributes, calls functions, reads
attributes, iterates, or runs the whole program on one stdin (stdin/stdout problems); this
process answers with plain data or handles. It never sees the tests or the expected outputs and
it holds no secret: whatever the solution does to this interpreter (patching ``json``,
``os.write``, builtins, this runner's own functions; walking frames; exiting early; printing
anything) can only change the answers it gives, never the judge's verdict. That is why the
audit hook no longer needs to forbid frame introspection (``typing``, ``dataclasses``,
``enum``, ``namedtuple``, ``logging``, ``traceback`` and friends use it).
"""
import io
import marshal
import os
import sys

_DENIED_EVENTS = (
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "os.killpg",
    "subprocess.Popen", "pty.spawn", "signal.pthread_kill", "ctypes.", "socket.", "sys.settrace",
    "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "os.chroot",
    "os.setuid", "os.setgid", "resource.setrlimit", "resource.prlimit", "fcntl.ioctl", "mmap.__new__",
    "sys.remote_exec", "webbrowser.open", "urllib.Request", "ftplib.", "http.client.", "smtplib.",
    "code.__new__", "_xxsubinterpreters.",
)
# ctypes (native calls), process spawning, sockets, and sub-interpreters (they would run without
# this hook: audit hooks added from Python are per interpreter); the test extension modules
# offer raw memory access.
_DENIED_IMPORTS = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_socket", "socket", "multiprocessing",
                             "_multiprocessing", "_posixshmem", "_xxsubinterpreters", "_xxinterpchannels",
                             "_testcapi", "_testinternalcapi", "_testbuffer", "_ctypes_test", "_xxtestfuzz",
                             "_testmultiphase", "_testclinic", "_testimportmultiple", "posix", "_signal"})
# Calls that reach other processes without an audit event: taken out of the modules (a fresh
# copy of posix/_signal is a refused import; ``_imp.create_builtin`` still makes one, so on a
# box with neither landlock nor seccomp nor namespaces this is a speed bump, not a barrier).
_UNAUDITED = {"posix": ("pidfd_open",), "os": ("pidfd_open",), "_signal": ("pidfd_send_signal",),
              "signal": ("pidfd_send_signal",)}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_WRITE_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "os.chflags": (0,), "os.mkfifo": (0,), "os.mknod": (0,), "shutil.rmtree": (0,),
    "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (1,), "os.setxattr": (0,),
    "os.removexattr": (0,),
}
_PATH_READ_EVENTS = {"os.listdir": 0, "os.scandir": 0, "os.chdir": 0, "glob.glob": 0, "os.getxattr": 0,
                     "os.listxattr": 0, "shutil.copyfile": 0}
_DEVICES = frozenset({"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"})


def make_hook(sandbox: str, read_roots: list[str], os_fs_layer: bool):
    """The audit hook. Everything it calls is captured here, as C functions bound in its
    closure, so patching ``os``, ``os.path`` or ``builtins`` later cannot change its answers,
    and it never calls an object of the program's making (a path must be an exact str, bytes or
    int; other path-like objects are left to the kernel layers, or refused without them)."""
    import _stat
    import posix

    lstat, readlink, getcwd, getpid, is_link = posix.lstat, posix.readlink, posix.getcwd, posix.getpid, _stat.S_ISLNK
    str_t, bytes_t, int_t, type_ = str, bytes, int, type
    fs_encoding = sys.getfilesystemencoding()
    decode_bytes, perm_error, imp_error = bytes.decode, PermissionError, ImportError
    allowed_write, allowed_read = (sandbox,), (sandbox, *read_roots)
    denied_events, denied_imports, write_flags = _DENIED_EVENTS, _DENIED_IMPORTS, _WRITE_FLAGS
    write_events, read_events, devices = _PATH_WRITE_EVENTS, _PATH_READ_EVENTS, _DEVICES

    def resolve(path: str) -> str:
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        todo, out, hops = path.split("/")[::-1], [], 0
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if out:
                    out.pop()
                continue
            out.append(part)
            current = "/" + "/".join(out)
            try:
                mode = lstat(current).st_mode
            except OSError:
                continue
            if is_link(mode):
                hops += 1
                if hops > 40:
                    raise perm_error("sandbox: too many symbolic links")
                target = readlink(current)
                out.pop()
                if target.startswith("/"):
                    out = []
                todo.extend(target.split("/")[::-1])
        return "/" + "/".join(out)

    def inside(path, roots) -> bool:
        kind = type_(path)
        if kind is int_t:
            return True  # an open descriptor: opening it was checked
        if kind is bytes_t:
            path = decode_bytes(path, fs_encoding, "surrogateescape")
        elif kind is not str_t:
            if os_fs_layer:
                return True  # the kernel layers decide; calling __fspath__ here would run program code
            raise perm_error(f"sandbox: paths of type {kind.__name__} are not allowed")
        real = resolve(path)
        for root in roots:
            if real == root or real.startswith(root + "/"):
                return True
        return False

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if path is None:
                return
            writing = (type_(mode) is str_t and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) \
                or bool((flags or 0) & write_flags)
            if writing:
                ok = (type_(path) is str_t and path == "/dev/null") or inside(path, allowed_write)
            else:
                ok = (type_(path) is str_t and path in devices) or inside(path, allowed_read)
            if not ok:
                raise perm_error(f"sandbox: {'writing' if writing else 'reading'} {path!r} is not allowed")
            return
        if event == "import":
            if args[0].split(".")[0] in denied_imports:
                raise imp_error(f"sandbox: module {args[0]!r} is not allowed")
            return
        if event == "os.kill":
            if args[0] != getpid():
                raise perm_error("sandbox: signals to other processes are not allowed")
            return
        if event in write_events:
            for i in write_events[event]:
                if i < len(args) and args[i] is not None and not inside(args[i], allowed_write):
                    raise perm_error(f"sandbox: {event} on {args[i]!r} is not allowed")
        if event in read_events:
            i = read_events[event]
            if i < len(args) and args[i] is not None and not inside(args[i], allowed_read):
                raise perm_error(f"sandbox: {event} on {args[i]!r} is not allowed")
            return
        if event.startswith(denied_events):
            raise perm_error(f"sandbox: {event} is not allowed")

    return hook


class _CappedBytes(io.BytesIO):
    """What a stdin/stdout case prints: refuses to grow past ``cap`` bytes."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self._cap = cap

    def write(self, data) -> int:
        if self.tell() + len(data) > self._cap:
            raise RuntimeError(f"output exceeds {self._cap} bytes")
        return super().write(data)


def _text_sink(cap: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(_CappedBytes(cap), encoding="utf-8", errors="replace", write_through=True)


def _sink_text(sink: io.TextIOWrapper) -> str:
    sink.flush()
    return sink.buffer.getvalue().decode("utf-8", "replace")


def _forget_own_directory() -> None:
    """The bootstrap put this file's directory (``confined/``, nothing but this process's code)
    first on sys.path to import its siblings; once they are loaded the solution gets the
    standard library's path only."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p) != here]


def main() -> None:
    import sandbox_confine
    import sandbox_server
    import sandbox_wire
    _forget_own_directory()
    job = marshal.loads(sys.stdin.buffer.read())  # from the parent, which is trusted
    report_fd = job["fds"]["report"]
    try:
        layers = sandbox_confine.apply(job["confine"])
    except OSError as exc:
        os.write(report_fd, sandbox_wire.dumps({"error": f"confinement failed: {exc}"}).encode())
        os._exit(3)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    fs_layer = "private_root" in layers or "landlock" in layers
    import signal  # noqa: F401 - loaded here so that its copy of pidfd_send_signal goes too

    for module, names in _UNAUDITED.items():
        for name in names:
            if hasattr(sys.modules.get(module), name):
                delattr(sys.modules[module], name)
    sys.addaudithook(make_hook(os.getcwd(), job["read_roots"], fs_layer))
    layers.append("audit_hook")
    os.write(report_fd, sandbox_wire.dumps({"layers": layers}).encode())
    os.close(report_fd)
    # Forget the FFI the confinement used: importing it again is an audited (refused) import, and
    # its calls are audited events the hook refuses too.
    for name in [m for m in sys.modules if m in ("_ctypes", "sandbox_confine") or m.split(".")[0] == "ctypes"]:
        del sys.modules[name]
    del sandbox_confine
    server = sandbox_server.Server(job, text_sink=_text_sink, sink_text=_sink_text)
    server.run()


if __name__ == "__main__":
    main()
