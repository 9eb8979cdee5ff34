"""CPU mode's part processes, forked from one process that has imported torch, megatron-core and
transformers (multiprocessing's forkserver with those modules preloaded) instead of a fresh
``python -m tests.gpu.check.run_part`` per part that imports them again: ~8 CPU s per part on the
2-core box, ~100 CPU s over the CPU mode's parts in the test suite.

Each part stays a process of its own, in its own session with its own log, killed as a group at
its budget, as the fresh processes are. GPU mode keeps fresh processes: that is how the check ran
on the H200 (docs/gpu_check.md), and there the imports are seconds against minutes of parts.

The forkserver is the check's runner's own (``python -m tests.gpu.check``): it inherits the
runner's environment when it starts, so the runner puts the parts' environment (thread counts,
``CUDA_VISIBLE_DEVICES``, ``TMPDIR``) into its own first. It imports nothing of Ray or vLLM (a part
must not, ``run_part``), and no import in the list starts a thread or touches a device, so
forking after them is safe.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import tempfile
from pathlib import Path

PRELOAD = ["torch", "transformers", "transformers.models.qwen2.modeling_qwen2", "megatron.core",
           "megatron.core.models.gpt", "megatron_rl.training.megatron_worker", "tests.gpu.check.common",
           "tests.gpu.check.megatron_parts", "tests.gpu.check.memory_parts", "tests.gpu.check.ipc_part",
           "tests.gpu.check.perf_parts"]
"""What the forkserver imports once (an import that fails there is only left to the part)."""


class ForkedPart:
    """The calls the runner makes on a ``subprocess.Popen`` (pid, poll, returncode, wait), on a
    part forked from the forkserver."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return None if self._process.is_alive() else self._process.exitcode

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def wait(self) -> int | None:
        self._process.join()
        return self._process.exitcode


class PartForker:
    """Starts parts as forks of one preloaded process."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)  # see the module docstring: the forkserver started next inherits it
        _socket_dir_within_the_path_limit()
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)

    def start(self, argv: list[str], log: Path, cwd: Path) -> ForkedPart:
        """Fork a process that runs ``run_part.main(argv)`` with stdout and stderr in ``log``."""
        process = self._context.Process(target=_part_main, args=(argv, str(log), str(cwd)), name=f"part-{argv[0]}")
        process.start()
        return ForkedPart(process)


UNIX_SOCKET_PATH_MAX = 107
"""The longest path a Unix socket may be bound at on Linux (sun_path holds 108 bytes with the NUL)."""


def _socket_dir_within_the_path_limit() -> None:
    """multiprocessing binds the forkserver's socket at ``<TMPDIR>/pymp-XXXXXXXX/listener-XXXXXXXX``;
    under a deep TMPDIR (a pytest test's own directory) that passes the limit and the server cannot
    start ("AF_UNIX path too long"). Then multiprocessing's directory for this process is made in
    /tmp instead (it removes the directory when the process exits)."""
    if len(os.path.join(tempfile.gettempdir(), "pymp-XXXXXXXX", "listener-XXXXXXXX")) <= UNIX_SOCKET_PATH_MAX:
        return
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        multiprocessing.util.get_temp_dir()  # made now, and kept for this process's sockets
    finally:
        tempfile.tempdir = saved


def kill_session(pid: int) -> None:
    """SIGKILL the part's session; a part forked a moment ago may not lead one yet, then the part."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    except PermissionError:
        pass


def _part_main(argv: list[str], log: str, cwd: str) -> None:
    os.setsid()  # its own session, as a fresh process gets with start_new_session
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from tests.gpu.check import run_part

    code = run_part.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
