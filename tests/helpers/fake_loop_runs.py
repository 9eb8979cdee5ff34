"""The column benchmarks (``rollpacker-benchmark --compare peers|speculative``) with their training
runs faked: ``build_and_run`` records each run's config and ``read_metrics`` hands back rows made
by the test, so the benchmark's arithmetic, report and files can be checked on known figures."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


def fake_loop_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, columns: list[str],
                   rows_of: Callable[[str, int, int], list[dict]]) -> tuple[list, Path]:
    """Patches the loop so that a run records its config and its metrics are
    ``rows_of(column, seed - 5, steps)`` (the column found by its run dir's name, ``+`` as ``_``).
    Returns (the configs, in run order; a model dir with an empty config.json)."""
    import megatron_rl.runtime.metrics_logger
    import megatron_rl.train

    configs = []
    by_dir: dict[str, tuple[str, int, int]] = {}

    def build_and_run(cfg):
        configs.append(cfg)
        column = next(n for n in columns if n.replace("+", "_") == cfg.trainer.run_dir.rsplit("/", 1)[1])
        by_dir[cfg.trainer.run_dir] = (column, cfg.trainer.seed - 5, cfg.trainer.steps)
        return []

    monkeypatch.setattr(megatron_rl.train, "build_and_run", build_and_run)
    monkeypatch.setattr(megatron_rl.runtime.metrics_logger, "read_metrics", lambda run_dir: rows_of(*by_dir[str(run_dir)]))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return configs, model
