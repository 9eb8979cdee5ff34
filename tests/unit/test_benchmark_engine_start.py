"""megatron_rl.benchmarks.benchmark_engine_start: its table and its argument checks (the
benchmark itself runs real engines: docs/tests.md gives its figures and command)."""
from __future__ import annotations

import pytest

from megatron_rl.benchmarks import benchmark_engine_start as bench


def _runs(*cpu_s):
    return [{"cpu_s": c, "start_s": c / 2, "forked": [True]} for c in cpu_s]


def test_table_gives_median_range_and_the_ratio_of_medians():
    figures = {"tp1": {"spawn": _runs(20.0, 30.0, 24.0), "fork": _runs(12.0, 10.0, 11.0)},
               "tp2": {"spawn": _runs(50.0), "fork": _runs(20.0)}}
    lines = bench.table(figures).splitlines()
    assert lines[2] == "| TP 1 | 24.00 (20.00-30.00) | 11.00 (10.00-12.00) | 0.46 | 12.00 (10.00-15.00) | 5.50 (5.00-6.00) |"
    assert lines[3].startswith("| TP 2 | 50.00 (50.00-50.00) | 20.00 (20.00-20.00) | 0.40 |")


@pytest.mark.parametrize("argv, message", [(["--repeats", "0"], "--repeats"), (["--tp", "1,x"], "--tp"),
                                           (["--tp", "0"], "--tp")])
def test_bad_arguments_are_refused_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
