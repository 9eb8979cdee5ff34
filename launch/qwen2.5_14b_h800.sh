#!/usr/bin/env bash
#SBATCH --job-name=rl-qwen2.5-14b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --signal=B:TERM@900
# Qwen2.5-14B GRPO/DAPO on 4 nodes x 8 H800 with Ray + Megatron-Core + vLLM (Slurm).
#
#   bash launch/qwen2.5_14b_h800.sh --dry-run          # print placement, layout, memory; launch nothing
#   PARTITION=gpu MODEL_DIR=/models/Qwen2.5-14B TRAIN_DATA=/data/deepmath.parquet \
#     bash launch/qwen2.5_14b_h800.sh [section.key=value ...]   # submits itself with sbatch
#   sbatch launch/qwen2.5_14b_h800.sh                  # or submit directly (run from the repo root)
#
# Recipe: RECIPE (default examples/qwen2.5/qwen2.5_14b_math_4x8_tp4_rtp2.yaml;
# the *_code_* recipe next to it trains on KodCode). Other variables: see launch/_slurm_common.sh.
set -euo pipefail
ROOT="${ROLLPACKER_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}"
JOB_NAME="rl-qwen2.5-14b"
NODES_DEFAULT=4
RECIPE_DEFAULT="examples/qwen2.5/qwen2.5_14b_math_4x8_tp4_rtp2.yaml"
SCRIPT_PATH="$ROOT/launch/qwen2.5_14b_h800.sh"
export JOB_NAME NODES_DEFAULT RECIPE_DEFAULT SCRIPT_PATH
# shellcheck source=launch/_slurm_common.sh
source "$ROOT/launch/_slurm_common.sh"
slurm_main "$@"
