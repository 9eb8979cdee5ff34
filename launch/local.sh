#!/usr/bin/env bash
# The default run on CPU: bootstrap .venv, build the tiny Qwen2.5-architecture model if missing,
# then GRPO on the built-in arithmetic task with Ray + Megatron-Core (two data-parallel ranks, gloo) + vLLM (CPU).
# Extra arguments are dotted config overrides, e.g. `bash launch/local.sh trainer.steps=5`;
# CONFIG=<recipe> picks another CPU recipe (e.g. examples/qwen2.5/tiny_cpu_gsm8k.yaml).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup_env.sh
export RAY_AUTH_MODE=disabled VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONWARNINGS=ignore::UserWarning
BIN="$ROOT/.venv/bin"  # the project is installed there (editable): its commands too
MODEL_DIR="${MODEL_DIR:-$ROOT/artifacts/tiny-qwen2.5}"
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "[local] building the tiny model in $MODEL_DIR (one-off, a few minutes)"
  "$BIN/megatron-rl-make-tiny-model" --out "$MODEL_DIR"
fi
RUN_DIR="${RUN_DIR:-$ROOT/runs/local}"
CONFIG="${CONFIG:-examples/qwen2.5/tiny_cpu.yaml}"
"$BIN/megatron-rl-train" --config "$CONFIG" \
  model.hf_path="$MODEL_DIR" trainer.run_dir="$RUN_DIR" "$@"
"$BIN/megatron-rl-plot-curves" "$RUN_DIR" --out "$RUN_DIR/curves.png"
echo "[local] done: metrics in $RUN_DIR/metrics.jsonl, curves in $RUN_DIR/curves.png"
