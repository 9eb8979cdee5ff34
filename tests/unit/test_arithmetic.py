"""The built-in arithmetic task: determinism, disjoint splits, long tail, checker."""
from __future__ import annotations

import random
import statistics

import pytest

from megatron_rl.data import arithmetic
from megatron_rl.data.arithmetic import ArithmeticProblem, make_problem, make_problems, score


def test_solution_format_hand_checked():
    problem = ArithmeticProblem(split="train", index=0, terms=(7, 3, 9, 4))
    assert problem.question == "Add the numbers: 7 + 3 + 9 + 4"
    assert problem.solution == "7+3=10\n10+9=19\n19+4=23\n#### 23"
    assert problem.answer == "23"
    assert problem.num_steps == 3


def test_deterministic_for_seed_and_index():
    assert make_problem(17, seed=5) == make_problem(17, seed=5)
    assert make_problems(50, seed=5) == make_problems(50, seed=5)
    # A different seed (or split) gives a different problem set.
    assert make_problems(50, seed=5) != make_problems(50, seed=6)
    assert [p.terms for p in make_problems(50, split="test")] != [p.terms for p in make_problems(50)]
    # start= addresses the same problems as generating from zero.
    assert make_problems(5, start=10) == make_problems(15)[10:]


def test_splits_are_disjoint():
    train = {p.terms for p in make_problems(3000)}
    test = {p.terms for p in make_problems(1000, split="test")}
    assert len(test) > 100  # short problems repeat within a split, but plenty are distinct
    assert train.isdisjoint(test)


def test_terms_and_steps_within_bounds():
    for p in make_problems(2000):
        assert arithmetic.MIN_STEPS <= p.num_steps <= arithmetic.MAX_STEPS
        assert all(arithmetic.MIN_TERM <= t <= arithmetic.MAX_TERM for t in p.terms)


def test_step_count_follows_power_law():
    rng = random.Random(0)
    steps = [arithmetic.sample_num_steps(rng) for _ in range(20000)]
    # P(steps >= s) = (2 / s) ** 1.6: 0.523 at s=3, 0.109 at s=8, 0.0109 at s=35.
    for s, expected in [(3, 0.523), (8, 0.109), (35, 0.0109)]:
        frac = sum(x >= s for x in steps) / len(steps)
        assert abs(frac - expected) < 0.15 * expected + 0.002, (s, frac, expected)
    assert max(steps) == arithmetic.MAX_STEPS


def test_response_lengths_are_long_tailed():
    # Byte-level tokenizer: one character is one token (+1 for <|im_end|>).
    lengths = [len(p.solution) + 1 for p in make_problems(4096)]
    median = statistics.median(lengths)
    assert 20 <= median <= 40
    assert max(lengths) / median >= 10


def test_score_accepts_only_the_right_final_answer():
    assert score("7+3=10\n10+9=19\n19+4=23\n#### 23", "23")
    assert score("#### 23\n", "23")
    assert score("####23", "23")
    assert not score("7+3=10\n#### 22", "23")
    assert not score("the answer is 23", "23")  # no '####'
    assert not score("#### 23 and more", "23")  # answer must end the response
    assert not score("#### 2", "23")
    assert not score("#### 233", "23")
    # The last '####' counts.
    assert score("#### 5\n#### 23", "23")
    assert not score("#### 23\n#### 5", "23")


def test_reference_solutions_score_correct():
    for p in make_problems(200):
        assert score(p.solution, p.answer)
        assert int(p.answer) == sum(p.terms)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="split"):
        make_problem(0, split="validation")
    with pytest.raises(ValueError, match="index"):
        make_problem(-1)


def test_verbose_solution_repeats_the_running_sum_before_the_answer():
    problem = arithmetic.ArithmeticProblem(split="train", index=0, terms=(7, 3, 9))
    assert arithmetic.verbose_solution(problem, 0) == problem.solution
    assert arithmetic.verbose_solution(problem, 2) == (
        "7+3=10\n10+9=19\ncheck:\n7+3=10\n10+9=19\ncheck:\n7+3=10\n10+9=19\n#### 19")
    with pytest.raises(ValueError, match="passes"):
        arithmetic.verbose_solution(problem, -1)


def test_recheck_passes_follow_rate_and_geometric_continuation():
    import random

    rng = random.Random(0)
    draws = [arithmetic.sample_recheck_passes(rng, 0.2, 0.5, 50) for _ in range(20000)]
    entered = [d for d in draws if d > 0]
    assert abs(len(entered) / len(draws) - 0.2) < 0.015
    assert abs(sum(entered) / len(entered) - 2.0) < 0.1  # 1 + Geometric(0.5): mean 2
    assert max(arithmetic.sample_recheck_passes(rng, 1.0, 0.99, 3) for _ in range(200)) == 3
    assert arithmetic.sample_recheck_passes(rng, 1.0, 0.9, 0) == 0
