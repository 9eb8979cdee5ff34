"""Code reward: 1.0 when the response's program passes every test in the sandbox.

The solution is the last fenced code block of the response (```python, ```py or a bare ```);
a response without one scores 0 with status 'no_answer'. Supported test formats, picked from
the prompt's metadata (datasets put them there; ``Prompt.answer`` is the fallback test text).
The solution runs in its own process as module ``solution``; the tests run in the sandbox's
judge process and reach it through plain-data calls (see :mod:`megatron_rl.reward.sandbox.sandbox`):

===========  ==========================================  =====================================
style        metadata                                    how it runs
===========  ==========================================  =====================================
KodCode      format 'kodcode', ``tests`` (pytest file     the test file imports ``solution``;
             with ``from solution import ...``)           every ``test_*`` function called
HumanEval    ``entry_point`` + tests defining             the tests, then ``check(entry)``;
             ``check(candidate)``; optional               names they do not define come from
             ``code_prompt`` (the signature) prepended    the solution's module
             when the solution does not define it
MBPP         ``test_list`` (assert strings), optional     the asserts (after the setup code,
             ``test_setup_code``                          which also runs before the solution)
stdin/out    ``inputs`` + ``outputs`` lists, or           program run per case; stdout compared
             ``input_output`` (JSON or dict with them)    token by token (whitespace-insensitive)
asserts      anything else: the test text                 the test text (``def test_*``
                                                          functions: run pytest-style)
===========  ==========================================  =====================================
"""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field

from megatron_rl.reward.graders.result import RewardResult
from megatron_rl.reward.sandbox.job import SandboxLimits, SandboxResult
from megatron_rl.reward.sandbox.sandbox import Sandbox

_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_PY_TAGS = {"python", "py", "python3", "py3"}
CODE_FORMATS = ("kodcode", "humaneval", "mbpp", "code", "apps", "codecontests", "taco", "livecodebench")
"""Values of ``Prompt.metadata['format']`` that ``reward.kind='mixed'`` sends to the code reward."""


class InvalidTests(ValueError):
    """A prompt's tests cannot be understood; the message names the field."""


@dataclass
class CodeTests:
    """Tests of one problem, normalised."""

    kind: str
    """'asserts', 'pytest' or 'stdio' (the sandbox job kinds)."""
    code: str = ""
    """Test code (asserts / pytest module); empty for stdio."""
    setup: str = ""
    """Code placed before the solution (MBPP ``test_setup_code``)."""
    suffix: str = ""
    """Code placed after the tests (HumanEval's ``check(entry_point)``)."""
    prefix_if_missing: str = ""
    """Prepended when the solution lacks ``def <entry_point>`` (HumanEval signature)."""
    entry_point: str = ""
    """Function the tests call (HumanEval)."""
    cases: list[tuple[str, str]] = field(default_factory=list)
    """(stdin, expected stdout) pairs for 'stdio'."""


def extract_code(response: str) -> str | None:
    """The last Python-tagged fenced block of ``response``, else its last untagged block."""
    blocks = _FENCE_RE.findall(response)
    tagged = [body for tag, body in blocks if tag.lower() in _PY_TAGS]
    untagged = [body for tag, body in blocks if not tag]
    chosen = tagged or untagged
    if not chosen or not chosen[-1].strip():
        return None
    return chosen[-1].strip("\n") + "\n"


