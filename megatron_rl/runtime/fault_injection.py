"""Named fault points: places where a part of the run can be made to die, stall or fail on cue.

A fault point is a call such as ``fault_point("train.backward", step=self.steps_done, rank=rank)``
at a place where a real fault would hurt most (mid-backward, mid-save, mid-push, mid-commit).
An out-of-process observer cannot hit a 10 ms backward; the point can, at an exact step and
rank. Points are inert unless the environment arms them: with ``MEGATRON_RL_FAULTS`` unset
(every ordinary run) a call is one lookup in an empty dict.

``MEGATRON_RL_FAULTS``: faults separated by ``;``, each a comma-separated ``key=value`` list::

    point=train.backward,step=2,rank=1,action=kill; point=checkpoint.commit,step=3,action=kill

``point`` (one of :data:`POINTS`) and ``action`` are required; ``step`` and ``rank`` are filters
(the point's own step / rank must equal them; omitted: any). ``MEGATRON_RL_FAULTS_DIR`` must name
a directory all of the run's processes can write: each fault fires at most once across all of
them (the first process to create ``<dir>/fault<i>-<point>.json`` fires it; a replacement engine
or a retried call does not fire it again), and that file records when and where it fired.

Actions act on the part the point stands for: the calling process, or the processes the call
site names with ``part`` (the engine actor's point names its engine's processes):

* ``kill``: SIGKILL (dies mid-work, as an out-of-memory kill or a crashed machine does);
* ``stop``: SIGSTOP (stalls: alive, holding what it holds, answering nothing);
* ``raise``: :class:`FaultInjected` raised at the point (in the calling process).

Both variables reach every process of a run: children inherit them, and ``start_ray`` passes
them to the Ray workers of an existing cluster (``cluster.ray_address``).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger(__name__)

FAULTS_ENV = "MEGATRON_RL_FAULTS"
FAULTS_DIR_ENV = "MEGATRON_RL_FAULTS_DIR"
ACTIONS = ("kill", "stop", "raise")

POINTS = {
    "train.backward": "trainer rank, train step: the backward pass has reached the model's output (step: the "
                      "optimizer steps taken before this one, i.e. the loop step; rank: global rank)",
    "checkpoint.save": "trainer rank, save_checkpoint: every rank entered the save and the directory exists, this "
                       "rank has not written its shards (step: the checkpoint's number; rank: global rank)",
    "weight_push.send": "trainer rank, tensor push: before this rank's first bucket (step: the policy version "
                        "pushed; rank: global rank)",
    "weight_push.receive": "engine worker, tensor push: after the first bucket arrived (step: the policy version "
                           "pushed; rank: the engine's TP rank)",
    "engine.submit": "engine actor, after its engine accepted a request; the part is the engine's processes "
                     "(engine core and workers), not the actor (step: the engine's weight version)",
    "engine.sleep": "engine actor, after its engine went to sleep (a pool member lent to the stream trainer, or the "
                    "whole pool through training); the part is the engine's processes (step: the engine's weight "
                    "version)",
    "checkpoint.commit": "driver, CheckpointManager.commit: manifest written and synced, the directory not yet "
                         "renamed into place (step: the checkpoint's number)",
}
"""Every fault point and where it sits; a spec naming another point is refused."""


class FaultSpecError(ValueError):
    """``MEGATRON_RL_FAULTS`` / ``MEGATRON_RL_FAULTS_DIR`` do not describe faults; names the entry."""


class FaultInjected(RuntimeError):
    """Raised by a fault point armed with ``action=raise``."""


@dataclass(frozen=True)
class Fault:
    """One armed fault."""

    index: int
    """Position in the spec (names its record file)."""
    point: str
    action: str
    step: int | None = None
    rank: int | None = None

    def matches(self, step: int | None, rank: int | None) -> bool:
        return (self.step is None or self.step == step) and (self.rank is None or self.rank == rank)

    def describe(self) -> str:
        where = "".join(f", {k}={v}" for k, v in (("step", self.step), ("rank", self.rank)) if v is not None)
        return f"{self.action} at {self.point}{where}"


def parse(text: str) -> list[Fault]:
    """The faults of a ``MEGATRON_RL_FAULTS`` value (see the module docstring)."""
    faults = []
    for index, entry in enumerate(e.strip() for e in text.split(";")):
        if not entry:
            continue
        fields: dict[str, str] = {}
        for item in entry.split(","):
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in ("point", "action", "step", "rank"):
                raise FaultSpecError(f"{FAULTS_ENV} entry {entry!r}: {item!r} is not one of point=, action=, step=, "
                                     "rank=")
            fields[key.strip()] = value.strip()
        point, action = fields.get("point", ""), fields.get("action", "")
        if point not in POINTS:
            raise FaultSpecError(f"{FAULTS_ENV} entry {entry!r}: unknown point {point!r} (known: {sorted(POINTS)})")
        if action not in ACTIONS:
            raise FaultSpecError(f"{FAULTS_ENV} entry {entry!r}: action must be one of {ACTIONS}, got {action!r}")
        try:
            numbers = {k: int(fields[k]) for k in ("step", "rank") if k in fields}
        except ValueError as exc:
            raise FaultSpecError(f"{FAULTS_ENV} entry {entry!r}: step and rank are integers ({exc})") from None
        faults.append(Fault(index, point, action, **numbers))
    return faults


def _from_env() -> tuple[dict[str, list[Fault]], Path | None]:
    text = os.environ.get(FAULTS_ENV, "")
    if not text.strip():
        return {}, None
    directory = os.environ.get(FAULTS_DIR_ENV, "")
    if not directory:
        raise FaultSpecError(f"{FAULTS_ENV} is set but {FAULTS_DIR_ENV} is not: each fault fires once per run, "
                             "recorded in that directory")
    armed: dict[str, list[Fault]] = {}
    for fault in parse(text):
        armed.setdefault(fault.point, []).append(fault)
    return armed, Path(directory)


_ARMED, _RECORDS = _from_env()


def reload() -> None:
    """Read the environment again (tests that arm faults in this process)."""
    global _ARMED, _RECORDS
    _ARMED, _RECORDS = _from_env()


def fault_point(point: str, *, step: int | None = None, rank: int | None = None,
                part: Callable[[], Iterable[int]] | None = None) -> None:
    """Fire the faults armed at ``point`` for this ``step`` and ``rank`` (none: returns at once).
    ``part``: the processes the point stands for, when not the calling one."""
    faults = _ARMED.get(point)
    if not faults:
        return
    for fault in faults:
        if fault.matches(step, rank) and _claim(fault, step, rank):
            _fire(fault, part)


def fault_point_in_backward(tensor, point: str, *, step: int | None = None, rank: int | None = None) -> None:
    """Fire ``point`` when the backward pass reaches ``tensor`` (a gradient hook on it): the
    backward is under way, the layers below still to go. Inert when nothing is armed there."""
    faults = _ARMED.get(point)
    if not faults or not any(f.matches(step, rank) for f in faults) or not tensor.requires_grad:
        return

    def hook(grad):
        fault_point(point, step=step, rank=rank)
        return grad

    tensor.register_hook(hook)


def _claim(fault: Fault, step: int | None, rank: int | None) -> bool:
    """Create the fault's record file; False when another process (or an earlier call) did."""
    path = _RECORDS / f"fault{fault.index}-{fault.point}.json"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    record = {"point": fault.point, "action": fault.action, "step": step, "rank": rank, "pid": os.getpid(),
              "host": socket.gethostname(), "time": time.time(), "monotonic": time.monotonic()}
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return True


def _fire(fault: Fault, part: Callable[[], Iterable[int]] | None) -> None:
    if fault.action == "raise":
        raise FaultInjected(f"fault injected: {fault.describe()} (pid {os.getpid()})")
    sig = signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP
    pids = [os.getpid()] if part is None else list(part())
    log.warning("fault injected: %s -> %s to pid(s) %s", fault.describe(), sig.name, pids)
    for handler in logging.getLogger().handlers:  # the line must reach the log before the process stops
        handler.flush()
    me = os.getpid()
    for pid in sorted(pids, key=lambda p: p == me):  # this process last
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
