#!/usr/bin/env bash
# Build NVIDIA apex from source into the GPU environment (apex is not on PyPI; Megatron-Core picks
# up its fused kernels when it is importable). Run it on a GPU node (or a build node with the
# CUDA toolkit), after requirements/gpu.lock and this project are installed:
#
#   PYTHON=/path/to/gpu-venv/bin/python bash tools/build_apex.sh
#
# Environment (all optional):
#   PYTHON               the environment's interpreter (default: python3 on PATH)
#   APEX_SRC             an apex checkout to build (default: a fresh clone of APEX_REPO at APEX_REF)
#   APEX_REPO, APEX_REF  what to clone (default: https://github.com/NVIDIA/apex at master; set
#                        APEX_REF to a commit for a reproducible build)
#   TORCH_CUDA_ARCH_LIST GPU architectures to compile for (default: 9.0, the H800/H100/H200)
#   APEX_PARALLEL_BUILD  extensions built at once (default 8); NVCC_APPEND_FLAGS (default --threads 4)
#
# Builds apex's C++ and CUDA extensions (APEX_CPP_EXT=1 APEX_CUDA_EXT=1) with
# `pip install -v --no-build-isolation --no-deps`: the build compiles against the environment's
# own torch, and the lock already holds everything else. apex checks that nvcc's CUDA matches the
# one torch was built with (PyPI's torch 2.13.0: CUDA 13). Never run on the CPU-only development
# box (no nvcc there): it stops at the first check below.
set -euo pipefail
PY="${PYTHON:-python3}"
die() { echo "build_apex: $*" >&2; exit 2; }

NVCC="$(command -v nvcc || true)"
[ -n "$NVCC" ] || [ -z "${CUDA_HOME:-}" ] || [ ! -x "$CUDA_HOME/bin/nvcc" ] || NVCC="$CUDA_HOME/bin/nvcc"
[ -n "$NVCC" ] || die "no nvcc (neither on PATH nor in \$CUDA_HOME/bin): apex's CUDA extensions need the CUDA \
toolkit. Run this on a GPU or build node with CUDA installed; it cannot run on a CPU-only machine."
torch_cuda="$("$PY" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null)" \
  || die "$PY cannot import torch: install requirements/gpu.lock into that environment first"
[ -n "$torch_cuda" ] || die "$PY has a CPU-only torch: apex needs the CUDA build (requirements/gpu.lock)"
nvcc_cuda="$("$NVCC" --version | sed -n 's/.*release \([0-9][0-9.]*\).*/\1/p')"
[ "${nvcc_cuda%%.*}" = "${torch_cuda%%.*}" ] \
  || die "nvcc is CUDA $nvcc_cuda but torch was built with CUDA $torch_cuda: use a CUDA ${torch_cuda%%.*}.x toolkit"

src="${APEX_SRC:-}"
if [ -z "$src" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  src="$work/apex"
  git clone --quiet "${APEX_REPO:-https://github.com/NVIDIA/apex}" "$src"
  git -C "$src" checkout --quiet "${APEX_REF:-master}"
fi
echo "build_apex: apex $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo '(not a git checkout)') with nvcc $nvcc_cuda, torch CUDA $torch_cuda"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD="${APEX_PARALLEL_BUILD:-8}" \
  NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:---threads 4}" \
  "$PY" -m pip install -v --no-build-isolation --no-deps --no-cache-dir "$src"
"$PY" -c 'import apex, amp_C, fused_layer_norm_cuda; print("build_apex: apex and its CUDA extensions import")'
