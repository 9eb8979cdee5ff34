"""Math rule reward: answer extraction, grading on many formats, the hard timeout."""
from __future__ import annotations

import math
import time

import pytest

from megatron_rl.reward.math_reward import (
    CallFailed,
    CallTimeout,
    IsolatedCall,
    MathReward,
    RewardResult,
    extract_ground_truth,
    extract_response_answer,
    grade,
)

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"


def slow_grade(response: str, ground_truth: str) -> RewardResult:
    """Injected grader that hangs (runs in the grading child; test-only)."""
    time.sleep(30)
    return RewardResult(1.0, True, "never")


def failing_grade(response: str, ground_truth: str) -> RewardResult:
    """Injected grader that raises (test-only)."""
    raise ZeroDivisionError("injected failure")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{72}.", "72"),
        ("\\boxed{1} and later \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),   # last box wins
        ("nested \\boxed{\\sqrt{\\frac{a}{b}}} done", "\\sqrt{\\frac{a}{b}}"),
        ("work\n#### 1,080\n", "1,080"),
        ("#### 42.", "42"),                                                # trailing period dropped
        ("\\boxed{3} then\n#### 4", "4"),                                   # later of the two wins
        ("#### 4 then \\boxed{3}", "3"),
        ("\\boxed{5} and a truncated \\boxed{\\frac{1", "5"),               # unbalanced one skipped
        ("The answer is 72", None),
        ("", None),
        ("####   \n", None),
    ],
)
def test_extract_response_answer(text: str, expected: str | None) -> None:
    assert extract_response_answer(text) == expected


def test_extract_ground_truth_formats() -> None:
    assert extract_ground_truth(GSM8K_SOLUTION) == "72"
    assert extract_ground_truth("The area is $\\boxed{\\frac{\\pi}{4}}$.") == "\\frac{\\pi}{4}"
    assert extract_ground_truth(" 3.5 ") == "3.5"


@pytest.mark.parametrize(
    "response, ground_truth, correct",
    [
        ("Thus \\boxed{72}.", GSM8K_SOLUTION, True),
        ("Thus\n#### 72", GSM8K_SOLUTION, True),
        ("Thus \\boxed{73}.", GSM8K_SOLUTION, False),
        ("#### 1080", "#### 1,080", True),                      # thousands separator
        ("\\boxed{1,080}", "1080", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),                 # fraction vs decimal
        ("\\boxed{\\dfrac12}", "\\frac{1}{2}", True),
        ("\\boxed{1/2}", "\\boxed{\\frac{1}{2}}", True),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", True),
        ("#### 3\\pi", "\\boxed{3\\pi}", True),                  # latex after ####
        ("\\boxed{3}", "\\boxed{3\\pi}", False),                 # 3 is not 3*pi
        ("\\boxed{x^2+1}", "$1+x^2$", True),                     # symbolic equality
        ("\\boxed{x^2-1}", "$1+x^2$", False),
        ("#### $18.", "18", True),                               # currency and period
        ("\\boxed{18 dollars}", "18", True),
        ("\\boxed{-7}", "-7", True),
        ("\\boxed{7}", "-7", False),
        ("the answer is 72", "72", False),                       # no boxed / #### -> no answer
        ("}{ \\boxed{ garbage ### #", "5", False),
        ("\\boxed{\\text{blue}}", "7", False),
    ],
)
def test_grade_formats(response: str, ground_truth: str, correct: bool) -> None:
    result = grade(response, ground_truth)
    assert result.correct is correct
    assert result.reward == (1.0 if correct else 0.0)


def test_grade_reports_why() -> None:
    assert grade("I think 72", "72").status == "no_answer"
    ok = grade("\\boxed{71}", "72")
    assert (ok.status, ok.extracted) == ("ok", "71")
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        grade("\\boxed{1}", "")


def test_isolated_call_kills_a_hanging_call_and_recovers() -> None:
    runner = IsolatedCall()
    try:
        assert runner.call(math.sqrt, (16.0,), timeout_s=30) == 4.0
        start = time.monotonic()
        with pytest.raises(CallTimeout, match="exceeded 0.5 s"):
            runner.call(time.sleep, (30,), timeout_s=0.5)
        assert time.monotonic() - start < 5
        assert runner.restarts == 1
        assert runner.call(math.sqrt, (9.0,), timeout_s=30) == 3.0   # a fresh child took over
        with pytest.raises(CallFailed, match="ValueError"):
            runner.call(int, ("not a number",), timeout_s=30)
        assert runner.call(abs, (-2,), timeout_s=30) == 2              # errors keep the child
        assert runner.restarts == 1
    finally:
        runner.close()


@pytest.fixture(scope="module")
def math_reward():
    reward = MathReward(timeout_s=2.0, timeout_reward=-0.5)
    reward.start()
    yield reward
    reward.close()


def test_math_reward_scores_in_child_process(math_reward: MathReward) -> None:
    right = math_reward("so \\boxed{\\frac{3}{4}}", "0.75")
    assert (right.reward, right.correct, right.extracted, right.status) == (1.0, True, "\\frac{3}{4}", "ok")
    wrong = math_reward("#### 5", GSM8K_SOLUTION)
    assert (wrong.reward, wrong.correct, wrong.status) == (0.0, False, "ok")


def test_math_reward_times_out_on_pathological_input(math_reward: MathReward) -> None:
    # sympy tries to evaluate this factorial exactly and never returns.
    start = time.monotonic()
    result = math_reward("\\boxed{(10^{10^{10}})!}", "5")
    assert time.monotonic() - start < 8
    assert (result.reward, result.correct, result.status) == (-0.5, False, "timeout")
    assert result.extracted == "(10^{10^{10}})!"
    assert "exceeded 2.0 s" in result.detail
    # The worker keeps scoring after the kill.
    assert math_reward("\\boxed{2}", "2").correct


def test_math_reward_injected_slow_and_failing_graders() -> None:
    slow = MathReward(timeout_s=0.5, timeout_reward=0.25, grade_fn=slow_grade)
    failing = MathReward(timeout_s=5.0, timeout_reward=0.0, grade_fn=failing_grade)
    try:
        result = slow("\\boxed{1}", "1")
        assert (result.reward, result.status, slow.restarts) == (0.25, "timeout", 1)
        result = failing("\\boxed{1}", "1")
        assert result.status == "error"
        assert "ZeroDivisionError: injected failure" in result.detail
        assert result.reward == 0.0
    finally:
        slow.close()
        failing.close()


def test_math_reward_works_from_a_worker_thread(math_reward: MathReward) -> None:
    # math-verify's own signal-based timeout raises outside the main thread; ours must not.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        result = pool.submit(math_reward, "\\boxed{(10^{10^{10}})!}", "5").result(timeout=30)
        assert result.status == "timeout"
        assert pool.submit(math_reward, "#### 12", "12").result(timeout=30).correct
