#!/usr/bin/env bash
# Regenerate the README's config reference block from the config dataclasses.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
"$PY" - <<'PYEOF'
import subprocess, sys
from pathlib import Path
readme = Path("README.md").read_text()
begin, end = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
block = subprocess.run([sys.executable, "-m", "megatron_rl.tools.config_reference"], capture_output=True, text=True, check=True).stdout
head, rest = readme.split(begin, 1)
_, tail = rest.split(end, 1)
Path("README.md").write_text(head + begin + "\n" + block + end + tail)
PYEOF
