"""GracefulStop: the first SIGTERM asks the loop to stop after the step, the second stops at once."""
import os
import signal

import pytest

from megatron_rl.runtime.graceful_stop import GracefulStop


def test_first_signal_requests_a_stop_second_exits_at_once():
    stop = GracefulStop()
    assert not stop.requested and stop.exit_code == 0
    stop.handle(signal.SIGTERM)
    assert stop.requested
    assert stop.exit_code == 0  # the loop has not stopped early (yet): e.g. the signal came in the last step
    stop.stopped_after = 3
    assert stop.exit_code == 128 + signal.SIGTERM
    with pytest.raises(SystemExit) as exc:
        stop.handle(signal.SIGTERM)
    assert exc.value.code == 143


def test_install_routes_a_real_sigterm_to_the_handler():
    previous = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop()
    try:
        stop.install()
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread before kill returns
        assert stop.requested and stop.signum == signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
