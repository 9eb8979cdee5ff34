"""No import cycles anywhere in ``megatron_rl`` and ``rollpacker``, module by module.

import-linter's contracts (``.importlinter``) check the layers and, with ``acyclic_siblings``,
cycles between the children of each package; this test checks the module graph itself (grimp,
the graph import-linter builds), so a cycle through a package's ``__init__`` or between two
modules of one subpackage fails too. Imports inside functions count (a lazy import is how a cycle
usually hides); imports under ``TYPE_CHECKING`` do not (they never run).
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import grimp
import pytest

from tests.helpers.import_graph import describe_cycles, one_cycle, strongly_connected


def module_graph(*packages: str) -> dict[str, set[str]]:
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=True, cache_dir=None)
    return {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}


def test_megatron_rl_and_rollpacker_have_no_import_cycles() -> None:
    graph = module_graph("megatron_rl", "rollpacker")
    assert len(graph) > 100, "grimp found too few modules: is the repository on sys.path?"
    assert "megatron_rl.rollout.weight_sync.factory" in graph and "rollpacker.tail_batching" in graph
    cycles = describe_cycles(graph)
    assert not cycles, "import cycles (move the shared names into a module both import):\n" + "\n".join(cycles)


def test_a_fabricated_cycle_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check on a package made to hold cycles: a lazy import inside a function, and a
    package __init__ that imports its submodule back (what acyclic_siblings cannot see)."""
    pkg = tmp_path / "cyclic_pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from cyclic_pkg import b\n",
        "b.py": "def later():\n    from cyclic_pkg.c import C\n    return C\n",
        "c.py": "import cyclic_pkg.a\n\nC = 1\n",
        "leaf.py": "import typing\nif typing.TYPE_CHECKING:\n    from cyclic_pkg import a\n",
        "sub/__init__.py": "from cyclic_pkg.sub.inner import X\n",
        "sub/inner.py": "from cyclic_pkg.sub import helper\nX = 1\n",
        "sub/helper.py": "import cyclic_pkg.sub\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = module_graph("cyclic_pkg")
    groups = sorted(sorted(g) for g in strongly_connected(graph))
    assert groups == [["cyclic_pkg.a", "cyclic_pkg.b", "cyclic_pkg.c"],
                      ["cyclic_pkg.sub", "cyclic_pkg.sub.helper", "cyclic_pkg.sub.inner"]]
    assert describe_cycles(graph) == ["cyclic_pkg.a -> cyclic_pkg.b -> cyclic_pkg.c -> cyclic_pkg.a",
                                      "cyclic_pkg.sub -> cyclic_pkg.sub.inner -> cyclic_pkg.sub.helper -> cyclic_pkg.sub"]


def test_cycle_search_on_hand_made_graphs() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert strongly_connected({"a": {"a"}}) == [{"a"}]
    graph = {"a": {"b", "d"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}}
    assert sorted(sorted(g) for g in strongly_connected(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert one_cycle(graph, {"a", "b", "c"}) == ["a", "b", "c", "a"]
    # A long chain that closes at the end: no recursion limit.
    chain = {f"m{i}": {f"m{i + 1}"} for i in range(5000)}
    chain["m5000"] = {"m0"}
    assert [len(g) for g in strongly_connected(chain)] == [5001]
