#!/usr/bin/env bash
# The GPU check, one call on the lent GPU machine (see tests/gpu/check/__init__.py):
#
#   bash tools/prepare_gpu_wheels.sh                  # here, once: megatron-core into .gpu_wheels/
#   device run: command "bash tests/gpu/run_on_device.sh", carry [".gpu_wheels"], timeout_s 600
#   bash tests/gpu/run_on_device.sh --cpu             # the same parts, tiny sizes, on this CPU box
#
# GPU mode installs the carried wheels into /tmp/gpu_check_site (--no-deps: the machine's torch,
# transformers and numpy stay), then runs every part within about 8 minutes on one H200. Prints
# one table and a last summary line; writes gpu_check.json, engine_constants.json,
# train_calibration.json, gpu_check.log and part_logs.tar.gz into $OUT when it is set. Exit
# status 1 when any part failed. Extra arguments go to `python -m tests.gpu.check`.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
export PYTHONUNBUFFERED=1
cpu=0
for arg in "$@"; do [ "$arg" = "--cpu" ] && cpu=1; done
if [ "$cpu" = 1 ]; then
  PY="${PYTHON:-$ROOT/.venv/bin/python}"
  [ -x "$PY" ] || PY=python3
else
  PY="${PYTHON:-python3}"
  if ls "$ROOT"/.gpu_wheels/*.whl >/dev/null 2>&1; then
    SITE=/tmp/gpu_check_site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$ROOT"/.gpu_wheels/*.whl || { echo "run_on_device: installing .gpu_wheels failed" >&2; exit 2; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "run_on_device: no .gpu_wheels/*.whl (run tools/prepare_gpu_wheels.sh here, carry .gpu_wheels)" >&2
  fi
  "$PY" -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)" \
    || echo "run_on_device: megatron.core does not import; the Megatron parts will fail" >&2
fi
# The project itself is not installed there: `python -m` from the repository root puts the root
# first on sys.path, so tests.gpu.check, megatron_rl and rollpacker import from this tree (the
# parts run the same way, see tests/gpu/check/harness.py). PYTHONPATH above only adds the wheels.
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  "$PY" -m tests.gpu.check "$@" 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
exec "$PY" -m tests.gpu.check "$@"
