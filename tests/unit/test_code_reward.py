"""Code reward: code extraction, test formats (HumanEval, MBPP, KodCode, stdin/stdout), scoring,
and the problem set of tests/data (every correct solution scores 1, every wrong one and every
attack 0)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_rl.reward.graders.code_reward import CodeReward, InvalidTests, build_job, extract_code, parse_tests


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{code}```\nDone."


def test_extract_code_prefers_the_last_python_block() -> None:
    text = "```text\nnot code\n```\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\n\n```") is None


def test_parse_tests_formats() -> None:
    kod = parse_tests("from solution import f\ndef test_f():\n    assert f()", {"format": "kodcode"})
    assert kod.kind == "pytest"
    mbpp = parse_tests("", {"test_list": ["assert f(1) == 2", "assert f(2) == 3"], "test_setup_code": "import math"})
    assert (mbpp.kind, mbpp.code, mbpp.setup) == ("asserts", "assert f(1) == 2\nassert f(2) == 3", "import math")
    he = parse_tests("def check(candidate):\n    assert candidate(1) == 2\n", {"entry_point": "inc"})
    assert he.kind == "asserts" and he.suffix.strip() == "check(inc)"
    io = parse_tests("", {"input_output": '{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}'})
    assert io.kind == "stdio" and io.cases == [("1 2\n", "3\n")]
    assert parse_tests("assert f() == 1", {}).kind == "asserts"
    with pytest.raises(InvalidTests, match="no tests"):
        parse_tests("", {})
    with pytest.raises(InvalidTests, match="same length"):
        parse_tests("", {"inputs": ["1"], "outputs": []})
    with pytest.raises(InvalidTests, match="entry_point"):
        parse_tests("def check(c): pass", {"entry_point": "not an id"})


def test_humaneval_signature_is_prepended_only_when_missing() -> None:
    spec = parse_tests("def check(candidate):\n    assert candidate(1) == 2\n",
                       {"entry_point": "inc", "code_prompt": "def inc(x):\n"})
    body_only = build_job("    return x + 1\n", spec)
    assert body_only["solution"].startswith("def inc(x):\n    return x + 1")
    assert body_only["tests"].endswith("check(inc)\n") and body_only["entry_point"] == "inc"
    assert "check" not in body_only["solution"]  # the tests go to the judge process only
    full = build_job("def inc(x):\n    return x + 1\n", spec)["solution"]
    assert full.count("def inc(") == 1


@pytest.fixture(scope="module")
def reward() -> CodeReward:
    return CodeReward(timeout_s=5.0, timeout_reward=-0.5)


@pytest.mark.parametrize("metadata, answer, right, wrong", [
    ({"format": "kodcode"}, "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n",
     "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a * b\n"),
    ({"format": "mbpp", "test_list": ["assert sq(3) == 9", "assert sq(0) == 0"]}, "",
     "def sq(x):\n    return x * x\n", "def sq(x):\n    return x + x\n"),
    ({"format": "humaneval", "entry_point": "rev"}, "def check(candidate):\n    assert candidate('ab') == 'ba'\n",
     "def rev(s):\n    return s[::-1]\n", "def rev(s):\n    return s\n"),
    ({"format": "code", "inputs": ["3\n1 2 3\n", "1\n7\n"], "outputs": ["6\n", "7\n"]}, "",
     "n = int(input())\nprint(sum(map(int, input().split())))\n", "print(0)\n"),
])
def test_code_reward_scores_each_format(reward: CodeReward, metadata, answer, right, wrong) -> None:
    good = reward(fenced(right), answer, metadata)
    assert (good.reward, good.correct, good.status) == (1.0, True, "ok"), good.detail
    assert good.elapsed_s > 0
    bad = reward(fenced(wrong), answer, metadata)
    assert (bad.reward, bad.correct, bad.status) == (0.0, False, "ok")
    assert bad.detail


def test_code_reward_no_code_timeout_and_bad_tests(reward: CodeReward) -> None:
    none = reward("I think the answer is 5.", "assert True", {})
    assert (none.reward, none.status) == (0.0, "no_answer")
    slow = reward(fenced("while True:\n    pass\n"), "assert True", {}, timeout_s=1.0)
    assert (slow.reward, slow.status) == (-0.5, "timeout")
    broken = reward(fenced("x = 1\n"), "", {"inputs": "oops", "outputs": []})
    assert (broken.reward, broken.status) == (-0.5, "error")
    assert "bad tests" in broken.detail


DATA = Path(__file__).resolve().parents[1] / "data"
PROBLEMS = [json.loads(line) for line in (DATA / "code_sandbox_set.jsonl").read_text().splitlines() if line.strip()]
ATTACKS = [json.loads(line) for line in (DATA / "code_sandbox_attacks.jsonl").read_text().splitlines() if line.strip()]
BY_ID = {p["id"]: p for p in PROBLEMS}
STDLIB = ("typing", "dataclasses", "enum", "collections", "logging", "fractions", "decimal", "statistics",
          "itertools", "functools", "re", "heapq", "bisect", "math", "string", "json", "datetime")


def test_problem_set_covers_the_formats_and_the_standard_library() -> None:
    assert len(PROBLEMS) >= 40
    styles = {p["style"] for p in PROBLEMS}
    assert styles >= {"humaneval", "mbpp", "kodcode", "stdio"}
    used = set()
    for p in PROBLEMS:
        assert p["wrong"], p["id"]
        text = p["metadata"].get("code_prompt", "") + p["correct"]
        for module in p["modules"]:
            assert re.search(rf"^\s*(import|from) {module}\b", text, re.MULTILINE), (p["id"], module)
        used |= set(p["modules"])
    assert set(STDLIB) <= used, set(STDLIB) - used
    assert "namedtuple" in "".join(p["correct"] for p in PROBLEMS)
    assert any("from typing import" in p["metadata"].get("code_prompt", "") for p in PROBLEMS)


@pytest.fixture(scope="module")
def strict_reward() -> CodeReward:
    return CodeReward(timeout_s=10.0, timeout_reward=0.0)


@pytest.mark.parametrize("problem", PROBLEMS, ids=[p["id"] for p in PROBLEMS])
def test_correct_solutions_score_one_and_wrong_ones_zero(strict_reward: CodeReward, problem: dict) -> None:
    good = strict_reward(fenced(problem["correct"]), problem["ground_truth"], problem["metadata"])
    assert (good.reward, good.status) == (1.0, "ok"), good.detail
    for wrong in problem["wrong"]:
        bad = strict_reward(fenced(wrong), problem["ground_truth"], problem["metadata"])
        assert (bad.reward, bad.correct, bad.status) == (0.0, False, "ok"), bad.detail


@pytest.mark.parametrize("attack", ATTACKS, ids=[a["id"] for a in ATTACKS])
def test_attacks_score_zero(attack: dict) -> None:
    problem = BY_ID[attack["problem"]]
    reward = CodeReward(timeout_s=3.0, timeout_reward=0.0)
    result = reward(fenced(attack["code"]), problem["ground_truth"], problem["metadata"])
    assert (result.reward, result.correct) == (0.0, False), (attack["why"], result.status, result.detail)
    assert result.status in ("ok", "timeout"), result.detail
