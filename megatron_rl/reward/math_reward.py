"""Rule-based math reward: 1.0 when a response's final answer equals the ground truth.

Answers are compared with math-verify (``math_verify.parse`` / ``math_verify.verify``), so
``1/2``, ``0.5``, ``\\frac{1}{2}`` and ``\\dfrac12`` all match, as do ``1,080`` and ``1080``.

* Ground truth: a plain number or expression, a GSM8K solution (the text after its last
  ``####``), or a LaTeX answer inside ``\\boxed{}``.
* Response: the answer in its last ``\\boxed{...}`` or its last ``#### X`` line, whichever comes
  later in the text. A response with neither scores 0 (status ``no_answer``): rewarding any
  number found in free text would teach the model to hedge.

math-verify's own timeouts use ``signal.alarm``, which only works in a process's main thread;
reward workers run inside Ray actors (worker threads) where that raises. So grading runs in a
persistent child process (:class:`IsolatedCall`) that the caller kills and restarts when a call
overruns ``timeout_s``: no input, however pathological, can stall a worker for longer.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

logger = logging.getLogger(__name__)

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_CHILD_START_TIMEOUT_S = 120.0


@dataclass
class RewardResult:
    """Outcome of scoring one response."""

    reward: float
    """1.0 when correct, 0.0 when wrong, ``timeout_reward`` on timeout or failure."""
    correct: bool
    """Whether the extracted answer matched the ground truth."""
    extracted: str
    """The answer text taken from the response ('' when none was found)."""
    status: str = "ok"
    """'ok' (graded), 'no_answer' (no \\boxed{} or '####' in the response), 'timeout' or 'error'."""
    detail: str = ""
    """Why a non-'ok' status happened (exception text, the timeout)."""
    elapsed_s: float = 0.0
    """Wall-clock seconds spent scoring."""


def last_boxed(text: str) -> tuple[int, str] | None:
    """(position, content) of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces."""
    for match in reversed(list(_BOXED_RE.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return match.start(), text[start:i].strip()
        # Unbalanced (e.g. truncated mid-answer): try the previous one.
    return None


def last_hash_answer(text: str) -> tuple[int, str] | None:
    """(position, content) of the last ``#### X`` line; trailing '.' and whitespace dropped."""
    matches = list(_HASH_RE.finditer(text))
    if not matches:
        return None
    answer = matches[-1].group(1).strip().rstrip(".").strip()
    return (matches[-1].start(), answer) if answer else None


def extract_response_answer(response: str) -> str | None:
    """The final answer of a response: from whichever of its last ``\\boxed{}`` and its last
    ``####`` line comes later; None when it has neither."""
    candidates = [c for c in (last_boxed(response), last_hash_answer(response)) if c is not None]
    if not candidates:
        return None
    return max(candidates)[1]


def extract_ground_truth(answer: str) -> str:
    """The comparable part of a dataset answer: after the last '####' (GSM8K), else the last
    ``\\boxed{}`` content (MATH solutions), else the whole string."""
    hashed = last_hash_answer(answer)
    if hashed is not None:
        return hashed[1]
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed[1]
    return answer.strip()


