"""What the fault-injection tests measured, for docs/faults.md.

Each test calls :func:`record` with its fault, the outcome and the times it measured. With
``FAULT_FIGURES=<path>`` in the environment the entry replaces the one of the same fault in that
JSON file (``docs/results/faults.json`` regenerates the docs table: see docs/faults.md); without
it nothing is written, so ordinary suite runs leave the checkout alone."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

FIGURES_ENV = "FAULT_FIGURES"


def record(fault: str, outcome: str, detect_s: float | None, recover_s: float | None, test: str,
           note: str = "") -> None:
    """Store one fault's figures (seconds; None where a time does not apply)."""
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    target = Path(path)
    data = json.loads(target.read_text()) if target.is_file() else {"faults": []}
    entry = {"fault": fault, "outcome": outcome,
             "detect_s": None if detect_s is None else round(detect_s, 2),
             "recover_s": None if recover_s is None else round(recover_s, 2),
             "test": test, "note": note}
    data["faults"] = [f for f in data["faults"] if f["fault"] != fault] + [entry]
    data["measured_on"] = f"{platform.machine()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}"
    target.write_text(json.dumps(data, indent=2) + "\n")


def record_burst(name: str, figures: dict, command: str) -> None:
    """Store a reward-pool burst's figures (``megatron_rl.tools.reward_burst.run_burst``)."""
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    target = Path(path)
    data = json.loads(target.read_text()) if target.is_file() else {"faults": []}
    data.setdefault("bursts", {})[name] = {"command": command, **figures}
    target.write_text(json.dumps(data, indent=2) + "\n")
