#!/usr/bin/env bash
# The GPU install of docs/installation.md, the steps that need no nvcc, on any Linux x86_64 box
# (a GPU is not needed): CI runs it (.ci/run) so a lock that cannot install or import fails here.
#
#   bash tools/check_gpu_install.sh                  # install (or reuse) the GPU venv, check imports
#   bash tools/check_gpu_install.sh --record FILE    # the same, then append the timings to FILE
#
# 1. requirements/gpu.lock without transformer-engine-torch into a venv (uv, with the hashes);
# 2. transformer-engine-torch (a source distribution compiled against torch with nvcc) and
#    NVIDIA apex (tools/build_apex.sh) are NOT built here: they need nvcc and a CUDA machine;
# 3. this project, editable, with no dependencies;
# then tools/check_gpu_install_imports.py imports the libraries, Transformer Engine's core and every
# module of the project, plus every import the project makes only inside a function (the GPU
# paths: NCCL/IPC weight push, the TE layer spec, vLLM's worker hooks).
#
# State, kept between runs under $ROLLPACKER_GPU_INSTALL_DIR (default ~/.cache/rollpacker-gpu-install):
# uv's cache (uv-cache/, unless UV_CACHE_DIR is set) and one venv per lock, venv-<sha256 of the
# lock>, marked complete by a stamp. A second run with the same lock only re-checks the project's
# install and the imports; a new lock (or an unfinished venv) gets a fresh venv and the older
# ones are removed. One run at a time per state directory (flock).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCK="$ROOT/requirements/gpu.lock"
RECORD=""
case "${1:-}" in
  "") ;;
  --record) RECORD="${2:?--record needs a file}"; RECORD="$(realpath -m "$RECORD")" ;;
  *) echo "usage: bash tools/check_gpu_install.sh [--record FILE]" >&2; exit 2 ;;
esac
STATE="${ROLLPACKER_GPU_INSTALL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rollpacker-gpu-install}"
export UV_CACHE_DIR="${UV_CACHE_DIR:-$STATE/uv-cache}"
key="$(sha256sum "$LOCK" | cut -c1-16)"
VENV="$STATE/venv-$key"
STAMP="$VENV/.gpu-install-stamp"
start=$SECONDS
phase() { echo "[gpu-install +$((SECONDS - start))s] $*"; }
mkdir -p "$STATE"
exec 9> "$STATE/.lock"
flock 9

PY="${PYTHON:-python3.11}"
command -v "$PY" > /dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required (the locks are for 3.11)"'

for old in "$STATE"/venv-*; do
  if [ -d "$old" ] && [ "$old" != "$VENV" ]; then
    phase "removing $old (another lock's venv)"
    rm -rf "$old"
  fi
done
install_s=0
if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ]; then
  phase "reusing $VENV (requirements/gpu.lock unchanged since it was installed)"
