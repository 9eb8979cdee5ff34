"""Run a function in a killable grading process with a hard wall-clock timeout per call.

:class:`IsolatedCall` starts one fresh interpreter, the *fork server*, which imports and warms
up the grading code once (~1 s) and then only forks: each *worker* it forks is a warm copy
(copy-on-write) that answers ``(fn, args)`` requests over two pipes from the caller. A call that
overruns its timeout is ended by having the server SIGKILL that worker; the next call gets a
new fork in milliseconds. The caller never waits for a killed process to exit (the server reaps
its workers without blocking), so a call returns within its timeout plus milliseconds whatever
the function was doing, even inside a C-level operation no signal can interrupt, and however
many timeouts came before it.

Workers die with the server (``PR_SET_PDEATHSIG``) and exit when the caller's request pipe
closes; the server exits when the caller's control socket closes. Linux only (fork, SCM_RIGHTS
fd passing, prctl), like the rest of the stack.
"""
from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

_CHILD_START_TIMEOUT_S = 120.0
"""Longest wait for the fork server's start-up and warm-up (never counted against a call)."""
_CONTROL_TIMEOUT_S = 30.0
"""Longest wait for the fork server to answer a fork request (it takes milliseconds)."""
_REAP_WAIT_S = 1.0
"""How long the caller waits for a SIGKILLed fork server to exit before abandoning it."""
_PR_SET_PDEATHSIG = 1


class CallTimeout(Exception):
    """A call in the grading process ran past its timeout (the process was killed)."""


class CallFailed(Exception):
    """A call raised in the grading process, or the process died; the message says which."""


def _serve(read_fd: int, write_fd: int) -> None:
    """Worker main: answer ``(fn, args)`` requests until the caller closes the pipe."""
    requests, replies = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    while True:
        try:
            fn, args = requests.recv()
        except (EOFError, OSError):
            return
        try:
            replies.send(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, never raised here
            replies.send(("error", f"{type(exc).__name__}: {exc}"))


def _run_worker(control: socket.socket, fds: list[int], server_pid: int) -> None:
    """In a freshly forked worker: detach from the server's socket and serve; never returns."""
    try:
        control.close()
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        if os.getppid() == server_pid:   # else the server died before prctl took effect
            _serve(fds[0], fds[1])
    finally:
        os._exit(0)


def _fork_server_main(control_fd: int, warm_up_ref: str) -> None:
    """Fork-server main: warm up, then fork a worker per request until the caller goes away."""
    # math-verify logs a warning for every call made with its own timeout disabled.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    control = socket.socket(fileno=control_fd)
    try:
        if warm_up_ref:
            module, name = warm_up_ref.split(":")
            getattr(importlib.import_module(module), name)()
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        control.send(f"error:{type(exc).__name__}: {exc}".encode()[:4000])
        os._exit(1)
    control.send(b"ready")
    live: set[int] = set()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 256, 2)
        except OSError:
            msg, fds = b"", []
        _reap(live)
        if not msg:   # the caller closed the socket (or died): take the workers along
            for pid in live:
                _sigkill(pid)
            os._exit(0)   # skip interpreter teardown (~1 s with sympy loaded)
        if msg == b"fork" and len(fds) == 2:
            server_pid = os.getpid()
            try:
                pid = os.fork()
            except OSError as exc:
                control.send(f"error:fork failed: {exc}".encode())
                pid = -1
            if pid == 0:
                _run_worker(control, fds, server_pid)
            for fd in fds:
                os.close(fd)
            if pid > 0:
                live.add(pid)
                control.send(b"pid:%d" % pid)
        elif msg.startswith(b"kill:"):
            pid = int(msg[5:])
            if pid in live:   # only our own unreaped children: their pids cannot be reused yet
                _sigkill(pid)
        else:
            for fd in fds:
                os.close(fd)


def _reap(live: set[int]) -> None:
    """Collect exited workers without blocking (a killed one stuck in the kernel stays listed)."""
    for pid in list(live):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            live.discard(pid)


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_SERVER_CODE = (
    "import sys; from megatron_rl.reward.sandbox.isolated_call import _fork_server_main; "
    "_fork_server_main(int(sys.argv[1]), sys.argv[2])"
)


def _function_ref(fn: Callable[[], Any] | None) -> str:
    """'module:name' of a module-level function (how the fork server finds the warm-up)."""
    if fn is None:
        return ""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "." in name or "<" in name or getattr(sys.modules.get(module), name, None) is not fn:
        raise ValueError(f"warm_up={fn!r} must be a module-level function")
    return f"{module}:{name}"


