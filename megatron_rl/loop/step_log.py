"""Per-step JSON-lines audit files in the run directory, safe across kill and resume.

* ``trained_prompts.jsonl``: which prompts each step trained on and which it filtered (DAPO).
  Tests use it to prove that no prompt is lost or trained twice across a kill and resume.
* ``rollout_timeline.jsonl``: every engine request of each step (submit, finish, finish
  reason), for ``rollpacker-plot-timeline``.
* ``phases.jsonl``: the (start, end) of every phase of each step (rollout, logprob, train,
  weight_sync, validation, checkpoint) on the system-wide monotonic clock, for
  ``rollpacker-profile-loop``.
* ``engine_trace.jsonl`` (``rollout.engine_trace``): every engine iteration of each step's rollout,
  one line per engine (``megatron_rl.rollout.actor.engine_trace.COLUMNS``), for ``rollpacker-price``.

On resume, lines of steps at or after the resumed step are dropped (those steps are redone), so
each file always describes exactly what the surviving model went through.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class StepLog:
    def __init__(self, run_dir: str | os.PathLike, name: str):
        self.path = Path(run_dir) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, step: int, **fields) -> None:
        """Append one record for ``step`` (flushed and fsynced: it must survive a SIGKILL)."""
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **fields}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate(self, first_dropped_step: int) -> None:
        """Keep only records of steps < first_dropped_step (atomic rewrite)."""
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