def _stdio_cases(metadata: dict) -> list[tuple[str, str]] | None:
    spec = metadata.get("input_output")
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidTests(f"metadata 'input_output' is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        spec = metadata
    inputs, outputs = spec.get("inputs"), spec.get("outputs")
    if inputs is None and outputs is None:
        return None
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise InvalidTests("stdin/stdout tests need non-empty 'inputs' and 'outputs' lists of the same length")
    return [(_as_text(i), _as_text(o)) for i, o in zip(inputs, outputs)]


def _as_text(value) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def parse_tests(answer: str, metadata: dict | None) -> CodeTests:
    """Normalise a prompt's tests (see the module table); InvalidTests when there are none."""
    metadata = metadata or {}
    cases = _stdio_cases(metadata)
    if cases is not None:
        return CodeTests("stdio", cases=cases)
    tests = metadata.get("tests") or metadata.get("test") or answer or ""
    if not isinstance(tests, str):
        raise InvalidTests(f"metadata 'tests' must be test code text, got {type(tests).__name__}")
    if metadata.get("format") == "kodcode" or "from solution import" in tests:
        return CodeTests("pytest", code=tests)
    test_list = metadata.get("test_list")
    if test_list:
        if not isinstance(test_list, list) or not all(isinstance(t, str) for t in test_list):
            raise InvalidTests("metadata 'test_list' must be a list of assert strings")
        return CodeTests("asserts", code="\n".join(test_list), setup=str(metadata.get("test_setup_code") or ""))
    entry = metadata.get("entry_point")
    if entry:
        if not str(entry).isidentifier():
            raise InvalidTests(f"metadata 'entry_point' {entry!r} is not a Python identifier")
        suffix = f"\ncheck({entry})\n" if re.search(r"def\s+check\s*\(", tests) else ""
        return CodeTests("asserts", code=tests, suffix=suffix, entry_point=str(entry),
                         prefix_if_missing=str(metadata.get("code_prompt") or ""))
    if not tests.strip():
        raise InvalidTests("the prompt has no tests (metadata 'tests'/'test_list'/'inputs'+'outputs' "
                            "or a non-empty answer)")
    if re.search(r"^def\s+test_\w*\s*\(", tests, re.MULTILINE):
        return CodeTests("pytest", code=tests)
    return CodeTests("asserts", code=tests)


def build_job(solution: str, tests: CodeTests) -> dict:
    """The sandbox job that runs ``solution`` against ``tests`` (the solution and the tests go
    to different processes: see :mod:`megatron_rl.reward.sandbox.sandbox`)."""
    if tests.kind == "stdio":
        return {"kind": "stdio", "solution": solution, "cases": [list(c) for c in tests.cases]}
    if tests.kind == "pytest":
        return {"kind": "pytest", "solution": solution, "tests": tests.code}
    body = solution
    if tests.entry_point and tests.prefix_if_missing and not re.search(
            rf"def\s+{re.escape(tests.entry_point)}\s*\(", solution):
        body = tests.prefix_if_missing + solution
    return {"kind": "asserts", "solution": body, "setup": tests.setup,
            "tests": "\n".join(part for part in (tests.code, tests.suffix) if part),
            "entry_point": tests.entry_point}


class CodeReward:
    """Scores responses by running their code against the prompt's tests in a :class:`Sandbox`."""

    def __init__(self, timeout_s: float = 30.0, timeout_reward: float = 0.0, memory_mb: int = 1024,
                 isolation: str = "auto", disk_mb: int = 64) -> None:
        """``timeout_s`` is the default per-response limit (the pool passes adaptive ones);
        ``memory_mb`` and ``disk_mb`` are ``reward.sandbox_memory_mb`` / ``sandbox_disk_mb``."""
        if timeout_s <= 0:
            raise ValueError(f"code reward timeout_s={timeout_s} must be > 0")
        self.timeout_s = timeout_s
        self.timeout_reward = timeout_reward
        self.memory_mb = memory_mb
        self.disk_mb = disk_mb
        self._sandbox = Sandbox(isolation=isolation)

    @property
    def isolation(self) -> list[str]:
        """Isolation layers active for every run."""
        return self._sandbox.layers

    def __call__(self, response: str, ground_truth: str, metadata: dict | None = None,
                 timeout_s: float | None = None, cancel: threading.Event | None = None) -> RewardResult:
        """Score one response; never raises. Setting ``cancel`` (from another thread) kills the
        sandbox run early: the result then has status 'cancelled' and must not be used."""
        start = time.monotonic()
        code = extract_code(response)
        if code is None:
            return RewardResult(0.0, False, "", "no_answer", "no fenced code block", time.monotonic() - start)
        try:
            tests = parse_tests(ground_truth, metadata)
        except InvalidTests as exc:
            return RewardResult(self.timeout_reward, False, code, "error", f"bad tests: {exc}",
                                time.monotonic() - start)
        limit = timeout_s or self.timeout_s
        run = self._sandbox.run(build_job(code, tests),
                                SandboxLimits(wall_s=limit, cpu_s=limit, memory_mb=self.memory_mb,
                                              disk_mb=self.disk_mb), cancel)
        return self._result(run, code)

    def _result(self, run: SandboxResult, code: str) -> RewardResult:
        detail = run.detail if not run.passed else ""
        if run.status == "timeout":
            return RewardResult(self.timeout_reward, False, code, "timeout", detail, run.elapsed_s)
        if run.status == "error":
            return RewardResult(self.timeout_reward, False, code, "error", detail, run.elapsed_s)
        if run.status == "cancelled":
            return RewardResult(0.0, False, code, "cancelled", detail, run.elapsed_s)
        # 'passed', 'failed', 'output_limit': a graded answer (the output limit is the program's fault).
        return RewardResult(1.0 if run.passed else 0.0, run.passed, code, "ok", detail, run.elapsed_s)
