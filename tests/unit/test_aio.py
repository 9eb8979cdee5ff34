"""megatron_rl.runtime.aio: a cancellation is never lost (wait_for), and Ctrl-C always ends the loop
(run_until_interrupted), even when the running code absorbs the first cancellation."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_rl.runtime.aio import wait_for


def _cancel_as_the_call_finishes(waiter) -> str:
    """Python 3.11's lost-cancellation window: the awaited future finishes and the waiting task is
    cancelled before it resumes. Returns what the waiting task saw."""
    async def main() -> str:
        fut = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(waiter(fut, 10))
        await asyncio.sleep(0)  # the task is now waiting on fut
        fut.set_result("result")
        task.cancel()
        try:
            return f"returned {await task!r}"
        except asyncio.CancelledError:
            return "cancelled"

    return asyncio.run(main())


def test_wait_for_keeps_a_cancellation_that_lands_as_the_call_finishes() -> None:
    assert _cancel_as_the_call_finishes(wait_for) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12's asyncio.wait_for keeps it")
def test_the_standard_wait_for_of_this_python_loses_it() -> None:
    """Why megatron_rl.runtime.aio.wait_for exists (and ruff bans asyncio.wait_for outside the tests)."""
    assert _cancel_as_the_call_finishes(asyncio.wait_for) == "returned 'result'"


def test_wait_for_returns_and_times_out() -> None:
    async def main() -> None:
        assert await wait_for(asyncio.sleep(0, result=7), 5) == 7
        assert await wait_for(asyncio.sleep(0, result=8), None) == 8
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await wait_for(asyncio.sleep(30), 0.1)
        assert time.monotonic() - started < 5

    asyncio.run(main())


# The loop under test runs in a child process: the test sends it real SIGINTs, as a terminal does.
_CHILD = textwrap.dedent("""
    import asyncio, os, signal, sys, time
    from megatron_rl.runtime.aio import run_until_interrupted

    mode, interrupts = sys.argv[1], int(sys.argv[2])

    async def loop_body():
        loop = asyncio.get_running_loop()
        for k in range(interrupts):
            loop.call_later(0.2 + 0.5 * k, os.kill, os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + (30 if interrupts else 0.5)
        absorbed = 0
        while time.monotonic() < deadline:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                absorbed += 1
                if mode == "absorb_once" and absorbed == 1:
                    continue  # like Python 3.11's wait_for: the first cancellation is lost
                if mode == "absorb_once_then_return":
                    return "finished"
                if mode == "absorb_always":
                    continue
                raise
        return "ran to the end"

    started = time.monotonic()
    try:
        print("returned", run_until_interrupted(loop_body()))
    except KeyboardInterrupt:
        print(f"KeyboardInterrupt after {time.monotonic() - started:.1f} s")
        sys.exit(130)
""")


def _run_child(mode: str, interrupts: int) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, mode, str(interrupts)], capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def _seconds_to_stop(out: str) -> float:
    """How long the child's loop ran before KeyboardInterrupt reached its caller."""
    return float(out.split("KeyboardInterrupt after ")[1].split()[0])


@pytest.mark.parametrize("mode", ["plain", "absorb_once", "absorb_once_then_return"])
def test_ctrl_c_ends_the_loop_with_keyboard_interrupt_even_if_a_cancellation_is_absorbed(mode: str) -> None:
    rc, out = _run_child(mode, interrupts=1)
    assert rc == 130 and "KeyboardInterrupt after" in out, out
    seconds = _seconds_to_stop(out)
    assert seconds < 10, f"stopped only after {seconds} s (the body would have run 30 s):\n{out}"


def test_a_second_ctrl_c_stops_a_loop_that_ignores_cancellation() -> None:
    rc, out = _run_child("absorb_always", interrupts=2)
    assert rc == 130 and "KeyboardInterrupt after" in out, out
    assert _seconds_to_stop(out) < 10, out


def test_without_ctrl_c_the_loop_returns_its_result() -> None:
    rc, out = _run_child("plain", interrupts=0)
    assert rc == 0 and "returned ran to the end" in out, out
