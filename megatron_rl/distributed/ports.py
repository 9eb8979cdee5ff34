"""Free TCP ports for rendezvous: torch.distributed's stores, the weight push's gloo group.

A port is drawn at random from [20000, 32768) and returned once it binds. That range lies below
Linux's default ephemeral range (``net.ipv4.ip_local_port_range``, 32768-60999) and above Ray's
worker ports (10002-19999): the kernel's ``bind(0)`` hands ports out of the ephemeral range, and
can give the same one to two processes that ask a moment apart, since the first closed it again
to pass the number on (seen as EADDRINUSE when two test workers started trainer ranks at once).
Here two callers collide only when they draw the same port within that moment.
"""
from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32768
"""The range ports are drawn from (high end excluded)."""


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A port of [LOW, HIGH) that nothing listens on at ``host`` now ("" for every interface)."""
    draw = random.SystemRandom()  # not the random module's state, which forked processes share
    for _ in range(attempts):
        port = draw.randrange(LOW, HIGH)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port in [{LOW}, {HIGH}) on {host or 'any interface'} after {attempts} draws")
