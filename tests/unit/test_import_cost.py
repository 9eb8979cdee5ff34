"""The collector pause around big imports (megatron_rl.runtime.import_cost) and its benchmark's table."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

from megatron_rl.benchmarks import benchmark_imports
from megatron_rl.runtime.import_cost import collector_paused, preimport


@pytest.fixture
def probe_module(tmp_path, monkeypatch):
    """A module that records, when imported, whether the collector was enabled."""
    name = "import_cost_probe_mod"
    (tmp_path / f"{name}.py").write_text("import gc\nENABLED_AT_IMPORT = gc.isenabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_preimport_imports_with_the_collector_paused_and_restores_it(probe_module):
    assert gc.isenabled()
    preimport(probe_module)
    assert sys.modules[probe_module].ENABLED_AT_IMPORT is False
    assert gc.isenabled()


def test_without_pause_the_import_sees_the_collector_on(probe_module):
    preimport(probe_module, pause=False)
    assert sys.modules[probe_module].ENABLED_AT_IMPORT is True


def test_the_collector_is_restored_after_a_failing_import_and_a_disabled_one_stays_disabled():
    with pytest.raises(ModuleNotFoundError):
        preimport("no_such_module_for_import_cost")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # whoever disabled it keeps it disabled
    finally:
        gc.enable()


def test_benchmark_table_gives_median_range_and_ratio():
    figures = {"engine": {"collector on": [10.0, 12.0, 11.0], "paused": [8.0, 9.5, 8.5]},
               "reward": {"transformers": [4.0, 4.0, 5.0], "tokenizers": [0.1, 0.2, 0.05]}}
    text = benchmark_imports.table(figures)
    assert "| engine | collector on | 11.00 (10.00-12.00) | paused | 8.50 (8.00-9.50) | 0.77 |" in text
    assert "| reward | transformers | 4.00 (4.00-5.00) | tokenizers | 0.10 (0.05-0.20) | 0.03 |" in text


def test_benchmark_rejects_no_repeats_and_unknown_kinds(capsys):
    with pytest.raises(SystemExit):
        benchmark_imports.main(["--repeats", "0"])
    assert "--repeats must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmark_imports.main(["--kinds", "engine,driver"])
    assert "unknown ['driver']" in capsys.readouterr().err


def test_the_reward_kind_measures_both_decoders_in_fresh_interpreters():
    figures = benchmark_imports.run(1, ("reward",))
    assert list(figures) == ["reward"]
    assert all(len(xs) == 1 and xs[0] > 0 for xs in figures["reward"].values()), figures
    assert set(figures["reward"]) == {"transformers", "tokenizers"}


def test_the_bytecode_kind_measures_sources_and_compiled_then_leaves_the_project_compiled():
    from importlib.util import cache_from_source

    figures = benchmark_imports.run(1, ("bytecode",))
    assert set(figures["bytecode"]) == {"sources", "compiled"}
    assert all(len(xs) == 1 and xs[0] > 0 for xs in figures["bytecode"].values()), figures
    train = benchmark_imports.PROJECT_DIRS[0] / "train.py"
    assert train.is_file() and Path(cache_from_source(str(train))).is_file(), "the project was left uncompiled"
