# shellcheck shell=bash
# Sourced by setup_env.sh and lock_deps.sh: where uv takes torch 2.13.0+cpu from, as uv flags in
# the array TORCH_CPU_SOURCE. The wheel is not on PyPI. Where pip is configured with find-links
# (`pip config get global.find-links`, here /opt/wheels, which holds it), those directories; uv
# reads no pip config of its own, hence the flags. Elsewhere the PyTorch CPU index, beside PyPI.
# Either way the lock's sha256 decides which file is accepted.
# Usage: torch_cpu_source PYTHON   (a python whose pip reads the machine's pip config)
torch_cpu_source() {
  local links
  links="$("$1" -m pip config get global.find-links 2>/dev/null || true)"
  TORCH_CPU_SOURCE=()
  if [ -n "$links" ]; then
    local link
    for link in $links; do TORCH_CPU_SOURCE+=(--find-links "$link"); done
  else
    TORCH_CPU_SOURCE=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
  fi
}
