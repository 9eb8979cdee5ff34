"""The test tree's layout (docs/tests.md): no test module imports another test module; what tests
share lives in ``tests/helpers/`` (modules) or a ``conftest.py`` (fixtures); ``unit/`` and
``integration/`` hold test modules and their conftest only; every test module under
``integration/`` is marked ``integration``, and the fast tier's ``slow`` marker is declared."""
from __future__ import annotations

import ast
import configparser
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
