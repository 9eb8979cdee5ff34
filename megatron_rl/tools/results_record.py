"""Writes a benchmark's results file (docs/results/NAME.json): provenance and the raw per-run figures.

A benchmark with ``--record PATH`` calls :func:`write_record` once its runs are done; then
``python -m megatron_rl.tools.results_tables`` renders the file into its table in the docs. A
re-run changes the file and the generated table, never prose.

What the file holds: the command line, the UTC date, the commit (``git describe``: a ``-dirty``
suffix when the work tree had changes), the machine, the model (:func:`megatron_rl.model.
fingerprint.model_record`: its weights' sha256), the columns, the rows (title, figure key,
format) and ``runs``: ``{run label: {column: figures}}``. The presentation a maintainer set in an
existing file (title, views, label header, layout, and rows that all name a figure key) is kept.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEPT = ("title", "views", "label_header", "layout", "notes")
"""Keys of an existing results file that a new recording keeps (presentation, not measurement)."""


def commit(repo: Path = REPO) -> str | None:
    """The checkout's commit (short, ``-dirty`` with uncommitted changes); None outside a git checkout."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=repo,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def hardware() -> str:
    """The CPU model, cores and memory (and the GPUs torch sees, when it is already imported)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{os.cpu_count()} cores ({cpu})"
    try:
        kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
        text += f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    torch = __import__("sys").modules.get("torch")  # never import torch just to describe the machine
    if torch is not None and torch.cuda.is_available():
        text += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return text


def rows_spec(rows: list[tuple]) -> list[dict]:
    """(title, key, format) tuples (a tuple key reads nested figures) as a results file's rows."""
    return [{"title": title, "key": list(key) if isinstance(key, tuple) else key, "format": fmt} for title, key, fmt in rows]


def build_record(name: str, command: str, columns: list, rows: list[dict], runs: dict,
                 model_dir: str | Path | None = None, extra: dict | None = None, existing: dict | None = None) -> dict:
    """The results file's content (see the module docstring)."""
    from megatron_rl.model.fingerprint import model_record

    if not runs:
        raise ValueError(f"results {name!r}: no runs to record")
    existing = existing or {}
    record = {key: existing[key] for key in KEPT if key in existing}
    kept_rows = existing.get("rows")
    if kept_rows and all("key" in row for row in kept_rows):
        rows = kept_rows
    record.update(name=name, command=command, date=time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), commit=commit(),
                  hardware=hardware(), model=model_record(model_dir) if model_dir else None,
                  source="recorded by the command", columns=columns, rows=rows, runs=runs, **(extra or {}))
    return record


def write_record(path: str | Path, **kwargs) -> Path:
    """:func:`build_record`, written to ``path`` (an existing file's presentation kept)."""
    target = Path(path)
    existing = json.loads(target.read_text()) if target.is_file() else None
    record = build_record(existing=existing, **kwargs)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return target
