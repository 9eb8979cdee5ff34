"""SIGTERM ends a run at the next step boundary with a checkpoint, instead of mid-step.

Slurm sends SIGTERM at a job's time limit (with ``--signal``, minutes before it), on ``scancel``
and on preemption; Python's default action kills the driver on the spot, so the steps since the
last periodic checkpoint are lost and nothing is torn down (engines, the /dev/shm weights). With
:class:`GracefulStop` installed, the first SIGTERM lets the current step finish, the loop writes a
checkpoint and returns, teardown runs, and the process exits with 143 (128 + SIGTERM): resume with
``trainer.resume=true``. A second SIGTERM stops at once (SystemExit, teardown still runs).
SIGINT (Ctrl-C) stays immediate, with teardown (``megatron_rl.runtime.aio.run_until_interrupted``; exit 130). ``train.py`` installs
the handler right after ``ray.init``, which replaces any SIGTERM handler with its own
(``sys.exit``: immediate, with teardown), the behaviour before this one is installed.
"""
from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)


class GracefulStop:
    """Records a stop request from SIGTERM; the training loop polls :attr:`requested`."""

    def __init__(self) -> None:
        self.signum = 0
        """The signal that asked to stop (0: none yet)."""
        self.stopped_after: int | None = None
        """Set by the loop: the last step it ran before stopping early (None: it did not)."""

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def exit_code(self) -> int:
        """128 + the signal when the run stopped early (shell convention for "ended by signal"),
        else 0 (also when the signal came during the last step: the run is complete)."""
        return 128 + self.signum if self.stopped_after is not None else 0

    def install(self) -> None:
        """Handle SIGTERM in this process (a no-op off the main thread, where Python cannot)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum: int, frame=None) -> None:
        if self.signum:
            raise SystemExit(128 + signum)
        self.signum = signum
        log.warning("%s received: finishing the current step, then writing a checkpoint and stopping "
                    "(send it again to stop at once, losing the step)", signal.Signals(signum).name)
