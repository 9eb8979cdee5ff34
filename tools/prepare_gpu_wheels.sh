#!/usr/bin/env bash
# Downloads the wheels the GPU check needs on the lent GPU machine (Python 3.12, torch 2.11 with
# CUDA 13, transformers, safetensors, pyyaml; no megatron-core, no network there) into
# .gpu_wheels/ (git-ignored), to be carried with the device call:
#
#   bash tools/prepare_gpu_wheels.sh
#   device run: command "bash tests/gpu/run_on_device.sh", carry [".gpu_wheels"]
#
# Only megatron-core is missing there: 0.16.1 ships a cp312 manylinux wheel (2.6 MB; its one
# compiled module, the dataset index helpers, is never imported by the check). Its requirements
# (torch>=2.6, numpy, packaging) are on the machine, so it installs with --no-deps next to the
# machine's torch 2.11. Transformer Engine does not travel: transformer-engine-cu13 2.20.2 is a
# 276.5 MB wheel (over the 64 MiB a call may carry) and transformer_engine_torch builds from source.
# The quantize_export part needs nvidia-modelopt (the version pyproject.toml pins) and the
# requirements the machine lacks: pydantic (+ pydantic-core, annotated-types, typing-inspection)
# and pulp; its others (ninja, numpy, nvidia-ml-py, rich, scipy, safetensors, tqdm, regex) are
# there. About 20 MB together; all of .gpu_wheels stays under 25 MB.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.gpu_wheels"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DEST" megatron-core==0.16.1 nvidia-modelopt==0.42.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 pulp==3.3.2
ls -l "$DEST"
du -sh "$DEST"
