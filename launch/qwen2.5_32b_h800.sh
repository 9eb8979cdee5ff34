#!/usr/bin/env bash
#SBATCH --job-name=rl-qwen2.5-32b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --signal=B:TERM@900
# Qwen2.5-32B GRPO/DAPO on 8 nodes x 8 H800 with Ray + Megatron-Core + vLLM (Slurm).
#
#   bash launch/qwen2.5_32b_h800.sh --dry-run          # print placement, layout, memory; launch nothing
#   PARTITION=gpu MODEL_DIR=/models/Qwen2.5-32B TRAIN_DATA=/data/deepmath.parquet \
#     bash launch/qwen2.5_32b_h800.sh [section.key=value ...]   # submits itself with sbatch
#   sbatch launch/qwen2.5_32b_h800.sh                  # or submit directly (run from the repo root)
#
# Recipe: RECIPE (default examples/qwen2.5/qwen2.5_32b_math_8x8_tp8_rtp2.yaml;
# the *_code_* recipe next to it trains on KodCode). Other variables: see launch/_slurm_common.sh.
set -euo pipefail
ROOT="${ROLLPACKER_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}"
JOB_NAME="rl-qwen2.5-32b"
NODES_DEFAULT=8
RECIPE_DEFAULT="examples/qwen2.5/qwen2.5_32b_math_8x8_tp8_rtp2.yaml"
SCRIPT_PATH="$ROOT/launch/qwen2.5_32b_h800.sh"
export JOB_NAME NODES_DEFAULT RECIPE_DEFAULT SCRIPT_PATH
# shellcheck source=launch/_slurm_common.sh
source "$ROOT/launch/_slurm_common.sh"
slurm_main "$@"
