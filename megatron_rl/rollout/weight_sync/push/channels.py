"""The wires of the tensor weight push on CPU: a shared-memory ring per trainer rank for engines on
its node, and a gloo group for engines on other nodes.

**ShmRing.** A trainer rank owns one file in ``/dev/shm/<run dir>/weight_push/`` (the per-process
run directory of ``distributed.local_state``: host, uid and the trainer's pid in its name, so a
crashed run's rings are removed by the start-up sweep of dead runs' directories), mapped
``MAP_SHARED`` by that rank and by every vLLM worker on the node. It holds ``num_slots`` bucket
slots and a header of int64 counters: per slot the *ticket* of the bucket in it (written by the
trainer after the payload) and, per engine replica, the ticket that replica has finished reading
(written by its worker). A trainer reuses a slot only once every replica released its previous
bucket; a worker reads a slot only once it holds the ticket it waits for. Tickets are
``sync_id << 32 | position + 1``, so a stale bucket from an earlier push is never mistaken for the
current one. Every wait has a timeout and checks that the other side's process is alive, so a
dead or stalled peer is an error naming it rather than a hang.

Ordering: the payload is written, then a full memory barrier, then the ticket (and the reader
reads the ticket, barrier, payload). An uncontended ``threading.Lock`` round trip is an atomic
read-modify-write, which is a full barrier on x86 and ARM; large copies may use non-temporal
stores, which only a barrier orders.

**NetworkGroup.** A gloo process group built from a TCP store (not ``torch.distributed``'s
default group: trainer ranks already have Megatron's, vLLM workers their TP group): trainer
ranks are ranks ``0..T-1``, the workers of engines that cannot map a trainer's ring come after.
Buckets travel point to point, in the same global order on both sides.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from megatron_rl.distributed.local_state import pid_alive

MAGIC = 0x31687375706C726D  # b"mrlpush1" little-endian
_FIELDS = 8  # magic, layout version, slots, slot bytes, replicas, tp, owner pid, data offset
_PAGE = 4096
_LOCK = threading.Lock()
_LIVENESS_EVERY_S = 0.2


def memory_barrier() -> None:
    """A full memory barrier (see the module docstring)."""
    _LOCK.acquire()
    _LOCK.release()


def ticket(sync_id: int, position: int) -> int:
    """The ticket of the ``position``-th bucket a trainer rank sends in push ``sync_id``."""
    return (sync_id << 32) | (position + 1)


def wait_until(ready: Callable[[], bool], timeout_s: float, what: Callable[[], str],
               alive: Callable[[], bool] | None = None) -> float:
    """Poll ``ready`` (sleeping 20 us doubling to 1 ms) until it holds; returns seconds waited.
    Raises TimeoutError after ``timeout_s`` and RuntimeError as soon as ``alive`` says the peer is
    gone, both with ``what()`` in the message."""
    start = time.monotonic()
    if ready():
        return 0.0
    delay, checked = 2e-5, start
    while True:
        time.sleep(delay)
        if ready():
            return time.monotonic() - start
        now = time.monotonic()
        if alive is not None and now - checked > _LIVENESS_EVERY_S:
            checked = now
            if not alive():
                raise RuntimeError(f"{what()}: the peer process is gone")
        if now - start > timeout_s:
            raise TimeoutError(f"{what()}: nothing after {timeout_s:.0f} s")
        delay = min(delay * 2, 1e-3)


class ShmRing:
    """A ring of bucket slots in a shared file (see the module docstring). Create it on the
    trainer rank (:meth:`create`), map it in the engine workers (:meth:`attach`)."""

    def __init__(self, path: Path, mm: mmap.mmap, owner: bool) -> None:
        self.path, self._mm, self.owner = path, mm, owner
        head = np.frombuffer(mm, dtype=np.int64, count=_FIELDS)
        if int(head[0]) != MAGIC:
            raise ValueError(f"{path}: not a weight-push ring (magic {int(head[0]):#x})")
        self.num_slots, self.slot_bytes, self.num_replicas, self.tp = (int(x) for x in head[2:6])
        self.owner_pid, data_offset = int(head[6]), int(head[7])
        counters = self.num_slots + self.num_slots * self.num_replicas + self.num_replicas * self.tp
        self._counters = np.frombuffer(mm, dtype=np.int64, count=counters, offset=_FIELDS * 8)
        s, r = self.num_slots, self.num_replicas
        self.tickets = self._counters[:s]
        self.done = self._counters[s:s + s * r].reshape(s, r)
        self.consumer_pids = self._counters[s + s * r:].reshape(r, self.tp)
        self._data = torch.frombuffer(mm, dtype=torch.uint8, offset=data_offset,
                                      count=self.num_slots * self.slot_bytes) if self.slot_bytes else None

    @staticmethod
    def _header_bytes(num_slots: int, num_replicas: int, tp: int) -> int:
        words = _FIELDS + num_slots + num_slots * num_replicas + num_replicas * tp
        return -(-words * 8 // _PAGE) * _PAGE

    @classmethod
    def create(cls, path: str | Path, num_slots: int, slot_bytes: int, num_replicas: int, tp: int) -> "ShmRing":
        """A new ring file (replacing one of the same name). ``slot_bytes`` 0 makes a header-only
        ring (the CUDA IPC channel keeps its slots on the GPU)."""
        if num_slots < 1 or num_replicas < 1 or slot_bytes < 0:
            raise ValueError(f"ShmRing: need >= 1 slot and replica, got {num_slots} slots, {num_replicas} replicas")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = cls._header_bytes(num_slots, num_replicas, tp)
        slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        size = header + num_slots * slot_bytes
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        head = np.frombuffer(mm, dtype=np.int64, count=_FIELDS)
        head[:] = [MAGIC, 1, num_slots, slot_bytes, num_replicas, tp, os.getpid(), header]
        os.replace(tmp, path)  # readers never map a half-written header
        ring = cls(path, mm, owner=True)
        if ring._data is not None:
            ring._data.fill_(0)  # commit the pages now, not during the first push
        return ring

    @classmethod
    def attach(cls, path: str | Path) -> "ShmRing":
        """Map an existing ring (engine worker side)."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, mm, owner=False)

    def slot(self, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of slot ``index`` as a flat ``dtype`` tensor (a view)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize > self.slot_bytes:
            raise ValueError(f"{self.path}: {numel * itemsize} bytes do not fit a {self.slot_bytes}-byte slot")
        start = index * self.slot_bytes
        return self._data[start:start + numel * itemsize].view(dtype)

    # ------------------------------------------------------------------ trainer side
    def wait_free(self, index: int, previous: int, timeout_s: float, what: Callable[[], str],
                  consumers: list[int] | None = None) -> float:
        """Wait until every replica (or each of ``consumers``: those handed that bucket) released
        ticket ``previous`` of slot ``index`` (0: never used)."""
        def released() -> bool:
            done = self.done[index] if consumers is None else self.done[index][consumers]
            return bool((done >= previous).all())

        def consumers_alive() -> bool:
            return all(pid_alive(int(p)) for p in self.consumer_pids.flat if p > 0)

        waited = wait_until(released, timeout_s, what, consumers_alive)
        memory_barrier()
        return waited

    def publish(self, index: int, ticket_: int) -> None:
        """The payload of slot ``index`` is complete: hand it out under ``ticket_``."""
        memory_barrier()
        self.tickets[index] = ticket_

    # ------------------------------------------------------------------ engine side
    def register_consumer(self, replica: int, rank: int) -> None:
        """Record this worker's pid (the trainer checks it is alive while it waits)."""
        self.consumer_pids[replica, rank] = os.getpid()

    def wait_ready(self, index: int, ticket_: int, timeout_s: float, what: Callable[[], str]) -> float:
        """Wait until slot ``index`` holds ticket ``ticket_``."""
        waited = wait_until(lambda: int(self.tickets[index]) >= ticket_, timeout_s, what,
                            lambda: pid_alive(self.owner_pid))
        if int(self.tickets[index]) != ticket_:
            raise RuntimeError(f"{what()}: slot {index} holds ticket {int(self.tickets[index]):#x}, expected "
                               f"{ticket_:#x} (trainer and engine disagree on the push plan)")
        memory_barrier()
        return waited

    def release(self, index: int, replica: int, ticket_: int) -> None:
        """This replica has copied slot ``index`` out."""
        memory_barrier()
        self.done[index, replica] = ticket_

    def close(self) -> None:
        """Unmap; the owner also removes the file. Views handed out must be gone."""
        # numpy/torch views pin the mapping; drop ours first.
        self.tickets = self.done = self.consumer_pids = self._counters = self._data = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes with the process
        if self.owner:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            parents = (self.path.parent, self.path.parent.parent) if self.path.parent.name == "weight_push" else ()
            for parent in parents:  # weight_push/ and the per-process run dir (protocol.ring_path)
                try:
                    parent.rmdir()
                except OSError:
                    break  # not empty (another ring, the weight-sync directory) or gone


class NetworkGroup:
    """A gloo group of trainer ranks and engine workers, outside ``torch.distributed``'s default
    group (see the module docstring). Every member constructs it at the same time (rank 0 hosts
    the TCP store)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self._store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                    wait_for_workers=True)
        self._group = dist.ProcessGroupGloo(dist.PrefixStore("megatron_rl.weight_push", self._store), rank,
                                            world_size, timeout)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._group.send([tensor], dst, 0).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._group.recv([tensor], src, 0).wait()

    def close(self) -> None:
        shutdown = getattr(self._group, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self._group = None
        self._store = None
