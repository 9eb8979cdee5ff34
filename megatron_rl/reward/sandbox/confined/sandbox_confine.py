"""Kernel-level confinement of a sandbox process, applied to itself before it runs anything
untrusted (stdlib only: libc is called through ``_ctypes``, no compiled helper; the ``ctypes``
package itself is not imported, it would cost every sandbox process tens of milliseconds).

Used by both processes of a sandbox run (see :mod:`megatron_rl.reward.sandbox`): the solution
process gets every layer, the judge process the ones that apply without namespaces. Each layer
is a kernel mechanism, so it holds whatever Python code runs afterwards, native code included:

* **private root** (:func:`private_root`, only inside a fresh mount namespace, i.e. after
  ``unshare --mount``): a new root file system made of a tmpfs holding read-only bind mounts of
  the interpreter's installation and the system libraries it loads, four device nodes (null,
  zero, random, urandom) and one writable tmpfs of ``disk_mb`` MiB at the sandbox directory's
  path. ``pivot_root`` + a detached unmount of the old root: the host's files (the repo, /etc,
  ~/.ssh, other users' data) are not just forbidden, they are absent. The tmpfs size is the
  total-disk-use limit (writes past it fail with ENOSPC).
* **rlimits** (:func:`set_rlimits`): CPU seconds, address space, largest file, open files,
  processes, no core dumps.
* **uid drop** (:func:`drop_privileges`): to ``nobody`` when asked (as real root after the
  private root is built, which is what makes the interpreter readable by ``nobody``).
* **landlock** (:func:`landlock`, Linux 5.13+, no privileges needed, applies to root too):
  file access only beneath the given read-only and read-write paths; TCP bind/connect refused
  (ABI 4+); signals to and abstract UNIX sockets of processes outside the domain refused
  (ABI 6+). On a box without namespaces this is what keeps the host's files out of reach.
* **seccomp** (:func:`seccomp`, x86-64 only): a BPF filter refusing new processes (fork, vfork,
  clone without CLONE_THREAD, clone3, execve), sockets, ptrace and cross-process memory access,
  and the mount / namespace / kernel-administration calls. Threads still work.

``no_new_privs`` is set before landlock and seccomp (the kernel requires it for both without
CAP_SYS_ADMIN, and it stops set-uid binaries from undoing them).
"""
from __future__ import annotations

import _ctypes
import os
import resource

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")


class _Long(_ctypes._SimpleCData):
    _type_ = "l"


class _Char(_ctypes._SimpleCData):
    _type_ = "c"


class _Func(_ctypes.CFuncPtr):
    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = _Long


class _Libc:
    _handle = _ctypes.dlopen(None, getattr(_ctypes, "RTLD_LOCAL", 0))


def _call(name: str, *args) -> int:
    """libc ``name``(args): ints travel as C longs (right for the variadic syscall/prctl),
    bytes as pointers to their buffer, None as NULL."""
    return _Func((name, _Libc))(*[_Long(a) if type(a) is int else a for a in args])


def _buffer(data: bytes):
    """A C copy of ``data`` (kept alive by the caller) and its address."""
    array = type("_Bytes", (_ctypes.Array,), {"_type_": _Char, "_length_": len(data)}).from_buffer_copy(data)
    return array, _ctypes.addressof(array)


def _u64s(*values: int) -> bytes:
    return b"".join(v.to_bytes(8, "little") for v in values)


def _errno() -> int:
    return _ctypes.get_errno()


class ConfineError(OSError):
    """A confinement step failed (the message names it)."""


def _check(result: int, what: str) -> int:
    if result < 0:
        err = _errno()
        raise ConfineError(err, f"{what}: {os.strerror(err)}")
    return result


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype)]
    options = None if data is None else data.encode()
    _check(_call("mount", *args, flags, options), f"mount {source or fstype} on {target}")


# --------------------------------------------------------------------------- private root
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}


def _locked_flags(path: str) -> int:
    """The source mount's noexec/atime flags: in a user namespace they are locked, and a
    read-only remount that dropped them would be refused."""
    flags = os.statvfs(path).f_flag
    out = 0
    for st_flag, ms_flag in ((os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048),
                             (os.ST_RELATIME, 1 << 21)):
        if flags & st_flag:
            out |= ms_flag
    return out


