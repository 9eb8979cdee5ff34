"""run_dir/trained_prompts.jsonl: which prompts each step trained on (audit trail).

One line per step. On resume, lines of steps at or after the resumed step are dropped (those
steps are redone), so the file always describes exactly what the surviving model was trained on:
tests use it to prove no prompt is lost or trained twice across a kill and resume.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class TrainedPromptLog:
    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / "trained_prompts.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, step: int, prompt_ids: list[str], filtered_ids: list[str] = ()) -> None:
        """Record the prompts trained at ``step`` and those deliberately filtered (DAPO)."""
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "prompt_ids": prompt_ids, "filtered_ids": list(filtered_ids)}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate(self, first_dropped_step: int) -> None:
        """Keep only lines of steps < first_dropped_step (atomic rewrite)."""
        kept = [r for r in self.read() if r["step"] < first_dropped_step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from a kill: everything after it is untrusted
        return rows
