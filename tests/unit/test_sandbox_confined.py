"""The sandbox's confined interpreters see only their own code and the standard library.

``megatron_rl/reward/sandbox/confined/`` is the one directory their bootstrap puts on
``sys.path``: it must hold only their modules, those must import only the standard library and
each other (they run with ``-I -S``: nothing else is there), and a program in the sandbox must
not reach ``megatron_rl`` or any installed package, even by putting the repository on its path.
"""
from __future__ import annotations

import ast
import os
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl.reward.sandbox import supervisor
from megatron_rl.reward.sandbox.job import SandboxLimits
from megatron_rl.reward.sandbox.sandbox import Sandbox
from tests.helpers.import_graph import describe_cycles

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFINED = supervisor.CONFINED_DIR
MODULES = {p.stem for p in CONFINED.glob("*.py")} - {"__init__"}


def top_level_imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (at module level or inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path.name}: relative import (the confined interpreters have no package)")
            names.add(node.module.split(".")[0])
    return names


def test_the_confined_directory_holds_only_the_confined_interpreters_code() -> None:
    assert CONFINED.is_dir() and {"sandbox_child", "sandbox_judge"} <= MODULES
    others = {p.name for p in CONFINED.iterdir()} - {f"{m}.py" for m in MODULES} - {"__init__.py", "__pycache__"}
    assert not others, f"{CONFINED} is on the confined interpreters' sys.path: nothing else may live there: {others}"
    assert not MODULES & sys.stdlib_module_names, "a confined module would shadow a standard-library one"
    code = supervisor._boot("sandbox_child")[1]
    assert code.count("sys.path") == 1 and repr(str(CONFINED)) in code, code


def test_confined_modules_import_only_the_standard_library_and_each_other() -> None:
    graph = {}
    for module in sorted(MODULES):
        imported = top_level_imports(CONFINED / f"{module}.py")
        foreign = sorted(imported - MODULES - sys.stdlib_module_names)
        assert not foreign, f"confined/{module}.py imports {foreign}: not importable in a confined interpreter"
        graph[module] = imported & MODULES
    assert not describe_cycles(graph)


def test_the_check_sees_a_project_import(tmp_path: Path) -> None:
    bad = tmp_path / "sandbox_bad.py"
    bad.write_text("import os\n\ndef main():\n    from megatron_rl.config.schema import RunConfig\n")
    assert top_level_imports(bad) - sys.stdlib_module_names == {"megatron_rl"}


PROBE = """
import importlib
import sys


def attempt(name, extra_path=None):
    if extra_path:
        sys.path.insert(0, extra_path)
    try:
        importlib.import_module(name)
        return "imported"
    except BaseException as exc:  # ImportError, or PermissionError from a confinement layer
        return type(exc).__name__
    finally:
        if extra_path:
            sys.path.remove(extra_path)


PLAIN = attempt("megatron_rl")
FROM_REPO = attempt("megatron_rl.config.schema", {repo!r})
THIRD_PARTY = [attempt(name) for name in ("numpy", "yaml", "torch")]
PATH = list(sys.path)
"""


@pytest.mark.parametrize("mode", [dict(isolation="auto"), dict(isolation="audit", kernel_filters=False)],
                         ids=["best_available", "audit_hook_only"])
def test_a_program_in_the_sandbox_cannot_import_megatron_rl(mode: dict) -> None:
    stdlib = os.path.realpath(sys.base_prefix)
    tests = f"""
        assert PLAIN == "ModuleNotFoundError", PLAIN
        assert FROM_REPO != "imported", FROM_REPO
        assert THIRD_PARTY == ["ModuleNotFoundError"] * 3, THIRD_PARTY
        assert PATH and all(p.startswith({stdlib!r} + "/") for p in PATH), PATH
    """
    job = {"kind": "asserts", "solution": PROBE.format(repo=str(REPO_ROOT)), "tests": textwrap.dedent(tests)}
    result = Sandbox(**mode).run(job, SandboxLimits(wall_s=20.0, cpu_s=10.0, memory_mb=512))
    assert result.status == "passed", result.detail
