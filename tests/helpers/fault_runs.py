"""Whole-loop attempts with armed fault points, for tests/integration/test_faults.py.

An :class:`Attempt` is one ``python -m megatron_rl.train`` subprocess (``train_runs.run_train``)
with faults armed through the environment (``megatron_rl.runtime.fault_injection``). While the test waits
on it, it keeps a list of every process the run had (pid and name, polled once a second) and of
the ``psm_*`` segments its engine processes mapped, so that after the run ended the test can ask
what is left behind. The run's log lines carry wall-clock times, and every fault that fired
recorded its own, so detection and stop times are read off both.

:func:`two_node_cluster` is a Ray cluster of two nodes on this machine (``ray.cluster_utils``),
and :func:`kill_node` loses one of them as a crashed machine would (every process of it SIGKILLed).
:class:`Chain` is one run directory that attempts resume one after the other.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest

from megatron_rl.distributed.local_state import HOST_TAG_ENV, mapped_segments
from megatron_rl.distributed.ray_start import START_TRIES
from megatron_rl.runtime.fault_injection import FAULTS_DIR_ENV, FAULTS_ENV
from tests.helpers.processes import describe, left_behind, run_processes
from tests.helpers.ray_dirs import start_cluster
from tests.helpers.train_runs import overrides, read_jsonl, run_train

RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
"""Every Ray node's own agent processes (started by its raylet)."""
# Not anchored: a line Ray forwarded from a process killed mid-write has no newline, and the
# driver's next log line continues it.
_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_ENGINE_PROCESS = ("EngineCore", "VllmWorker", "VLLM")


