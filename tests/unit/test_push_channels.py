"""The CPU wires of the tensor weight push between real processes: a shared-memory ring (tickets,
bounded slots, release, timeouts and dead-peer detection naming who was waited for, removal of a
killed owner's ring by the start-up sweep of dead runs) and the gloo push group."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from megatron_rl.distributed.local_state import dead_run_dirs, run_dir_name, sweep_dead_run_dirs
from megatron_rl.rollout.weight_sync.push.channels import NetworkGroup, ShmRing, ticket
from megatron_rl.rollout.weight_sync.push.protocol import ring_path, shm_root

CTX = mp.get_context("spawn")


def _consumer(path: str, buckets: int, sync_id: int, out) -> None:
    ring = ShmRing.attach(path)
    ring.register_consumer(0, 0)
    sums = []
    for j in range(buckets):
        slot = j % ring.num_slots
        ring.wait_ready(slot, ticket(sync_id, j), 30.0, lambda j=j: f"consumer at bucket {j}")
        data = ring.slot(slot, torch.float32, 1000)
        sums.append(float(data.sum()))
        time.sleep(0.002)  # slower than the producer: the ring fills up and must wait
        ring.release(slot, 0, ticket(sync_id, j))
    out.put(sums)


def test_buckets_cross_processes_through_two_slots_in_order(tmp_path):
    ring = ShmRing.create(tmp_path / "r.ring", num_slots=2, slot_bytes=4000, num_replicas=1, tp=1)
    out = CTX.Queue()
    for sync_id in (1, 2):  # a second push reuses the slots with new tickets
        proc = CTX.Process(target=_consumer, args=(str(ring.path), 12, sync_id, out))
        proc.start()
        last, waited = [0, 0], 0.0
        for j in range(12):
            slot = j % 2
            previous = last[slot] if sync_id == 1 or j >= 2 else ticket(sync_id - 1, 10 + slot)
            waited += ring.wait_free(slot, previous, 30.0, lambda: "producer")
            ring.slot(slot, torch.float32, 1000).fill_(float(j + 100 * sync_id))
            last[slot] = ticket(sync_id, j)
            ring.publish(slot, last[slot])
        assert out.get(timeout=60) == [1000.0 * (j + 100 * sync_id) for j in range(12)]
        proc.join(timeout=30)
        assert waited > 0  # the producer really waited for slots to come back
        ring.consumer_pids[0, 0] = 0  # that consumer is gone; the next registers itself
    ring.close()
    assert not (tmp_path / "r.ring").exists()


def test_waits_time_out_naming_what_they_waited_for(tmp_path):
    ring = ShmRing.create(tmp_path / "r.ring", num_slots=1, slot_bytes=64, num_replicas=1, tp=1)
    reader = ShmRing.attach(ring.path)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="engine 3 TP rank 1 waits for bucket 2/5: nothing after 0 s"):
        reader.wait_ready(0, ticket(1, 0), 0.3, lambda: "engine 3 TP rank 1 waits for bucket 2/5")
    assert time.monotonic() - start < 5
    ring.publish(0, ticket(1, 0))
    with pytest.raises(TimeoutError, match="slot 0 still held by engine 0"):
        ring.wait_free(0, ticket(1, 0), 0.3, lambda: "slot 0 still held by engine 0")
    with pytest.raises(RuntimeError, match="expected"):  # another bucket than the one waited for
        reader.wait_ready(0, ticket(0, 5), 1.0, lambda: "stale")
    reader.close()
    ring.close()


def _exit() -> None:
    pass


def test_a_dead_consumer_is_an_error_long_before_the_timeout(tmp_path):
    ring = ShmRing.create(tmp_path / "r.ring", num_slots=1, slot_bytes=64, num_replicas=1, tp=1)
    dead = CTX.Process(target=_exit)
    dead.start()
    dead.join()
    ring.consumer_pids[0, 0] = dead.pid
    ring.publish(0, ticket(1, 0))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="trainer rank 0 bucket 2: the peer process is gone"):
        ring.wait_free(0, ticket(1, 0), 60.0, lambda: "trainer rank 0 bucket 2")
    assert time.monotonic() - start < 10
    ring.close()


def _own_ring_then_hang(root: str, ready) -> None:
    path = os.path.join(root, run_dir_name(), "weight_push", "push1-t0.ring")
    ShmRing.create(path, num_slots=2, slot_bytes=1 << 16, num_replicas=1, tp=1)
    ready.put(path)
    time.sleep(600)


def test_a_killed_owners_ring_is_removed_by_the_dead_run_sweep(tmp_path):
    # The ring sits in its owner's per-process run dir: the sweep of dead runs' dirs finds it.
    assert ring_path("push1", 3).parent.parent == shm_root() / run_dir_name()
    ready = CTX.Queue()
    owner = CTX.Process(target=_own_ring_then_hang, args=(str(tmp_path), ready))
    owner.start()
    path = ready.get(timeout=60)
    run_dir = tmp_path / run_dir_name(owner.pid)
    assert os.path.isfile(path) and dead_run_dirs(tmp_path) == []  # alive: never touched
    os.kill(owner.pid, signal.SIGKILL)
    owner.join()
    assert dead_run_dirs(tmp_path) == [run_dir]
    assert sweep_dead_run_dirs(tmp_path) == [run_dir] and not run_dir.exists()


def test_closing_a_ring_leaves_no_empty_run_dir(tmp_path):
    path = tmp_path / run_dir_name() / "weight_push" / "push1-t0.ring"
    ring = ShmRing.create(path, num_slots=1, slot_bytes=64, num_replicas=1, tp=1)
    ring.close()
    assert list(tmp_path.iterdir()) == []


def _group_member(port: int, rank: int, out) -> None:
    group = NetworkGroup("127.0.0.1", port, rank, 2, 30.0)
    if rank == 0:
        group.send(torch.arange(10, dtype=torch.float32), 1)
    else:
        buf = torch.zeros(10)
        group.recv(buf, 0)
        out.put(buf.tolist())
    group.close()


def test_the_push_group_moves_a_bucket_between_processes():
    from megatron_rl.distributed.ports import free_port

    port, out = free_port(), CTX.Queue()
    procs = [CTX.Process(target=_group_member, args=(port, r, out)) for r in range(2)]
    for p in procs:
        p.start()
    assert out.get(timeout=120) == [float(i) for i in range(10)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