def private_root(new_root: str, read_only: list[str], work_dir: str, disk_mb: int,
                 owner: tuple[int, int] | None) -> None:
    """Replace this process's root file system (needs a fresh mount namespace and
    CAP_SYS_ADMIN in it). ``new_root`` is an existing empty directory used as the mount point
    (the new root is private to this namespace, so the host sees it stay empty);
    ``read_only`` are host paths bound read-only at the same paths; ``work_dir`` becomes a
    ``disk_mb`` MiB tmpfs (owned by ``owner`` when given), the only writable place. Ends with the
    current directory at ``work_dir``."""
    arch = os.uname().machine
    if arch not in _SYS_PIVOT_ROOT:
        raise ConfineError(0, f"pivot_root: unsupported architecture {arch}")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID, "size=8m,mode=0755")
    for path in sorted(set(read_only)):
        if not os.path.exists(path):
            continue
        target = new_root + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        _mount(path, target, None, MS_BIND | MS_REC)
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(path))
    os.makedirs(new_root + "/dev", exist_ok=True)
    for dev in DEVICES:
        open(new_root + dev, "a").close()
        _mount(dev, new_root + dev, None, MS_BIND)
    os.makedirs(new_root + work_dir, exist_ok=True)
    options = f"size={max(1, int(disk_mb))}m,mode=0700"
    if owner is not None:
        options += f",uid={owner[0]},gid={owner[1]}"
    _mount("tmpfs", new_root + work_dir, "tmpfs", MS_NOSUID | MS_NODEV, options)
    old = new_root + "/.old_root"
    os.mkdir(old)
    _check(_call("syscall", _SYS_PIVOT_ROOT[arch], new_root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(_call("umount2", b"/.old_root", MNT_DETACH), "umount the old root")
    os.rmdir("/.old_root")
    # The skeleton (mount points) becomes read-only too: only work_dir and /dev/null take writes.
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
    os.chdir(work_dir)


# --------------------------------------------------------------------------- rlimits / uid
def set_rlimits(cpu_s: int, memory_mb: int, file_mb: int, nproc: int, nofile: int = 64) -> None:
    """CPU seconds (soft; hard one more), address space, largest file, processes, open files,
    no core dumps."""
    memory, fsize = int(memory_mb) << 20, int(file_mb) << 20
    for name, value in (("RLIMIT_CPU", (int(cpu_s), int(cpu_s) + 1)), ("RLIMIT_AS", (memory, memory)),
                        ("RLIMIT_FSIZE", (fsize, fsize)), ("RLIMIT_CORE", (0, 0)),
                        ("RLIMIT_NOFILE", (nofile, nofile)), ("RLIMIT_NPROC", (nproc, nproc))):
        resource.setrlimit(getattr(resource, name), value)


def drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def no_new_privs() -> None:
    _check(_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


# --------------------------------------------------------------------------- landlock
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446  # same numbers on every architecture
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1, 2, 4, 8
_LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 14, 1 << 15
_LL_FILE_RIGHTS = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV


def landlock_abi() -> int:
    """Landlock ABI version of the running kernel (0: unavailable)."""
    return max(0, int(_call("syscall", _LL_CREATE, None, 0, 1)))


def landlock(read_only: list[str], read_write: list[str], devices: tuple[str, ...] = DEVICES) -> int:
    """Restrict this process (and any thread or child it makes later) to the given paths.
    Returns the ABI version used. Raises ConfineError when landlock is unavailable."""
    abi = landlock_abi()
    if abi < 1:
        raise ConfineError(0, "landlock is not available in this kernel")
    handled = (1 << 13) - 1                 # ABI 1: execute ... make_sym
    if abi >= 2:
        handled |= 1 << 13                  # refer (rename/link across directories)
    if abi >= 3:
        handled |= _LL_TRUNCATE
    if abi >= 5:
        handled |= _LL_IOCTL_DEV
    fields = [handled]
    if abi >= 4:
        fields.append(0b11)                 # TCP bind + connect, with no port allowed
    if abi >= 6:
        fields.append(0b11)                 # scoped: abstract UNIX sockets + signals
    attr = _u64s(*fields)
    ruleset = _check(_call("syscall", _LL_CREATE, attr, len(attr), 0), "landlock_create_ruleset")
    make_rights = (1 << 4) | (1 << 5) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 12)
    try:
        rules = [(p, _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR) for p in read_only]
        rules += [(p, _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR | _LL_WRITE_FILE | make_rights
                   | (1 << 13) | _LL_TRUNCATE) for p in read_write]
        rules += [(d, _LL_READ_FILE | _LL_WRITE_FILE | _LL_TRUNCATE) for d in devices]
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not os.path.isdir(path):
                    rights &= _LL_FILE_RIGHTS
                # struct landlock_path_beneath_attr (packed): u64 allowed_access, s32 parent_fd
                rule = (rights & handled).to_bytes(8, "little") + fd.to_bytes(4, "little", signed=True)
                _check(_call("syscall", _LL_ADD_RULE, ruleset, 1, rule, 0), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        _check(_call("syscall", _LL_RESTRICT, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


# --------------------------------------------------------------------------- seccomp
_AUDIT_ARCH_X86_64 = 0xC000003E
_CLONE_THREAD = 0x00010000
_EPERM, _ENOSYS = 1, 38
# x86-64 numbers (asm/unistd_64.h). Refused with EPERM: new processes and programs, sockets,
# tracing and other processes' memory, mounts and namespaces, keys, bpf/perf/io_uring/userfaultfd
# (common kernel attack surface), modules, reboot/swap/clock/quota/syslog, device nodes,
# handle-based opens that bypass path checks.
_DENY_X86_64 = (57, 58, 59, 322, 41, 53, 101, 310, 311, 312, 165, 166, 155, 161, 272, 308, 250, 248, 249,
                321, 298, 323, 425, 426, 427, 246, 320, 175, 313, 176, 169, 167, 168, 133, 259, 163, 164,
                227, 305, 159, 172, 173, 179, 103, 304, 303, 153, 430, 431, 432, 429, 428, 433, 442, 438,
                424, 134, 212)
_SYS_CLONE, _SYS_CLONE3 = 56, 435


def _seccomp_program() -> list[tuple[int, int, int, int]]:
    """The classic-BPF program as (code, jt, jf, k) tuples; jumps are written as labels and
    resolved to the relative offsets the kernel expects."""
    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    code: list[list] = []
    labels: dict[str, int] = {}

    def emit(op: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        code.append([op, jt, jf, k])

    emit(ld_abs, 4)                                   # A = arch
    emit(jeq, _AUDIT_ARCH_X86_64, 0, "kill")
    emit(ld_abs, 0)                                   # A = syscall number
    emit(jge, 0x40000000, "eperm", 0)                 # x32 ABI numbers
    for nr in _DENY_X86_64:
        emit(jeq, nr, "eperm", 0)
    emit(jeq, _SYS_CLONE3, "enosys", 0)               # glibc then falls back to clone(2)
    emit(jeq, _SYS_CLONE, 0, "allow")
    emit(ld_abs, 16)                                  # A = low word of clone's flags
    emit(jset, _CLONE_THREAD, "allow", "eperm")       # a thread is fine, a process is not
    for name, action in (("allow", 0x7FFF0000), ("eperm", 0x00050000 | _EPERM),
                         ("enosys", 0x00050000 | _ENOSYS), ("kill", 0x80000000)):
        labels[name] = len(code)
        emit(ret, action)
    out = []
    for i, (op, jt, jf, k) in enumerate(code):
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        assert 0 <= jt < 256 and 0 <= jf < 256
        out.append((op, jt, jf, k))
    return out


def seccomp() -> None:
    """Install the filter (x86-64 only; ConfineError elsewhere). Needs no_new_privs first."""
    if os.uname().machine != "x86_64":
        raise ConfineError(0, f"seccomp filter: unsupported architecture {os.uname().machine}")
    prog = _seccomp_program()
    # struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}; struct sock_fprog {u16 len; (pad); ptr}
    code = b"".join(op.to_bytes(2, "little") + bytes((jt, jf)) + k.to_bytes(4, "little") for op, jt, jf, k in prog)
    keep, address = _buffer(code)
    fprog = len(prog).to_bytes(8, "little") + address.to_bytes(8, "little")
    _check(_call("prctl", PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0), "prctl(SECCOMP)")
    del keep


def apply(spec: dict) -> list[str]:
    """Apply the layers ``spec`` asks for, in order; returns the names of those applied.

    ``spec``: ``root`` (kwargs of :func:`private_root`, or absent), ``rlimits`` (kwargs of
    :func:`set_rlimits`), ``uid`` ([uid, gid] or absent), ``landlock`` ({'ro': [...], 'rw':
    [...]} or absent), ``seccomp`` (bool), ``require`` (layer names whose failure is fatal;
    others that fail are skipped and left out of the result).
    """
    required = set(spec.get("require", ()))
    done: list[str] = []

    def step(name: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except (OSError, ValueError) as exc:
            if name in required:
                raise ConfineError(getattr(exc, "errno", 0) or 0, f"{name}: {exc}") from None
            return
        done.append(name)

    if spec.get("root"):
        step("private_root", private_root, **spec["root"])
    step("rlimits", set_rlimits, **spec["rlimits"])
    if spec.get("uid"):
        step("uid_drop", drop_privileges, *spec["uid"])
    if spec.get("landlock") or spec.get("seccomp"):
        no_new_privs()
    if spec.get("landlock"):
        step("landlock", landlock, spec["landlock"]["ro"], spec["landlock"]["rw"])
    if spec.get("seccomp"):
        step("seccomp", seccomp)
    return done
