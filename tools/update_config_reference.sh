#!/usr/bin/env bash
# Regenerate the configuration reference in docs/configuration.md (the block between its
# config-reference markers) from the config dataclasses; tests/unit/test_config.py checks it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
"$PY" -m megatron_rl.tools.config_reference --write docs/configuration.md