else
  t0=$SECONDS
  total="$(grep -cE '^[A-Za-z0-9]' "$LOCK")"
  # No stamp: a first run, or one that stopped half-way; start from an empty venv either way.
  rm -rf "$VENV"
  phase "creating $VENV ($total packages in the lock: ~4 GB to download, ~9.5 GB installed; uv cache $UV_CACHE_DIR)"
  "$PY" -m venv "$VENV"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  # uv: the lock's own entry, installed by the venv's pip with the lock's hashes (as tools/setup_env.sh).
  awk '/^[A-Za-z0-9]/ { take = ($0 ~ /^uv==/) } take' "$LOCK" > "$work/uv.lock"
  grep -q '^uv==' "$work/uv.lock" || { echo "[gpu-install] $LOCK has no uv== entry" >&2; exit 1; }
  phase "$(grep -oE '^uv==[^ ]+' "$work/uv.lock") into the venv (pip, with the lock's hashes)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r "$work/uv.lock" 2>&1 \
    | { grep -v -e "is ignored: it is neither a file nor a directory" -e "^Looking in" || true; }
  [ -x "$VENV/bin/uv" ] || { echo "[gpu-install] pip could not install uv from the lock (is PyPI reachable?)" >&2; exit 1; }
  # Step 1: the lock without transformer-engine-torch (step 2 compiles it with nvcc). sync
  # installs exactly the file's packages and checks every hash.
  awk '/^[A-Za-z0-9]/ { skip = ($0 ~ /^transformer-engine-torch==/) } !skip' "$LOCK" > "$work/gpu-rest.lock"
  phase "step 1: uv pip sync of requirements/gpu.lock without transformer-engine-torch ($((total - 1)) packages)"
  # uv lists every package it downloads and adds; the log keeps its summary lines.
  if ! "$VENV/bin/uv" pip sync --python "$VENV/bin/python" --require-hashes "$work/gpu-rest.lock" 2>&1 \
      | { grep -vE '^ [-+~] |^ ?Download(ing|ed) ' || true; }; then
    echo "[gpu-install] uv pip sync failed on the GPU lock (see above)" >&2
    exit 1
  fi
  echo "$key" > "$STAMP"
  install_s=$((SECONDS - t0))
fi
phase "step 2 skipped: transformer-engine-torch and NVIDIA apex are compiled with nvcc on a CUDA machine"

# Step 3, every run: the venv may hold another checkout's editable install (or none yet).
here="$("$VENV/bin/python" - "$ROOT" << 'EOF'
import importlib.metadata, json, sys, urllib.parse
try:
    url = json.loads(importlib.metadata.distribution("rollpacker-megatron").read_text("direct_url.json"))["url"]
except (importlib.metadata.PackageNotFoundError, TypeError, KeyError, ValueError):
    url = ""
print("yes" if urllib.parse.unquote(url).removeprefix("file://").rstrip("/") == sys.argv[1] else "no")
EOF
)"
if [ "$here" = yes ]; then
  phase "step 3: this checkout is already installed (editable) in the venv"
else
  phase "step 3: this project, editable, no dependencies"
  "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --no-deps --no-build-isolation -e "$ROOT"
fi

phase "imports (tools/check_gpu_install_imports.py)"
t0=$SECONDS
# The import check writes bytecode (a warm run then imports faster); it runs from / so that the
# checkout is imported through the editable install, as a user's process would.
rc=0
(cd / && env -u PYTHONDONTWRITEBYTECODE PYTHONWARNINGS=ignore "$VENV/bin/python" "$ROOT/tools/check_gpu_install_imports.py") || rc=$?
import_s=$((SECONDS - t0))
# du counts a file hard-linked from uv's cache into the venv once, under the venv.
sizes="$( (du -sch "$VENV" "$UV_CACHE_DIR" 2> /dev/null || true) | awk '{printf "%s%s %s", (NR > 1 ? ", " : ""), $1, $2}')"
summary="total ${SECONDS}s = install ${install_s}s (0: reused) + imports ${import_s}s; disk (du): $sizes"
phase "$summary"
if [ -n "$RECORD" ]; then
  mkdir -p "$(dirname "$RECORD")"
  commit="$(git -C "$ROOT" rev-parse --short HEAD 2> /dev/null || echo unknown)"
  cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  gpu="$( (nvidia-smi -L 2> /dev/null || true) | head -1)"
  {
    echo "- $(date -u +%Y-%m-%dT%H:%MZ) commit $commit, exit $rc: \`bash tools/check_gpu_install.sh\`"
    echo "  on $(nproc) cores ($cpu), $(awk '/MemTotal/ {printf "%d GiB", $2 / 1048576}' /proc/meminfo), GPU: ${gpu:-none};" \
      "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "  $summary"
  } >> "$RECORD"
  phase "appended to $RECORD"
fi
if [ "$rc" -ne 0 ]; then
  echo "[gpu-install] the import check failed (see above)" >&2
fi
exit "$rc"
