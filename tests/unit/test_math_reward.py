"""Math rule reward: answer extraction, grading on many formats, the hard timeout."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from megatron_rl.reward.graders.answer_extraction import extract_ground_truth, extract_response_answer, last_boxed
from megatron_rl.reward.graders.math_reward import MAX_ANSWER_CHARS, MathReward, grade
from megatron_rl.reward.graders.result import RewardResult
from megatron_rl.reward.sandbox.isolated_call import CallFailed, CallTimeout, IsolatedCall
from megatron_rl.tools.grader_report import adversarial_cases

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
        ("\\boxed {4}", "4"),                                             # space before the brace
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),                             # escaped braces are literal
        ("\\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),         # ... even unbalanced ones
        ("\\boxed{\\boxed{5}}", "5"),                                     # the inner box starts last
        ("a line break \\\\boxed{3}", None),                               # \\ then 'boxed' is no box
        ("}} stray \\boxed{x}}", "x"),
        ("\\fbox{7}", "7"),
        ("\\boxed{}", None),                                              # an empty box is no answer
    ],
)
def test_extract_response_answer(text: str, expected: str | None) -> None:
    assert extract_response_answer(text) == expected


def test_extract_ground_truth_formats() -> None:
    assert extract_ground_truth(GSM8K_SOLUTION) == "72"
    assert extract_ground_truth("The area is $\\boxed{\\frac{\\pi}{4}}$.") == "\\frac{\\pi}{4}"
    assert extract_ground_truth(" 3.5 ") == "3.5"


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{" * 15_000, None),                                  # 105 KB of unclosed boxes
    ("\\boxed{" * 15_000 + "\\boxed{5}", "5"),
    ("\\boxed{" + "{" * 100_000, None),                           # deeply nested, never closed
    ("\\boxed{" + "{" * 50_000 + "5" + "}" * 50_001, "{" * 50_000 + "5" + "}" * 50_000),
    ("\\fbox{" * 7_000 + "7" + "}" * 7_000, "7"),                # 7 000 nested boxes, all closed
    ("#### " + "#" * 100_000, "#" * 100_000),
    ("####\n" * 20_000 + "#### 9", "9"),
])
def test_extraction_is_linear_time(text: str, expected: str | None) -> None:
    # The old per-box rescan took 14.5 s on 56 KB of unclosed boxes (quadratic: ~45 s on these);
    # one pass takes ~50 ms. The bound leaves room for a heavily loaded machine.
    start = time.monotonic()
    assert extract_response_answer(text) == expected
    extract_ground_truth(text)
    assert time.monotonic() - start < 5.0


def test_last_boxed_positions() -> None:
    assert last_boxed("ab \\boxed{1} \\boxed{2}") == (13, "2")
    assert last_boxed("\\boxed{1} then \\boxed{") == (0, "1")
    assert last_boxed("no box") is None


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


def test_grade_skips_runaway_answers() -> None:
    long = "1+" * MAX_ANSWER_CHARS + "1"
    result = grade("\\boxed{" + long + "}", "5")
    assert (result.correct, result.status, result.extracted) == (False, "ok", long)
    assert "longer than" in result.detail
    assert grade("\\boxed{" + "1+" * 10 + "1}", "11").correct       # a short sum is graded
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        grade("\\boxed{" + long + "}", "")                        # a bad gold is still one


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


HANG_S = 60.0
"""A grading call that takes this long past its timeout hangs (the suite's load stretches a kill and a fork to seconds)."""


def test_math_reward_bounds_every_adversarial_input() -> None:
    """Back to back, each slow input comes back after one timeout: its grading process is killed once
    and a warm fork takes the next call (never a re-run of the work, which would cost a second kill).
    Counted by kills, not by the clock: on a loaded box a kill and a fork take seconds; the elapsed
    bound only catches a hang."""
    timeout_s = 2.0
    reward = MathReward(timeout_s=timeout_s, timeout_reward=-1.0)
    try:
        reward.start()
        timeouts = 0
        for name, response in adversarial_cases().items():
            start = time.monotonic()
            result = reward(response, "5")
            elapsed = time.monotonic() - start
            assert elapsed < timeout_s + HANG_S, (name, elapsed)  # + 0.03 s on a quiet box
            assert not result.correct and result.status in ("timeout", "ok", "no_answer"), (name, result)
            if result.status == "timeout":
                timeouts += 1
                assert result.reward == -1.0
            assert reward.restarts == timeouts, (name, reward.restarts, timeouts)  # one kill per timeout
        assert timeouts >= 4 and reward.restarts == timeouts
        assert reward("\\boxed{5}", "5").correct  # the next response is graded by the warm fork
        assert reward.restarts == timeouts
    finally:
        reward.close()


def test_reward_pool_scores_and_counts_a_math_timeout(tmp_path: Path) -> None:
    """Through the reward worker path: a timed-out response scores timeout_reward and is counted."""
    from megatron_rl.config.schema import RewardConfig
    from megatron_rl.model.tiny import build_tokenizer
    from megatron_rl.reward.pool.reward_pool import RewardPool
    from megatron_rl.sample import Prompt, Sample

    build_tokenizer().save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path)

    def sample(index: int, text: str) -> Sample:
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return Sample(prompt=Prompt(prompt_id="p", token_ids=[1, 2], answer="5"), response_index=index,
                      response_ids=ids, finish_reason="stop")

    pool = RewardPool(RewardConfig(timeout_s=1.0, timeout_reward=-0.5), str(tmp_path), max_new_tokens=64,
                      use_ray=False)
    try:
        first = sample(0, "\\boxed{5}")
        pool.wait([pool.submit(first)], timeout_s=60)      # in-process: starts the grading process
        samples = [sample(1, "\\boxed{(10^{10^{10}})!}"), sample(2, "\\boxed{6}")]
        start = time.monotonic()
        pool.wait([pool.submit(s) for s in samples], timeout_s=60)
        # The timeout, then a quick one: under one more timeout's worth (a re-run would not be).
        assert time.monotonic() - start < 2 * 1.0 + 1.0
        assert [(s.raw_reward, s.correct) for s in [first] + samples] == [(1.0, True), (-0.5, False), (0.0, False)]
        assert samples[0].reward == -0.5                          # no shaping configured
        assert pool.status_counts == {"ok": 2, "timeout": 1}
        assert pool.step_metrics()["reward/timeouts"] == 1.0
    finally:
        pool.shutdown()
