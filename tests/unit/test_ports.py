"""free_port: ports outside the kernel's ephemeral range, bindable when returned, taken ones skipped."""
from __future__ import annotations

import socket

import pytest

from megatron_rl.distributed import ports


def test_a_port_is_drawn_below_the_ephemeral_range_and_binds():
    got = {ports.free_port() for _ in range(20)}
    assert all(ports.LOW <= p < ports.HIGH for p in got)
    assert len(got) > 10  # drawn, not handed out in sequence
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", got.pop()))


def test_a_taken_port_is_skipped_and_none_free_is_an_error(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken, taken, 25001])
        monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, lo, hi: next(draws))
        assert ports.free_port() == 25001
        monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, lo, hi: taken)
        with pytest.raises(RuntimeError, match="no free TCP port"):
            ports.free_port(attempts=3)
