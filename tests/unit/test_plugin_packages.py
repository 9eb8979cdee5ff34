"""The plug-in contract: a package that is not RollPacker adds a scheduler with a config section of
its own through the ``megatron_rl.plugins`` entry-point group, and its keys parse on the command
line like the core's (``acme.partial.max_continuations=2``). Before, a section was registered
only when its module was imported, which happened after the config was parsed: the key was
refused as unknown. RollPacker registers the same way (its entry points in pyproject.toml).

The third-party package lives in tests/helpers/acme_site (its module and its dist-info, as pip
would have installed them); each case runs the real command-line parser in a fresh interpreter
with that directory on the path (or not), so no registration leaks between cases.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ACME_SITE = REPO / "tests/helpers/acme_site"

_PARSE = """
import json, sys
from megatron_rl.config.validation import validate
from megatron_rl.config.values import ConfigError
from megatron_rl.config.plugins import load_plugin_packages, make_scheduler
from megatron_rl.train import parse_args
try:
    cfg = parse_args(sys.argv[1:])
    validate(cfg, device="cpu")
except ConfigError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
sched = make_scheduler(cfg)
print(json.dumps({"loaded": load_plugin_packages(), "max_continuations": cfg.acme.partial.max_continuations,
                  "scheduler": type(sched).__module__ + ":" + type(sched).__name__,
                  "max_staleness": sched.max_staleness(cfg), "peers": cfg.peers.partial.max_continuations}))
"""


def parse(args: list[str], on_path: bool = True, plugins: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRON_RL_PLUGINS")}
    if on_path:
        env["PYTHONPATH"] = str(ACME_SITE)
    if plugins is not None:
        env["MEGATRON_RL_PLUGINS"] = plugins
    result = subprocess.run([sys.executable, "-c", _PARSE, *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_third_party_package_registers_its_section_and_scheduler_before_parsing():
    got = parse(["scheduler.name=acme", "acme.partial.max_continuations=2", "peers.partial.max_continuations=3"])
    assert got["loaded"] == ["acme", "rollpacker", "rollpacker_peers"]
    assert got["max_continuations"] == 2 and got["max_staleness"] == 2
    assert got["scheduler"] == "acme_rollout:AcmeScheduler"
    assert got["peers"] == 3  # RollPacker's peers' own section, through the same entry points
    # Its validator runs with the core's, naming its key.
    assert "acme.partial.max_continuations: must be >= 0" in parse(["acme.partial.max_continuations=-1"])["error"]


def test_without_loading_before_parsing_its_key_is_refused_as_the_old_loop_did():
    # The package is importable and named by its import path, as trainer.plugins / scheduler.name
    # named plug-ins before; but nothing imports it before the parse, so its section is unknown.
    old_way = ["scheduler.name=acme_rollout:AcmeScheduler", "acme.partial.max_continuations=2"]
    error = parse(old_way, plugins="rollpacker,rollpacker_peers")["error"]
    assert "unknown section 'acme' in command-line override" in error
    assert "unknown section 'acme'" in parse(old_way, on_path=False)["error"]  # not installed at all
    # Loaded through its entry point, the same command line parses.
    assert parse(old_way)["max_continuations"] == 2