class _ForkServer:
    """The caller's handle on the fork server process."""

    def __init__(self, warm_up_ref: str) -> None:
        self.sock, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER_CODE, str(child_end.fileno()), warm_up_ref],
                pass_fds=(child_end.fileno(),), env=env, stdin=subprocess.DEVNULL,
            )
        except OSError:
            self.sock.close()
            raise
        finally:
            child_end.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _reply(self, timeout_s: float, what: str) -> bytes:
        self.sock.settimeout(timeout_s)
        try:
            msg = self.sock.recv(4096)
        except TimeoutError as exc:
            raise CallFailed(f"reward fork server did not {what} within {timeout_s} s") from exc
        except OSError as exc:
            raise CallFailed(f"reward fork server died: {exc!r}") from exc
        if not msg:
            raise CallFailed(f"reward fork server exited (code {self.proc.poll()}) before it could {what}")
        if msg.startswith(b"error:"):
            raise CallFailed(f"reward fork server could not {what}: {msg[6:].decode(errors='replace')}")
        return msg

    def wait_ready(self) -> None:
        """Wait for the start-up and warm-up; raises :class:`CallFailed`."""
        self._reply(_CHILD_START_TIMEOUT_S, "start")

    def fork(self) -> _Worker:
        """A new warm worker (milliseconds); raises :class:`CallFailed`."""
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        try:
            socket.send_fds(self.sock, [b"fork"], [request_read, reply_write])
            msg = self._reply(_CONTROL_TIMEOUT_S, "fork a worker")
        except OSError as exc:
            os.close(request_write)
            os.close(reply_read)
            raise CallFailed(f"reward fork server died: {exc!r}") from exc
        except CallFailed:
            os.close(request_write)
            os.close(reply_read)
            raise
        finally:
            os.close(request_read)
            os.close(reply_write)
        return _Worker(int(msg.split(b":")[1]), Connection(request_write, readable=False),
                       Connection(reply_read, writable=False))

    def kill(self, pid: int) -> None:
        """Have the server SIGKILL one of its workers (fire and forget: never blocks)."""
        try:
            self.sock.send(b"kill:%d" % pid)
        except OSError:
            pass   # the server is gone, and its workers with it

    def stop(self) -> None:
        """Close the control socket (the server kills its workers and exits) and make sure."""
        self.sock.close()
        for _ in range(2):
            try:
                self.proc.wait(_REAP_WAIT_S)
                return
            except subprocess.TimeoutExpired:
                self.proc.kill()
        # SIGKILL sent but not gone (e.g. stuck in the kernel): subprocess reaps it later.
        logger.warning("reward fork server %d did not exit after SIGKILL; abandoning it", self.proc.pid)


class _Worker:
    """One forked grading process, as the caller sees it: its pid and pipes."""

    def __init__(self, pid: int, requests: Connection, replies: Connection) -> None:
        self.pid, self.requests, self.replies = pid, requests, replies

    def close(self) -> None:
        self.requests.close()
        self.replies.close()


class IsolatedCall:
    """Runs picklable functions in a grading process with a hard wall-clock timeout per call.

    The processes descend from a fresh interpreter (``subprocess``), not a fork of the caller:
    the caller may be a multi-threaded Ray worker, and unlike multiprocessing's 'spawn' it
    never re-imports the caller's ``__main__`` (so scripts without a ``__main__`` guard work).
    They get the caller's ``sys.path``, so any function the caller can import they can run. The
    fork server starts on the first call (or :meth:`ensure_started`) and its start-up and
    ``warm_up`` never count against a call's timeout; a call that overruns costs one worker,
    and the next call forks a warm one in milliseconds.
    """

    def __init__(self, warm_up: Callable[[], Any] | None = None) -> None:
        """``warm_up`` (a module-level function) runs once in the fork server, so every worker
        starts with what it imported and cached."""
        self._warm_up_ref = _function_ref(warm_up)
        self._server: _ForkServer | None = None
        self._worker: _Worker | None = None
        self.restarts = 0
        """Grading processes killed so far (each timeout costs one, as does a fork server that had to
        be killed)."""

    @property
    def server_pid(self) -> int | None:
        """Pid of the fork server (None before the first start)."""
        return None if self._server is None else self._server.proc.pid

    @property
    def worker_pid(self) -> int | None:
        """Pid of the worker the next call runs in (None when none is forked yet)."""
        return None if self._worker is None else self._worker.pid

    def ensure_started(self) -> None:
        """Make sure a warm worker is ready (starts the fork server if needed; waits for it);
        raises :class:`CallFailed` when that fails."""
        if self._server is not None and not self._server.alive():
            logger.warning("reward fork server %d exited (code %s); starting a new one",
                           self._server.proc.pid, self._server.proc.returncode)
            self._drop_server()
        if self._server is None:
            self._server = _ForkServer(self._warm_up_ref)
            try:
                self._server.wait_ready()
            except CallFailed:
                self._drop_server()
                raise
        if self._worker is None:
            try:
                self._worker = self._server.fork()
            except CallFailed:
                self._drop_server()
                raise

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        """``fn(*args)`` in a worker; raises :class:`CallTimeout` or :class:`CallFailed`."""
        self.ensure_started()
        worker = self._worker
        try:
            worker.requests.send((fn, args))
            if not worker.replies.poll(timeout_s):
                self._end_worker(kill=True)
                raise CallTimeout(f"exceeded {timeout_s} s")
            kind, value = worker.replies.recv()
        except (EOFError, OSError) as exc:
            self._end_worker(kill=False)
            raise CallFailed(f"reward grading process died: {exc!r}") from exc
        if kind == "error":
            raise CallFailed(value)
        return value

    def _end_worker(self, kill: bool) -> None:
        worker, self._worker = self._worker, None
        worker.close()
        if kill and self._server is not None:
            self._server.kill(worker.pid)
            self.restarts += 1

    def _drop_server(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._server is not None:
            if self._server.alive():
                self.restarts += 1
            self._server.stop()
            self._server = None

    def close(self) -> None:
        """Stop the grading processes (a later call starts new ones)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __del__(self) -> None:
        # Best effort: never leave a grading process behind when a worker is dropped (its
        # workers die with the server).
        server = getattr(self, "_server", None)
        if server is not None and server.alive():
            try:
                server.proc.kill()
            except OSError:
                pass
