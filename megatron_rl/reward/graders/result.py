"""What every grader returns for one response (math-verify, the code sandbox, the LLM judge); the
reward pool's worker shapes it by length into a ``RewardOutcome``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardResult:
    """Outcome of scoring one response, whichever grader scored it."""

    reward: float
    """1.0 when correct, 0.0 when wrong, ``timeout_reward`` on timeout or failure."""
    correct: bool
    """Whether the extracted answer matched the ground truth (code: every test passed)."""
    extracted: str
    """The answer (or code, or the judge's reply) taken from the response ('' when none was found)."""
    status: str = "ok"
    """'ok' (graded), 'no_answer' (no answer found: math, no \\boxed{} or '####'; code, no fenced
    block; judge, no YES/NO), 'timeout', 'error' or (code) 'cancelled'."""
    detail: str = ""
    """Why a non-'ok' status happened (exception text, the timeout), or why an 'ok' answer was
    not parsed (math: longer than ``math_reward.MAX_ANSWER_CHARS``)."""
    elapsed_s: float = 0.0
    """Wall-clock seconds spent scoring."""
