"""How the side-by-side benchmarks end: print the table, also write the raw figures as JSON when
asked. A leaf: no other benchmark module, nothing heavy, so the light benchmarks stay light."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(table: str, figures: Any, json_path: Path | None) -> int:
    """Print ``table``; write ``figures`` to ``json_path`` if given; the command's exit code (0)."""
    print(table)
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")
    return 0
