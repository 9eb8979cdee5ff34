"""The built-in verifiable task: multi-step addition solved as a running sum.

Question: ``Add the numbers: 7 + 3 + 9 + 4``
Solution: ``7+3=10\\n10+9=19\\n19+4=23\\n#### 23``

Why this task: it needs no download, a byte-level tiny model can learn it in minutes, the answer
is checkable by the math reward ('#### N'), and the number of steps follows a power law, so
response lengths have the long tail (most answers 2-4 lines, a few up to 40) that tail batching
is about. Each step line depends on the previous one, so errors compound with length: a
partly trained model solves short problems more often than long ones, which gives GRPO reward
variance inside most groups.

Problems are a pure function of (seed, split, index). The train and test splits are disjoint by
construction: a problem belongs to the test split iff a stable hash of its terms falls in the
test bucket, and each split redraws candidates that fall in the other split's bucket.
"""
from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

MIN_STEPS = 2
"""Fewest additions per problem (a problem has steps + 1 terms)."""
MAX_STEPS = 40
"""Most additions per problem (the end of the tail)."""
TAIL_EXPONENT = 1.6
"""Power-law exponent a of P(steps >= s) = (MIN_STEPS / s) ** a: median ~3 steps, ~1.6% >= 25."""
MIN_TERM, MAX_TERM = 1, 9
"""Range of each term (single digits keep per-step arithmetic learnable by a tiny model)."""
TEST_BUCKETS = 8
"""One hash bucket in TEST_BUCKETS belongs to the test split."""

SPLITS = ("train", "test")
QUESTION_PREFIX = "Add the numbers: "
ANSWER_MARKER = "####"

_ANSWER_RE = re.compile(r"####\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One problem of the built-in task."""

    split: str
    """'train' or 'test'."""
    index: int
    """Position in its split (with the seed, fully determines the problem)."""
    terms: tuple[int, ...]
    """The numbers to add, in order (len(terms) = steps + 1)."""

    @property
    def num_steps(self) -> int:
        """Number of additions (lines before the '####' line)."""
        return len(self.terms) - 1

    @property
    def question(self) -> str:
        """The user-facing question text."""
        return QUESTION_PREFIX + " + ".join(str(t) for t in self.terms)

    @property
    def answer(self) -> str:
        """The ground-truth final answer (the sum) as text."""
        return str(sum(self.terms))

    @property
    def solution(self) -> str:
        """Reference step-by-step solution (the SFT target), ending in '#### <sum>'."""
        lines = []
        total = self.terms[0]
        for term in self.terms[1:]:
            lines.append(f"{total}+{term}={total + term}")
            total += term
        lines.append(f"{ANSWER_MARKER} {total}")
        return "\n".join(lines)


RECHECK_LINE = "check:"
"""Opens each extra pass over the running sum in :func:`verbose_solution`."""


def verbose_solution(problem: ArithmeticProblem, passes: int) -> str:
    """``problem.solution`` with ``passes`` more passes over the running sum before the answer
    line, each opened by 'check:'. ``megatron-rl-make-tiny-model --recheck-rate`` teaches this style
    on a random minority of examples, so that a sampled response sometimes runs long whatever the
    problem, as reasoning models' re-verification does: the stochastic part of the long tail (the
    power-law step count is the part that comes with the prompt)."""
    if passes < 0:
        raise ValueError(f"passes must be >= 0, got {passes}")
    *steps, answer = problem.solution.split("\n")
    return "\n".join(steps + ([RECHECK_LINE] + steps) * passes + [answer])


def sample_recheck_passes(rng: random.Random, rate: float, continue_prob: float, max_passes: int) -> int:
    """0 with probability 1 - ``rate``; else 1 + a geometric number of further passes (each with
    probability ``continue_prob``), at most ``max_passes``."""
    if max_passes <= 0 or rng.random() >= rate:
        return 0
    passes = 1
    while passes < max_passes and rng.random() < continue_prob:
        passes += 1
    return passes


def _is_test_problem(terms: tuple[int, ...]) -> bool:
    # crc32 is stable across processes and Python versions (unlike hash()).
    return zlib.crc32(",".join(map(str, terms)).encode()) % TEST_BUCKETS == 0


def sample_num_steps(rng: random.Random) -> int:
    """Draw a step count from the truncated power law P(steps >= s) = (MIN_STEPS / s) ** a."""
    u = 1.0 - rng.random()  # in (0, 1], so the power below is finite
    return min(MAX_STEPS, int(MIN_STEPS * u ** (-1.0 / TAIL_EXPONENT)))


def make_problem(index: int, seed: int = 0, split: str = "train") -> ArithmeticProblem:
    """The problem at ``index`` of ``split`` for ``seed`` (deterministic, any index >= 0)."""
    if split not in SPLITS:
        raise ValueError(f"unknown arithmetic split {split!r}; expected one of {SPLITS}")
    if index < 0:
        raise ValueError(f"problem index must be >= 0, got {index}")
    # Seeding with a string hashes it with SHA-512: stable and independent per (seed, split, index).
    rng = random.Random(f"arithmetic:{seed}:{split}:{index}")
    want_test = split == "test"
    while True:
        num_steps = sample_num_steps(rng)
        terms = tuple(rng.randint(MIN_TERM, MAX_TERM) for _ in range(num_steps + 1))
        if _is_test_problem(terms) == want_test:
            return ArithmeticProblem(split=split, index=index, terms=terms)


def make_problems(count: int, seed: int = 0, split: str = "train", start: int = 0) -> list[ArithmeticProblem]:
    """Problems ``start .. start + count - 1`` of ``split``."""
    return [make_problem(i, seed=seed, split=split) for i in range(start, start + count)]


def extract_answer(response_text: str) -> str | None:
    """The integer after the last '####' if the response ends with it, else None."""
    match = _ANSWER_RE.search(response_text.strip())
    return match.group(1) if match else None


def score(response_text: str, answer: str) -> bool:
    """True iff the response ends with '#### <answer>' (exact integer match).

    A strict checker for tests and the SFT tool; the production reward uses math-verify.
    """
    got = extract_answer(response_text)
    return got is not None and int(got) == int(answer)
