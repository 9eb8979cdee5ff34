"""vLLM's ring-buffer readers on a CPU engine wait on their notification socket instead of spinning.

The engine core and its TP workers hand each step over through vLLM's shared-memory ring buffers
(vllm/distributed/device_communicators/shm_broadcast.py, ``MessageQueue``): after a read, a reader keeps
checking the buffer in a loop for ``SpinCondition.busy_loop_s`` (1 s) before it sleeps on the socket the
writer notifies with every message. On a GPU node the readers spin on host cores nobody else needs; on a
CPU engine they are the cores its other ranks compute on, so through every step the core and each idle
worker spin beside the ones that work (three processes on two cores at TP 2), and every idle second starts
with one more spun. Measured on the 2-core box (TP 2, 16 requests of 64 tokens, the tiny model): 4.9 s and
~9 CPU s spinning, 3.5 s and ~7 CPU s waiting on the socket.

:func:`apply` makes every reader of the process wait on the socket: ``SpinCondition.wait`` is patched on
the class, so readers made before the call (a worker's, made before vLLM imports the worker extension)
wait too. The executor of a CPU engine calls it in the engine core (its readers and the workers it forks
inherit it); the worker extension (``vllm_worker_ext``) calls it in every CPU worker, forked or spawned.
Idempotent; never applied where CUDA runs the model.
"""
from __future__ import annotations

_PATCHED = "_megatron_rl_waits_on_socket"


def apply() -> bool:
    """Readers of this process wait on their notification socket; returns whether it is in force."""
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition.wait, _PATCHED, False):
        return True
    spin_wait = condition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = 0.0  # the time after the last read in which the reader spins
        return spin_wait(self, timeout_ms)

    setattr(wait, _PATCHED, True)
    wait.__doc__, wait.__wrapped__ = spin_wait.__doc__, spin_wait
    condition.wait = wait
    return True


def in_force() -> bool:
    """Whether :func:`apply` ran in this process (reported by ``vllm_worker_ext.process_settings``)."""
    import sys

    module = sys.modules.get("vllm.distributed.device_communicators.shm_broadcast")
    return bool(module is not None and getattr(module.SpinCondition.wait, _PATCHED, False))
