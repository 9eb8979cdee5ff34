"""What a test run must not print: asyncio's pending-task and unretrieved-exception messages, exceptions
Python could not raise (``Exception ignored in ...``), unclosed resources and coroutines never awaited.

Each one is a real problem that a passing test hides: a task left running when its loop went away, a
failure nobody looked at, a file or socket nobody closed. They surface late (when the garbage collector
or the interpreter's exit gets to the object), far from their cause, so they are caught two ways:

* :class:`Recorder`, a handler on the ``asyncio`` logger that every pytest process (xdist's workers and
  controller) installs when ``TEST_NOISE_FILE`` names a file (tests/run.sh sets it), and
  :func:`watch_unraisable`, a ``sys.unraisablehook`` in front of pytest's: each such record is
  appended there with the test that was running. A message logged inside a passing test goes to pytest's
  log capture and is never shown; the recorder still sees it. Each process collects its garbage at the
  session's end, so a task abandoned by the last test is reported too.
* :func:`scan` over the run's console output (tests/run.sh tees it): what the recorder cannot see, such
  as pytest's ``PytestUnraisableExceptionWarning`` or a line printed at the interpreter's exit.

``python -m tests.helpers.noise [--record FILE] [LOG ...]`` prints every hit with where it came from
and exits 1 if there is any; tests/run.sh fails the run then.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import sys
from pathlib import Path

ENV = "TEST_NOISE_FILE"
"""The variable naming the file the recorder appends to; unset: nothing is recorded."""

PATTERNS: dict[str, re.Pattern] = {
    "pending task": re.compile(r"Task was destroyed but it is pending"),
    "unretrieved exception": re.compile(r"(Task|Future) exception was never retrieved"),
    "unraisable exception": re.compile(r"Exception ignored in|PytestUnraisableExceptionWarning"),
    "unclosed resource": re.compile(r"ResourceWarning|[Uu]nclosed (file|socket|event loop|transport|client session|<)"),
    "coroutine never awaited": re.compile(r"coroutine .{1,200} was never awaited"),
}
"""Kind of noise -> the message that shows it (asyncio's, Python's, pytest's own wording)."""

# A line that quotes the patterns without being noise: this module's own report.
_OWN = re.compile(r"tests/run\.sh: noise")


def kind_of(line: str) -> str | None:
    """The kind of noise ``line`` shows, None when it shows none."""
    if _OWN.search(line):
        return None
    for kind, pattern in PATTERNS.items():
        if pattern.search(line):
            return kind
    return None


def scan(lines) -> list[tuple[int, str, str]]:
    """``(line number, kind, line)`` of every noisy line."""
    return [(n, kind, line.rstrip()) for n, line in enumerate(lines, 1) if (kind := kind_of(line))]


class Recorder(logging.Handler):
    """Appends each noisy ``asyncio`` record to ``path`` as ``<test>\\t<kind>\\t<first line>`` (one write)."""

    def __init__(self, path: str) -> None:
        super().__init__(level=logging.WARNING)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format is not ours to judge
            return
        kind = kind_of(message)
        if kind is None:
            return
        test = os.environ.get("PYTEST_CURRENT_TEST", "(between tests)").split(" (")[0]
        lines = message.splitlines() or [""]
        first = lines[0]
        # asyncio names the task on a later line: "task: <Task pending name=... coro=<...> ...>"
        extra = next((f" [{line.strip()[:240]}]" for line in lines[1:] if "coro=" in line), "")
        if record.exc_info and record.exc_info[1] is not None:
            extra += f" [{type(record.exc_info[1]).__name__}: {record.exc_info[1]}]"
        line = f"{test}\t{kind}\t{first}{extra}".replace("\n", " ") + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


_installed: list[Recorder] = []


def install() -> None:
    """Attach the recorder to the ``asyncio`` logger when ``TEST_NOISE_FILE`` is set (once per process)."""
    path = os.environ.get(ENV)
    if path and not _installed:
        recorder = Recorder(path)
        logging.getLogger("asyncio").addHandler(recorder)
        _installed.append(recorder)


def watch_unraisable() -> None:
    """Record every exception Python could not raise (``sys.unraisablehook``: a ``__del__`` that raised, a
    callback that failed at garbage collection), then hand it to the hook that was there (pytest's, which
    turns it into a ``PytestUnraisableExceptionWarning``: a ``UserWarning``, so a run that ignores those,
    as tests/run.sh does for vLLM's and Megatron's, would never show it). Call it after pytest's own
    configuration (``pytest_sessionstart``); once per process."""
    path = os.environ.get(ENV)
    previous = sys.unraisablehook
    if not path or getattr(previous, "_noise_recorder", False):
        return

    def hook(unraisable) -> None:
        test = os.environ.get("PYTEST_CURRENT_TEST", "(between tests)").split(" (")[0]
        what = f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}"[:200]
        error = f"{type(unraisable.exc_value).__name__}: {unraisable.exc_value}"[:200]
        line = f"{test}\tunraisable exception\t{what} [{error}]".replace("\n", " ") + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        previous(unraisable)

    hook._noise_recorder = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def flush() -> None:
    """Collect garbage now, so tasks and futures that nothing refers to report themselves while the
    recorder listens (at the interpreter's exit they may never be collected, or print unseen)."""
    if _installed:
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.noise", description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="*", type=Path, help="console output of a run")
    parser.add_argument("--record", type=Path, help="the recorder's file (TEST_NOISE_FILE)")
    args = parser.parse_args(argv)
    hits = []
    if args.record is not None and args.record.is_file():
        for row in args.record.read_text().splitlines():
            test, kind, message = (row.split("\t") + ["", ""])[:3]
            hits.append(f"{kind} in {test}: {message}")
    for log in args.logs:
        if log.is_file():
            with log.open(errors="replace") as lines:
                hits += [f"{kind} ({log.name}:{n}): {line[:300]}" for n, kind, line in scan(lines)]
    if hits:
        print(f"tests/run.sh: noise in the test run ({len(hits)}): each is a task left pending, an exception never "
              "retrieved, an exception Python could not raise or a resource never closed", file=sys.stderr)
        for hit in dict.fromkeys(hits):  # once each, in order
            print(f"  {hit}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
