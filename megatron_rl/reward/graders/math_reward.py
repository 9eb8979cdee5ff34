"""Rule-based math reward: 1.0 when a response's final answer equals the ground truth.

* Ground truth: a plain answer, a GSM8K solution (the text after its last ``####``), or a
  solution with the answer in its last ``\\boxed{}``.
* Response: the answer in its last complete ``\\boxed{...}`` or its last ``#### X`` line,
  whichever comes later (:mod:`~megatron_rl.reward.graders.answer_extraction`, linear-time on any
  input). A response with neither scores 0 (status ``no_answer``): rewarding any number found
  in free text would teach the model to hedge.
* Comparison: :func:`~megatron_rl.reward.graders.math_grader.answers_match` (math-verify on the whole
  answer; its module docstring lists the answer forms and the decisions on ambiguous ones).

The time bound: math-verify's own timeouts use ``signal.alarm``, which only works in a
process's main thread (reward workers run inside Ray actors, in worker threads), has whole-
second resolution, and cannot stop a long C-level operation (sympy evaluating
``10^{10^{10}}``). So grading runs in a warm forked process
(:class:`~megatron_rl.reward.sandbox.isolated_call.IsolatedCall`) that is killed when a call overruns
``timeout_s``. After the kill the caller only does linear-time work (re-extracting the answer
for the report), and the next call gets a new warm process in milliseconds, so every call
returns within ``timeout_s`` plus milliseconds whatever the input (and whatever came before);
the timeout is reported as status ``timeout`` with ``timeout_reward``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from megatron_rl.reward.graders.answer_extraction import extract_ground_truth, extract_response_answer
from megatron_rl.reward.graders.result import RewardResult
from megatron_rl.reward.sandbox.isolated_call import CallFailed, CallTimeout, IsolatedCall

logger = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 2000
"""Longer extracted answers are graded wrong without parsing. Competition answers (even a 4x4
matrix of fractions) are a few hundred characters; a longer one is runaway output, and parsing
it would burn the whole timeout (and a grading process) to find that out."""


def grade(response: str, ground_truth: str) -> RewardResult:
    """Score ``response`` against ``ground_truth`` in this process, with no timeout.

    Raises ValueError when the ground truth cannot be parsed. Use :class:`MathReward` (which
    calls this in a killable child process) everywhere a pathological input must not hang the
    caller.
    """
    from megatron_rl.reward.graders.math_grader import answers_match, parse_gold

    start = time.monotonic()
    extracted = extract_response_answer(response)
    if extracted is None:
        return RewardResult(0.0, False, "", "no_answer", "no \\boxed{} or '####' answer",
                            time.monotonic() - start)
    gold = extract_ground_truth(ground_truth)
    if len(extracted) > MAX_ANSWER_CHARS:
        parse_gold(gold)   # a bad ground truth is still reported as one
        return RewardResult(0.0, False, extracted, "ok", f"answer longer than {MAX_ANSWER_CHARS} chars: "
                            "graded wrong unparsed", time.monotonic() - start)
    correct = answers_match(gold, extracted)
    return RewardResult(1.0 if correct else 0.0, correct, extracted, "ok", "",
                        time.monotonic() - start)


_WARM_UP_PAIRS = (("\\boxed{1}", "1"), ("\\boxed{(1+i)^2}", "\\frac{x}{2}"),
                  ("\\boxed{y=2x}", "y=2x+1"), ("\\boxed{x > 1}", "(1, \\infty)"))


def _warm_up() -> None:
    """Import math-verify and sympy (including the lazily loaded solvers) and compile their
    regexes once, so the first timed calls do not pay for it (~1 s)."""
    for response, gold in _WARM_UP_PAIRS:
        grade(response, gold)


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
        """Score one response; never raises, and returns within ``timeout_s`` plus milliseconds
        (once started: the first call without :meth:`start` also starts the grading process)."""
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
        """Grading processes killed so far (each timeout costs one)."""
        return self._runner.restarts

    def close(self) -> None:
        """Stop the grading process."""
        self._runner.close()
