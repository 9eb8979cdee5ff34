"""vLLM's own logging in an engine's processes, less the lines nobody can act on.

Every launch of a round (``VLLMEngine.submit_all``) holds vLLM's scheduler with
``pause_generation(mode="keep")`` and lets it go with ``resume_generation``; vLLM logs both at INFO
(``vllm/v1/core/sched/scheduler.py`` ``set_pause_state``: "setting pause state to ..."), two lines
per launch and engine, dozens per step with tail batching's refills. The engine's processes get
vLLM's default logging configuration (``vllm/logger.py`` ``DEFAULT_LOGGING_CONFIG``: same format,
level and stream) plus a filter on its handler that drops those two lines; everything else vLLM
logs is untouched. vLLM reads the file named by ``VLLM_LOGGING_CONFIG_PATH`` in each process it
starts (``vllm/config/logging.py`` ``pylogging_config_file``, applied by ``configure_logging`` in
the engine core and the workers). A user's own ``VLLM_LOGGING_CONFIG_PATH``, or
``VLLM_CONFIGURE_LOGGING=0``, is left as it is.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from pathlib import Path

QUIET: tuple[tuple[str, str], ...] = (("vllm.v1.core.sched.scheduler", "setting pause state to"),)
"""(logger name, message prefix) of the INFO lines dropped."""


class QuietEngineLines(logging.Filter):
    """Drops the records named in :data:`QUIET` below WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        msg = record.msg if isinstance(record.msg, str) else ""
        return not any(record.name == name and msg.startswith(prefix) for name, prefix in QUIET)


def logging_config_env(root: Path) -> dict[str, str]:
    """``VLLM_LOGGING_CONFIG_PATH`` for an engine's processes: vLLM's default configuration with
    :class:`QuietEngineLines` on its handler, written once under the runtime ``root`` (shared by
    the engines: a per-engine file could vanish under a process that read the path earlier).
    Empty when the user configures vLLM's logging (or turns it off)."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return {}
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["filters"] = {"megatron_rl_quiet": {"()": f"{__name__}.{QuietEngineLines.__name__}"}}
    config["handlers"]["vllm"]["filters"] = ["megatron_rl_quiet"]
    text = json.dumps(config, indent=1, sort_keys=True) + "\n"
    # Named by its content: runs with another VLLM_LOGGING_LEVEL or stream sharing the root keep theirs.
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"vllm_logging-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    if not path.is_file():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # engines starting at once each write whole files
        tmp.write_text(text)
        tmp.replace(path)
    return {"VLLM_LOGGING_CONFIG_PATH": str(path)}
