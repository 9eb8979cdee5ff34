"""megatron_rl.rollout.worker.ring_buffer_wait on vLLM's own ring-buffer reader: a reader that just read
spins (returns at once) under vLLM's default; once applied, the same reader, made before the call, sleeps
on its notification socket until the timeout, and a notification wakes it."""
from __future__ import annotations

import time
import uuid

import pytest
import zmq


@pytest.fixture
def spin_condition(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    # vLLM's own wait for the test, and whatever was there before afterwards (the class is shared by the
    # process's tests; an import of vllm_worker_ext beside vLLM applies the patch).
    wait = shm_broadcast.SpinCondition.wait
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", getattr(wait, "__wrapped__", wait))
    return shm_broadcast.SpinCondition


def _pair(condition_class, context):
    address = f"inproc://ring-{uuid.uuid4().hex}"
    writer = condition_class(is_reader=False, context=context, notify_address=address)
    reader = condition_class(is_reader=True, context=context, notify_address=address)
    return writer, reader


def _waited_ms(reader, timeout_ms: int) -> float:
    reader.record_read()  # a read just happened: vLLM's reader would spin now
    start = time.monotonic()
    reader.wait(timeout_ms=timeout_ms)
    return 1e3 * (time.monotonic() - start)


def test_a_reader_made_before_the_call_waits_on_its_socket(spin_condition):
    from megatron_rl.rollout.worker import ring_buffer_wait

    context = zmq.Context()
    try:
        writer, reader = _pair(spin_condition, context)
        assert _waited_ms(reader, 200) < 100  # vLLM's default: a busy loop, back at once
        assert not ring_buffer_wait.in_force()
        assert ring_buffer_wait.apply() and ring_buffer_wait.apply()  # idempotent
        assert ring_buffer_wait.in_force()
        assert _waited_ms(reader, 200) >= 150  # asleep on the socket until the timeout
        time.sleep(0.05)  # the PUB/SUB pair is connected (inproc): a notification reaches the reader
        writer.notify()
        assert _waited_ms(reader, 5000) < 2500  # woken by the writer, not by the timeout
    finally:
        context.destroy(linger=0)