class Attempt:
    """One run of the chain (see the module docstring).

    Args:
        name: names the log file (``<tmp>/<name>.log``).
        args: the run's command-line overrides.
        records: the fault records' directory (``MEGATRON_RL_FAULTS_DIR``).
        faults: the ``MEGATRON_RL_FAULTS`` spec ('' arms nothing).
        processes: what counts as the run's processes (default: the driver's session and descendants;
            a run on an existing Ray cluster passes :func:`cluster_job_processes`).
        host_tag: the run's ``MEGATRON_RL_HOST_TAG`` (``train_runs.run_train``).
        tmpdir: the run's ``TMPDIR`` (default: the test's), for a test that checks what the run left there.
    """

    def __init__(self, name: str, args: list[str], tmp_path: Path, records: Path, faults: str = "",
                 processes: Callable[[], dict[int, str]] | None = None, host_tag: str | None = None,
                 tmpdir: Path | None = None) -> None:
        self.name, self.log = name, tmp_path / f"{name}.log"
        with pytest.MonkeyPatch.context() as env:  # run_train copies os.environ at Popen time
            env.setenv(FAULTS_ENV, faults)
            env.setenv(FAULTS_DIR_ENV, str(records))
            if tmpdir is not None:
                env.setenv("TMPDIR", str(tmpdir))
            self.started_at = time.time()
            self.proc = run_train(args, self.log, host_tag=host_tag)
        self.records = records
        self._processes = processes or (lambda: run_processes(self.proc.pid))
        self.seen: dict[int, str] = {}
        self.segments: set[str] = set()
        self._polled = 0.0

    # ------------------------------------------------------------------ watching
    def poll(self) -> None:
        """Add the run's live processes (and its engines' psm segments) to what it had."""
        now = time.monotonic()
        if now - self._polled < 1.0:
            return
        self._polled = now
        live = self._processes()
        self.seen.update(live)
        self.segments |= mapped_segments([p for p, name in live.items() if any(k in name for k in _ENGINE_PROCESS)])

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout_s: float = 600.0) -> float:
        """Poll until ``predicate()``; fails when the run ends first. Returns the wall time then."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.proc.poll() is None, f"{self.name}: the run ended before {what}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name}: no {what} within {timeout_s:.0f} s:\n{self.tail()}"
            self.poll()
            time.sleep(0.1)
        return time.time()

    def wait_exit(self, timeout_s: float) -> tuple[int, float]:
        """(exit code, wall time it exited); fails (killing the run) when it runs past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{self.name}: still running {timeout_s:.0f} s later (a hang):\n{self.tail()}")
            self.poll()
            time.sleep(0.1)
        return self.proc.returncode, time.time()

    def kill(self) -> None:
        """SIGKILL whatever is left of the run (the test's own clean-up after a failure): the
        driver while it runs, and the live processes of the run (never a pid seen earlier, which
        may belong to someone else by now)."""
        pids = list(self._processes())
        if self.proc.poll() is None:
            pids.insert(0, self.proc.pid)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)

    def left_behind(self, wait_s: float = 30.0, ignore: tuple[str, ...] = ()) -> tuple[dict[int, str], list[str]]:
        """The run's processes still alive and its psm segments still in /dev/shm after up to
        ``wait_s`` (no longer once only processes named ``ignore...`` are left: they are
        reported, not waited for)."""
        deadline = time.monotonic() + wait_s
        while True:
            alive, left = left_behind(list(self.seen), sorted(self.segments), wait_s=0)
            waited_for = [p for p in alive if not self.seen[p].startswith(ignore or ("\0",))]
            if (not waited_for and not left) or time.monotonic() > deadline:
                return {p: self.seen[p] for p in alive}, left
            time.sleep(0.2)

    def temp_files_left(self, tmpdir: Path) -> list[str]:
        """What the run's engines left in its ``tmpdir`` (the ``tmpdir`` it was started with): vLLM's
        rendezvous files (``vllm_dist_*``, a torch file store each) and engines' scratch dirs (``e*`` under
        the runtime root, ``vllm_engine_args.default_runtime_root``). The runtime root's shared caches
        (compile cache, logging configuration) are kept on purpose and not listed."""
        left = [p for p in tmpdir.rglob("vllm_dist_*")]
        left += [p for root in tmpdir.glob("megatron_rl-vllm-*") for p in root.glob("e*") if p.is_dir()]
        return sorted(str(p.relative_to(tmpdir)) for p in left)

    def shm_dirs_left(self) -> list[str]:
        """/dev/shm directories named after one of the run's processes (weights, push rings)."""
        pids = {str(p) for p in [self.proc.pid, *self.seen]}
        return sorted(p.name for p in Path("/dev/shm").glob("megatron_rl-*") if p.name.rsplit("-", 1)[-1] in pids)

    # ------------------------------------------------------------------ reading what happened
    def text(self) -> str:
        return self.log.read_text() if self.log.is_file() else ""

    def tail(self, chars: int = 4000) -> str:
        return self.text()[-chars:]

    def log_times(self, pattern: str) -> list[float]:
        """Wall times of the driver's log records matching ``pattern`` (a regex), in order. A record
        may span lines (an error whose message has newlines): a match takes the last time stamp
        before it, on its line or an earlier one."""
        times, last = [], None
        for line in self.text().splitlines():
            found = re.search(pattern, line)
            stamps = list(_LOG_TIME.finditer(line, 0, found.start() if found else len(line)))
            if stamps:
                last = stamps[-1].group(1)
            if found and last:
                times.append(datetime.datetime.strptime(last, "%Y-%m-%d %H:%M:%S,%f").timestamp())
            if not found:
                continue
            rest = list(_LOG_TIME.finditer(line, found.start()))  # later records on the same line
            last = rest[-1].group(1) if rest else last
        return times

    def fault(self, point: str) -> dict:
        """The record of the fault armed at ``point`` (it must have fired)."""
        found = [json.loads(p.read_text()) for p in self.records.glob(f"fault*-{point}.json")]
        assert found, f"{self.name}: the fault at {point} never fired:\n{self.tail()}"
        return found[-1]

    def engine_replacements(self, *points: str) -> list[tuple[float, float, int]]:
        """The attempt's rollout engine died and was replaced once per fault point of ``points``
        (each must have fired), in that order, and no other time. Returns, for each point, (time from
        the fault to the loop noticing, time from the fault to the replacement, requests resubmitted)."""
        died, replaced = self.log_times("rollout engine died"), self.log_times("rollout engine replaced")
        assert len(died) == len(replaced) == len(points), self.tail()
        resubmitted = [int(n) for n in re.findall(r"(\d+) request\(s\) resubmitted", self.text())]
        assert len(resubmitted) == len(points), resubmitted
        faults = [self.fault(point)["time"] for point in points]
        return [(d - t, r - t, n) for t, d, r, n in zip(faults, died, replaced, resubmitted)]

    def engine_replaced_once(self, point: str, step: int) -> tuple[float, float, int]:
        """The attempt's engine core was SIGKILLed once, by the fault at ``point`` at weight version
        ``step``, and replaced once, with the requests in flight (at least one) resubmitted. Returns
        (time to notice, time to replace, requests resubmitted), as :meth:`engine_replacements`."""
        fault = self.fault(point)
        assert fault["step"] == step, fault
        [(died_s, replaced_s, resubmitted)] = self.engine_replacements(point)
        assert resubmitted >= 1, resubmitted
        return died_s, replaced_s, resubmitted


