"""asyncio pieces whose standard-library versions lose a cancellation on Python 3.11.

``asyncio.wait_for`` of Python 3.11 returns the awaited result, and drops the cancellation, when
the task is cancelled after the awaited future finished but before the task resumed
(python/cpython#86296, fixed in 3.12 by rebuilding ``wait_for`` on ``asyncio.timeout``). The
driver awaits Ray object refs through it on every engine call, each finished from Ray's own
thread; under load a Ctrl-C (which ``asyncio.run`` turns into one cancellation of the main task)
landed in that window, the step went on and the run ended with exit 0. :func:`wait_for` is the
3.12 behaviour; ruff's banned-api rule (``ruff.toml``) keeps ``asyncio.wait_for`` out of the code.

:func:`run_until_interrupted` is ``asyncio.run`` for the training loop: the first Ctrl-C cancels the
main task and keeps cancelling it until it ends, so a cancellation that some library absorbs
(ours are fixed; Ray's and vLLM's are not ours) cannot keep the run going, and the run then
raises ``KeyboardInterrupt`` even if the task returned. A second Ctrl-C raises at once, as with
``asyncio.run``.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

RECANCEL_EVERY_S = 1.0
"""After a Ctrl-C, how often the main task is cancelled again while it has not ended."""


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for`` without Python 3.11's lost cancellation: raises ``TimeoutError`` after
    ``timeout`` seconds (None: no limit); an outer cancellation always propagates."""
    async with asyncio.timeout(timeout):
        return await awaitable


def awaited_elsewhere(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task whose result its owner awaits where it matters (a group's rewards gathered before the
    group is trained) and otherwise drops: after the owner already failed on a sibling's error, or for a
    response that will not be trained. Its failure is marked seen when it ends, so a dropped one does not
    print "Task exception was never retrieved" at the next garbage collection; whoever awaits it still
    gets the exception."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def run_until_interrupted(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end in a new event loop like ``asyncio.run``; Ctrl-C (SIGINT) cancels
    it, again every :data:`RECANCEL_EVERY_S` until it ends, and then raises ``KeyboardInterrupt``
    (whether the task ended cancelled, failed or returned). Off the main thread, where Python
    cannot take signals, this is ``asyncio.run``."""
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(main)
    runner = asyncio.Runner()
    loop = runner.get_loop()
    task = loop.create_task(main)
    interrupts = 0

    def keep_cancelling() -> None:
        if not task.done():
            task.cancel()
            loop.call_later(RECANCEL_EVERY_S, keep_cancelling)

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:
            raise KeyboardInterrupt()
        log.warning("Ctrl-C: stopping the run now, the current step is lost (teardown follows; "
                    "press Ctrl-C again to skip it)")
        loop.call_soon_threadsafe(keep_cancelling)  # wakes a loop asleep in select() too

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        try:
            result = loop.run_until_complete(task)
        except asyncio.CancelledError:
            if interrupts:
                raise KeyboardInterrupt() from None
            raise
        if interrupts:  # the task absorbed every cancellation and ended anyway
            raise KeyboardInterrupt()
        return result
    finally:
        signal.signal(signal.SIGINT, previous)
        if interrupts > 1 and not task.done():
            # Stop at once: Runner.close would cancel the task and wait for it to end, which a task
            # that ignores cancellation never does. Its frames are dropped with the loop.
            loop.close()
            asyncio.set_event_loop(None)
        else:
            runner.close()