def _parse_answer(answer: str) -> list:
    """Parse an extracted answer with math-verify.

    LaTeX answers (a backslash) are parsed in a ``\\boxed{}`` so '3\\pi' is not read as '3';
    plain ones raw first, so '18 dollars' reads as 18 rather than a product of symbols. The
    other form is the fallback ('x^2+1' only parses boxed).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    forms = ["\\boxed{" + answer + "}", answer]
    if "\\" not in answer:
        forms.reverse()
    for form in forms:
        # Timeouts are enforced by the process boundary around this call (see IsolatedCall).
        parsed = parse(form, extraction_config=configs, parsing_timeout=None)
        if parsed:
            return parsed
    return []


def grade(response: str, ground_truth: str) -> RewardResult:
    """Score ``response`` against ``ground_truth`` in this process, with no timeout.

    Use :class:`MathReward` (which calls this in a killable child process) everywhere a
    pathological input must not hang the caller.
    """
    from math_verify import verify

    start = time.monotonic()
    extracted = extract_response_answer(response)
    if extracted is None:
        return RewardResult(0.0, False, "", "no_answer", "no \\boxed{} or '####' answer",
                            time.monotonic() - start)
    gold = _parse_answer(extract_ground_truth(ground_truth))
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}")
    pred = _parse_answer(extracted)
    correct = bool(pred) and bool(verify(gold, pred, timeout_seconds=None))
    return RewardResult(1.0 if correct else 0.0, correct, extracted, "ok", "",
                        time.monotonic() - start)


def _warm_up() -> None:
    """Import math-verify (and sympy) once, so the first timed call does not pay for it."""
    grade("\\boxed{1}", "1")


def _serve(read_fd: int, write_fd: int) -> None:
    """Child-process main: answer ``(fn, args)`` requests until the parent closes the pipe."""
    # math-verify logs a warning for every call made with its own timeout disabled.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    requests, replies = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    replies.send(("ready", None))
    while True:
        try:
            fn, args = requests.recv()
        except (EOFError, OSError):
            return
        try:
            replies.send(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, never raised here
            replies.send(("error", f"{type(exc).__name__}: {exc}"))


_CHILD_CODE = (
    "import sys; from megatron_rl.reward.math_reward import _serve; "
    "_serve(int(sys.argv[1]), int(sys.argv[2]))"
)


class CallTimeout(Exception):
    """A call in the child process ran past its timeout (the child was killed)."""


class CallFailed(Exception):
    """A call raised in the child process, or the child died; the message says which."""


class IsolatedCall:
    """Runs picklable functions in a persistent child process with a hard wall-clock timeout.

    The child is a fresh interpreter (``subprocess`` + two pipes), not a fork: the parent may
    be a multi-threaded Ray worker, and unlike multiprocessing's 'spawn' it never re-imports
    the parent's ``__main__`` (so scripts without a ``__main__`` guard work). It gets the
    parent's ``sys.path``, so any function the parent can import it can run. It is started on
    the first call and reused; a call that overruns is ended by killing the child, and the next
    call starts a fresh one. Start-up and ``warm_up`` do not count against a call's timeout.
    """

    def __init__(self, warm_up: Callable[[], Any] | None = None) -> None:
        self._warm_up = warm_up
        self._proc: subprocess.Popen | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self.restarts = 0
        """Children killed (timeouts, crashes) so far."""

    def _start(self) -> None:
        child_read, parent_write = os.pipe()
        parent_read, child_write = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, str(child_read), str(child_write)],
                pass_fds=(child_read, child_write), env=env, stdin=subprocess.DEVNULL,
            )
        except OSError:
            os.close(parent_write)
            os.close(parent_read)
            raise
        finally:
            os.close(child_read)
            os.close(child_write)
        self._requests = Connection(parent_write, readable=False)
        self._replies = Connection(parent_read, writable=False)
        if not self._replies.poll(_CHILD_START_TIMEOUT_S):
            self._kill()
            raise CallFailed(f"reward child process did not start within {_CHILD_START_TIMEOUT_S} s")
        self._replies.recv()
        if self._warm_up is not None:
            self._roundtrip(self._warm_up, (), _CHILD_START_TIMEOUT_S)

    def ensure_started(self) -> None:
        """Start the child now (and warm it up) unless a live one exists."""
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        """``fn(*args)`` in the child; raises :class:`CallTimeout` or :class:`CallFailed`."""
        self.ensure_started()
        return self._roundtrip(fn, args, timeout_s)

    def _roundtrip(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        try:
            self._requests.send((fn, args))
            if not self._replies.poll(timeout_s):
                self._kill()
                raise CallTimeout(f"exceeded {timeout_s} s")
            kind, value = self._replies.recv()
        except (EOFError, OSError) as exc:
            self._kill()
            raise CallFailed(f"reward child process died: {exc!r}") from exc
        if kind == "error":
            raise CallFailed(value)
        return value

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
                self.restarts += 1
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                # SIGKILL sent but the child is not gone yet (e.g. stuck in the kernel): abandon
                # it rather than raise out of every later call that would keep reusing it.
                logger.warning("reward child process %d did not exit 10 s after SIGKILL; abandoning it",
                               self._proc.pid)
        self._close_pipes()
        self._proc = None

    def _close_pipes(self) -> None:
        for conn in (self._requests, self._replies):
            if conn is not None:
                conn.close()
        self._requests, self._replies = None, None

    def close(self) -> None:
        """Stop the child process (a later call starts a new one)."""
        if self._proc is None:
            return
        self._close_pipes()  # the child's recv() sees EOF and exits
        try:
            self._proc.wait(2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def __del__(self) -> None:
        # Best effort: never leave a grading process behind when a worker is dropped.
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.kill()
            except OSError:
                pass


class MathReward:
    """The math rule reward with a robust per-call timeout (works in any thread or actor)."""

    def __init__(self, timeout_s: float = 2.0, timeout_reward: float = 0.0,
                 grade_fn: Callable[[str, str], RewardResult] = grade) -> None:
        """``grade_fn`` must be a picklable module-level function; tests inject slow ones."""
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s={timeout_s} must be > 0")
        self.timeout_s = timeout_s
        self.timeout_reward = timeout_reward
        self._grade_fn = grade_fn
        self._runner = IsolatedCall(warm_up=_warm_up)

    def __call__(self, response: str, ground_truth: str) -> RewardResult:
        """Score one response; never raises and never takes much longer than ``timeout_s``."""
        start = time.monotonic()
        try:
            result = self._runner.call(self._grade_fn, (response, ground_truth), self.timeout_s)
        except CallTimeout as exc:
            return self._failed("timeout", str(exc), response, start)
        except CallFailed as exc:
            return self._failed("error", str(exc), response, start)
        result.elapsed_s = time.monotonic() - start
        return result

    def _failed(self, status: str, detail: str, response: str, start: float) -> RewardResult:
        logger.debug("math reward %s (%s) on a %d-char response", status, detail, len(response))
        extracted = extract_response_answer(response) or ""
        return RewardResult(self.timeout_reward, False, extracted, status, detail,
                            time.monotonic() - start)

    def start(self) -> None:
        """Start and warm up the grading process now, so the first response is not slowed."""
        try:
            self._runner.ensure_started()
        except CallFailed as exc:
            logger.warning("math reward process failed to start: %s", exc)

    @property
    def restarts(self) -> int:
        """Grading processes killed so far (each timeout or crash costs one)."""
        return self._runner.restarts

    def close(self) -> None:
        """Stop the grading process."""
        self._runner.close()
