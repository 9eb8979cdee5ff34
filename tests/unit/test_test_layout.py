"""The test tree's layout (docs/tests.md): no test module imports another test module; what tests
share lives in ``tests/helpers/`` (modules) or a ``conftest.py`` (fixtures); ``unit/`` and
``integration/`` hold test modules and their conftest only; every test module under
``integration/`` is marked ``integration``, the fast tier's ``slow`` marker is declared, and every
integration test but the fast tier's smoke run carries it."""
from __future__ import annotations

import ast
import configparser
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, top level or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend([(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names])
    return found


def _is_test_module(name: str, test_files: set[str]) -> bool:
    """A dotted name that is a test module: ``tests.<dir>.test_x`` or a bare ``test_x`` / ``_x``
    that pytest's rootdir import would resolve to a file beside the importer."""
    parts = name.split(".")
    if parts[0] == "tests":
        return any(p.startswith("test_") for p in parts[1:])
    return parts[0] in test_files


def test_no_test_module_imports_another_test_module():
    test_files = {p.stem for p in TESTS.rglob("*.py") if p.stem.startswith(("test_", "_")) and p.stem != "__init__"}
    offenders = []
    for path in TESTS.rglob("*.py"):
        for line, module in _imported_modules(path):
            if _is_test_module(module, test_files):
                offenders.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not offenders, "move what they share to tests/helpers/ or a conftest.py:\n" + "\n".join(offenders)


def test_the_checker_sees_both_kinds_of_test_module_import(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("import tests.integration.test_train_loop as loop\nfrom _megatron_cases import run_spmd\n"
                      "from tests.helpers.train_runs import read_jsonl\n")
    flagged = [m for _, m in _imported_modules(sample) if _is_test_module(m, {"_megatron_cases", "test_train_loop"})]
    assert flagged == ["tests.integration.test_train_loop", "_megatron_cases", "_megatron_cases.run_spmd"]


def test_unit_and_integration_hold_only_test_modules_and_their_conftest():
    for folder in (TESTS / "unit", TESTS / "integration"):
        strays = sorted(p.name for p in folder.glob("*.py") if not p.name.startswith("test_") and p.name != "conftest.py")
        assert not strays, f"{folder.relative_to(REPO)}: helpers belong in tests/helpers/: {strays}"


def test_integration_modules_are_marked_and_the_slow_marker_is_declared():
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini")
    declared = {line.split(":")[0].strip() for line in ini["pytest"]["markers"].strip().splitlines()}
    assert {"integration", "slow", "gpu"} <= declared, declared
    unmarked = [p.name for p in sorted((TESTS / "integration").glob("test_*.py"))
                if "pytest.mark.integration" not in p.read_text()]
    assert not unmarked, f"integration test modules without the integration marker: {unmarked}"


SMOKE = {"test_train_loop.py::test_loop_runs_on_policy_with_engine_parity"}
"""The integration tests of the fast tier (``-m "not slow"``): one real-stack run of the loop."""


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The ``pytest.mark.<name>`` names in decorators or a ``pytestmark`` value."""
    return {node.attr for expr in decorators for node in ast.walk(expr)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"}


def _integration_tests_and_slowness(path: Path) -> dict[str, tuple[bool, bool]]:
    """``file::test`` -> (marked integration, marked slow), module marks included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module |= _marks([node.value])
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
            marks = module | _marks(node.decorator_list)
            found[f"{path.name}::{node.name}"] = ("integration" in marks, "slow" in marks)
    return found


def test_every_integration_test_but_the_smoke_run_is_slow():
    tests = {}
    for path in sorted((TESTS / "integration").glob("test_*.py")):
        tests.update(_integration_tests_and_slowness(path))
    fast = {name for name, (integration, slow) in tests.items() if integration and not slow}
    assert fast == SMOKE, f"integration tests outside the slow tier: {sorted(fast - SMOKE)}; smoke run missing: {sorted(SMOKE - fast)}"


def test_the_mark_reader_sees_module_and_function_marks(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("import pytest\npytestmark = [pytest.mark.integration, pytest.mark.timeout(9)]\n\n"
                      "@pytest.mark.slow\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n")
    assert _integration_tests_and_slowness(sample) == {"test_sample.py::test_a": (True, True),
                                                       "test_sample.py::test_b": (True, False)}


def test_test_module_basenames_are_unique():
    """pytest imports test modules by basename (rootdir import, no packages): two files of one
    name in different folders stop collection of the whole suite ("import file mismatch")."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.stem in seen:
            clashes.append(f"{seen[path.stem].relative_to(REPO)} and {path.relative_to(REPO)}")
        seen.setdefault(path.stem, path)
    assert clashes == [], f"test modules sharing a basename: {clashes}"


JOB_STARTS = ("run_train(", '"megatron_rl.train"', "sbatch", "tests.helpers.fault_runs")
"""What a module that runs whole training jobs as subprocesses calls."""


def test_modules_that_run_whole_jobs_are_marked_loop_and_resume_tests_tag_their_runs():
    """tests/run.sh runs the suite on two xdist workers. A job's start-up and teardown sweep dead
    runs' /dev/shm dirs of their host tag, and a resume test checks that its own start-up swept
    the run it killed: a module that checks what a start-up removed gives its attempts a host tag
    of their own (train_runs.run_train's ``host_tag``). Jobs start through run_train, and their
    modules carry the ``loop`` marker."""
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini")
    assert "loop" in {line.split(":")[0].strip() for line in ini["pytest"]["markers"].strip().splitlines()}
    starts_jobs = {p.name: p.read_text() for p in (TESTS / "integration").glob("test_*.py")
                   if any(call in p.read_text() for call in JOB_STARTS)}
    assert {"test_train_loop.py", "test_slurm_cluster.py"} <= set(starts_jobs)  # the detector sees both kinds
    unmarked = sorted(name for name, text in starts_jobs.items() if "pytest.mark.loop" not in text)
    assert not unmarked, f"modules that start training jobs without the loop marker: {unmarked}"
    direct = sorted(name for name, text in starts_jobs.items() if '"megatron_rl.train"' in text)
    assert not direct, f"modules that start jobs outside train_runs.run_train: {direct}"
    checks_sweeps = {name: text for name, text in starts_jobs.items() if re.search(r"removed [/{]", text)}
    assert {"test_train_loop.py", "test_faults.py"} <= set(checks_sweeps)  # the detector sees both
    untagged = sorted(name for name, text in checks_sweeps.items()
                      if "host_tag=" not in text and "Chain(" not in text)
    assert not untagged, f"modules that check a start-up's sweep with untagged runs: {untagged}"
    # The helpers that start jobs for a test module go through run_train too.
    helpers = {p.name: p.read_text() for p in (TESTS / "helpers").glob("*.py")}
    direct = sorted(n for n, text in helpers.items() if '"megatron_rl.train"' in text and n != "train_runs.py")
    assert not direct, f"helpers that start training jobs outside train_runs.run_train: {direct}"
    assert "run_train(" in helpers["fault_runs.py"]
    assert "host_tag=self.host_tag" in helpers["fault_runs.py"], "the chain's attempts must carry its host tag"


def test_the_whole_suite_is_one_session_on_the_workers():
    """tests/run.sh runs the whole suite as one pytest session on its workers, with no marker that
    leaves tests out; a wall-clock accuracy check is a benchmark (``rollpacker-pricing-check``), not a
    test that would need the machine to itself."""
    text = (REPO / "tests" / "run.sh").read_text()
    assert re.search(r'^pytest_run "\$RUN_TMP/pt" "\$\{workers\[@\]\}" tests \|\| rc=\$\?$', text, re.M), text
    assert not re.search(r"pytest_run .*-m [\"']", text), "a marker expression leaves tests out of the suite"
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini")
    assert "alone" not in ini["pytest"]["markers"]