class Chain:
    """One run directory shared by chained attempts (each resumes from the last checkpoint of the
    one before), and which attempts passed: an attempt fails at once when its predecessor did not.

    Args:
        steps: ``trainer.steps`` of every attempt.
        extra: overrides of every attempt (after ``train_runs.overrides``' small run).
    """

    def __init__(self, model_dir: Path, tmp: Path, steps: int, extra: list[str]) -> None:
        self.model_dir, self.tmp, self.steps, self.extra = model_dir, tmp, steps, extra
        self.run_dir = tmp / "run"
        self.passed: list[str] = []
        self.lingering: dict[int, str] = {}
        """Processes an attempt left that should be gone by a later check (pid -> name)."""
        self.host_tag = f"chain-{os.getpid()}"
        """Every attempt's ``MEGATRON_RL_HOST_TAG``: an attempt killed without its teardown leaves
        /dev/shm dirs that the next attempt's start-up must sweep (and checks it did), which
        another test's job, under the machine's own host name, then cannot sweep first."""

    def attempt(self, name: str, after: str | None, faults: str = "", extra: tuple[str, ...] = (),
                **kwargs) -> Attempt:
        """Start attempt ``name`` (fresh when ``after`` is None, else resuming after attempt ``after``)."""
        if after is not None and after not in self.passed:
            pytest.fail(f"needs the chain's attempt '{after}', which did not pass")
        records = self.tmp / f"faults-{name}"
        records.mkdir()
        resume = ["trainer.resume=true"] if after is not None else []
        args = overrides(self.model_dir, self.run_dir, self.steps, [*self.extra, *resume, *extra])
        return Attempt(name, args, self.tmp, records, faults, host_tag=self.host_tag, **kwargs)

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return read_jsonl(path) if path.is_file() else []

    def checkpoint_written(self, step: int) -> Callable[[], bool]:
        return lambda: (self.run_dir / "checkpoints" / f"step_{step:06d}").is_dir()

    def assert_last_checkpoint(self, step: int) -> None:
        """The newest complete checkpoint is ``step_<step>`` and every file of it is intact."""
        from megatron_rl.checkpoint.store import latest, load_driver_state

        path = latest(self.run_dir)
        assert path is not None and path.name == f"step_{step:06d}", f"last checkpoint {path}, expected step {step}"
        assert load_driver_state(path)["next_step"] == step  # verifies the manifest's sizes and hashes


# ---------------------------------------------------------------------- a two-node Ray cluster
@contextlib.contextmanager
def two_node_cluster(head_cpus: int, worker_cpus: int, host_tag: str | None = None) -> Iterator[tuple]:
    """(cluster, worker node) of a ``ray.cluster_utils.Cluster`` on this machine; the head notices
    a lost node within about 3 s (health checks every 0.5 s, dead after 4 misses). ``host_tag``: the
    ``MEGATRON_RL_HOST_TAG`` of its nodes' processes (a job's ranks and engines run there)."""
    from ray.cluster_utils import Cluster

    from tests.helpers.ray_dirs import short_ray_dir

    with short_ray_dir("c", room=4) as root, pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", str(root))  # Cluster writes <RAY_TMPDIR>/ray/ray_current_cluster
        if host_tag is not None:
            env.setenv(HOST_TAG_ENV, host_tag)  # the raylets pass it on to their workers
        (root / "ray").mkdir()
        head_args = {"num_cpus": head_cpus, "object_store_memory": 96 << 20, "temp_dir": str(root / "ray"),
                     "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                                        "health_check_timeout_ms": 500}}
        cluster = start_cluster(Cluster, head_args, [{"num_cpus": worker_cpus, "object_store_memory": 96 << 20}],
                                START_TRIES)
        try:
            (worker,) = cluster.worker_nodes
            cluster.wait_for_nodes(timeout=NODES_TIMEOUT_S)
            yield cluster, worker
        finally:
            cluster.shutdown()


NODES_TIMEOUT_S = 300.0
"""How long :func:`two_node_cluster` waits for both nodes to be listed alive (a hang, not a slow box:
``Cluster.wait_for_nodes``' own default, 30 s, is a deadline a loaded 2-core box can miss)."""


def _raylet_pid(node) -> int:
    from ray._private import ray_constants

    return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def cluster_job_processes(cluster) -> dict[int, str]:
    """The processes a job runs on the cluster's nodes: its actors' workers (every ``ray::`` worker
    but the idle ones) and their descendants (e.g. vLLM's engine core)."""
    found: dict[int, str] = {}
    for node in [cluster.head_node, *cluster.worker_nodes]:
        try:
            workers = psutil.Process(_raylet_pid(node)).children()
        except psutil.Error:
            continue
        for worker in workers:
            name = describe(worker.pid)
            if not name.startswith("ray::") or name.startswith(("ray::IDLE", *RAY_AGENTS)):
                continue  # not a worker of a job: an idle one, or the node's own agents
            found[worker.pid] = name
            with contextlib.suppress(psutil.Error):
                found.update({c.pid: describe(c.pid) for c in worker.children(recursive=True)})
    return found


def kill_node(cluster, node) -> float:
    """Lose ``node`` as a crashed machine is lost: its raylet and every process under it SIGKILLed
    at once. Returns the wall time of the kill."""
    raylet = psutil.Process(_raylet_pid(node))
    tree = [raylet, *raylet.children(recursive=True)]
    killed_at = time.time()
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    cluster.remove_node(node, allow_graceful=False)  # the rest of it (log monitor); the head is not told
    return killed_at
