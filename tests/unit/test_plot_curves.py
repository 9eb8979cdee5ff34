"""megatron_rl/tools/plot_curves.py (megatron-rl-plot-curves) renders a PNG from a synthetic metrics.jsonl (function and CLI)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_tool():
    from megatron_rl.tools import plot_curves

    return plot_curves


def _write_metrics(run_dir: Path, steps: int = 12) -> None:
    lines = []
    for step in range(steps):
        record = {
            "step": step,
            "time": 1000.0 + step,
            "reward/mean": step / steps,
            "reward/accuracy": step / (2 * steps),
            "response_length/mean": 50 + step,
            "response_length/p90": 80 + step,
            "response_length/max": 128,
            "time/rollout": 2.0,
            "time/reward": 0.5,
            "time/train": 1.0,
            "time/step": 3.7,
        }
        if step % 4 == 0:
            record["val/pass@1"] = 0.1 * step
        if step == steps - 1:
            record["time/weight_sync"] = None  # e.g. not run on the last step
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000  # four rendered panels, not an empty canvas


def test_plot_function_writes_png(tmp_path):
    tool = _load_tool()
    _write_metrics(tmp_path)
    out = tool.plot_curves(tmp_path)
    assert out == tmp_path / "curves.png"
    _assert_png(out)
    # The series the panels read are the logged ones.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert tool._series(records, "val/pass@1") == ([0, 4, 8], [0.0, 0.4, 0.8])
    assert tool._series(records, "time/weight_sync") == ([], [])


def test_plot_cli_out_option(tmp_path):
    _write_metrics(tmp_path, steps=3)
    out = tmp_path / "plots" / "run.png"
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    result = subprocess.run(
        # The console entry point, from a directory outside the checkout: found because installed.
        [str(Path(sys.executable).parent / "megatron-rl-plot-curves"), str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    _assert_png(out)


def test_plot_partial_metrics_and_empty_file(tmp_path):
    tool = _load_tool()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.1}\n{"step": 1, "reward/mean": 0.2}\n')
    _assert_png(tool.plot_curves(tmp_path, tmp_path / "p.png"))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics records"):
        tool.plot_curves(tmp_path)
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        tool.plot_curves(tmp_path / "missing")
