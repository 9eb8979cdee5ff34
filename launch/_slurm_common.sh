# shellcheck shell=bash
# Shared body of launch/qwen2.5_*_h800.sh: start a Ray cluster on the Slurm allocation (head on the
# first node, one worker per other node, all through srun), wait until every node joined, run the
# trainer on the head node, and tear down exactly the Ray processes this job started.
#
# The calling script sets RECIPE_DEFAULT, NODES_DEFAULT and JOB_NAME, then calls slurm_main "$@".
# Environment (all optional):
#   ROLLPACKER_ROOT  repository root (default: the sbatch submit dir, else this script's parent)
#   RECIPE           YAML recipe (default: the script's recipe)
#   PYTHON           interpreter with the stack and this project installed (pip install -e
#                    $ROLLPACKER_ROOT, see docs/installation.md; default: $ROLLPACKER_ROOT/.venv/bin/python)
#   RAY_BIN          ray CLI (default: next to $PYTHON)
#   MODEL_DIR        HF checkpoint directory       -> model.hf_path
#   TRAIN_DATA       training prompts file         -> data.train_path
#   EVAL_DATA        held-out prompts file         -> data.eval_path
#   RUN_DIR          metrics/checkpoints directory -> trainer.run_dir
#   LOG_ROOT         where job logs go (default: $ROLLPACKER_ROOT/logs; sbatch writes %x-%j.out there)
#   LOG_DIR          this job's Ray and trainer logs (default: $LOG_ROOT/$JOB_NAME-$SLURM_JOB_ID)
#   PARTITION, ACCOUNT, TIME_LIMIT   used when the script submits itself with sbatch (run outside
#                    an allocation, it calls sbatch on itself; inside one it launches)
#   GPUS_PER_NODE    GPUs per node (default: what the allocation has, SLURM_GPUS_PER_NODE, else 8).
#                    0 is the CPU switch: no GPU request (sbatch --gpus-per-node=0 overrides the
#                    scripts' #SBATCH line), Ray nodes without GPUs, cluster.device=cpu. Run the
#                    scripts on CPU nodes this way, with a CPU recipe (examples/qwen2.5/tiny_cpu_2node.yaml)
#   RAY_PORT (6379), RAY_JOIN_TIMEOUT_S (600), RAY_POLL_S (5), RAY_START_TRIES (3) and
#   RAY_START_WINDOW_S (120): see launch/_ray_node.sh
#   STOP_GRACE_S     seconds before the time limit at which Slurm sends SIGTERM (default 900, as the
#                    scripts' #SBATCH --signal=B:TERM@900): the trainer finishes its step, writes a
#                    checkpoint and exits 143; resubmit with trainer.resume=true to go on
#   WANDB_PROJECT    enables W&B logging (trainer.wandb_project)

_log() { echo "[$JOB_NAME $(date +%H:%M:%S)] $*" >&2; }
_die() { _log "error: $*"; exit 1; }

_setup_env() {
  ROOT="${ROLLPACKER_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}"
  [ -f "$ROOT/megatron_rl/train.py" ] || _die "ROLLPACKER_ROOT=$ROOT is not the repository root (no megatron_rl/train.py)"
  RECIPE="${RECIPE:-$RECIPE_DEFAULT}"
  case "$RECIPE" in /*) ;; *) RECIPE="$ROOT/$RECIPE" ;; esac
  [ -f "$RECIPE" ] || _die "recipe $RECIPE not found (set RECIPE)"
  PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
  RAY_BIN="${RAY_BIN:-$(dirname "$PYTHON")/ray}"
  local allocated="${SLURM_GPUS_PER_NODE:-8}"
  GPUS_PER_NODE="${GPUS_PER_NODE:-${allocated##*:}}"  # "h800:8" -> 8
  [[ "$GPUS_PER_NODE" =~ ^[0-9]+$ ]] || _die "GPUS_PER_NODE=$GPUS_PER_NODE is not a number of GPUs"
  DEVICE=cuda
  [ "$GPUS_PER_NODE" -eq 0 ] && DEVICE=cpu
  RAY_PORT="${RAY_PORT:-6379}"
  RAY_JOIN_TIMEOUT_S="${RAY_JOIN_TIMEOUT_S:-600}"
  RAY_POLL_S="${RAY_POLL_S:-5}"
  NUM_NODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-$NODES_DEFAULT}}"
  JOB_ID="${SLURM_JOB_ID:-none}"
  RUN_DIR="${RUN_DIR:-}"
  LOG_ROOT="${LOG_ROOT:-$ROOT/logs}"
  LOG_DIR="${LOG_DIR:-$LOG_ROOT/$JOB_NAME-$JOB_ID}"
  OVERRIDES=("cluster.num_nodes=$NUM_NODES" "cluster.gpus_per_node=$GPUS_PER_NODE" "cluster.device=$DEVICE")
  [ -n "${MODEL_DIR:-}" ] && OVERRIDES+=("model.hf_path=$MODEL_DIR")
  [ -n "${TRAIN_DATA:-}" ] && OVERRIDES+=("data.train_path=$TRAIN_DATA")
  [ -n "${EVAL_DATA:-}" ] && OVERRIDES+=("data.eval_path=$EVAL_DATA")
  [ -n "$RUN_DIR" ] && OVERRIDES+=("trainer.run_dir=$RUN_DIR")
  [ -n "${WANDB_PROJECT:-}" ] && OVERRIDES+=("trainer.wandb_project=$WANDB_PROJECT" "trainer.wandb_mode=online")
  return 0
}

_hostnames() {
  if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    scontrol show hostnames "$SLURM_JOB_NODELIST"
  else
    local i
    for ((i = 0; i < NUM_NODES; i++)); do echo "node$i"; done
  fi
}

_sbatch_command() {
  # Fills SBATCH_CMD: how this script submits itself when run outside an allocation.
  SBATCH_CMD=(sbatch "--job-name=$JOB_NAME" "--nodes=$NODES_DEFAULT" "--gpus-per-node=$GPUS_PER_NODE"
              "--ntasks-per-node=1" "--exclusive" "--signal=B:TERM@${STOP_GRACE_S:-900}"
              "--output=$LOG_ROOT/%x-%j.out")
  [ -n "${PARTITION:-}" ] && SBATCH_CMD+=("--partition=$PARTITION")
  [ -n "${ACCOUNT:-}" ] && SBATCH_CMD+=("--account=$ACCOUNT")
  [ -n "${TIME_LIMIT:-}" ] && SBATCH_CMD+=("--time=$TIME_LIMIT")
  SBATCH_CMD+=("$SCRIPT_PATH" "${EXTRA[@]}")
}

_dry_run() {
  local hosts head
  mapfile -t hosts < <(_hostnames)
  head="${hosts[0]}"
  echo "== $JOB_NAME dry run (nothing is launched) =="
  echo "slurm job: $JOB_ID, nodes: ${hosts[*]}, device: $DEVICE ($GPUS_PER_NODE GPUs per node)"
  if [ "$JOB_ID" = none ]; then
    _sbatch_command
    echo "submit with: $(printf '%q ' "${SBATCH_CMD[@]}")"
  fi
  echo "ray head:    srun --overlap --nodes=1 --ntasks=1 --nodelist=$head launch/_ray_node.sh head $RAY_PORT"
  echo "             (= $RAY_BIN start --block --head --port=$RAY_PORT --node-ip-address=<its hostname -i> --num-gpus=$GPUS_PER_NODE --num-cpus=<SLURM_CPUS_ON_NODE>)"
  if [ "${#hosts[@]}" -gt 1 ]; then
    echo "ray workers: srun --overlap --nodes=$((${#hosts[@]} - 1)) --ntasks=$((${#hosts[@]} - 1)) --exclude=$head launch/_ray_node.sh worker <head-ip>:$RAY_PORT"
  fi
  echo "wait:        until 'ray status' lists ${#hosts[@]} nodes (timeout ${RAY_JOIN_TIMEOUT_S}s)"
  echo "train:       $PYTHON -m megatron_rl.train --config $RECIPE cluster.ray_address=auto ${OVERRIDES[*]} ${EXTRA[*]}"
  echo "logs:        $LOG_DIR"
  if [ "$DEVICE" = cpu ]; then
    return 0  # the plan below is of GPU memory
  fi
  local joined
  joined="$(IFS=,; echo "${hosts[*]}")"
  "$PYTHON" -m rollpacker.benchmarks.plan_cluster --config "$RECIPE" --hosts "$joined" "${OVERRIDES[@]}" "${EXTRA[@]}"
}

_head_ip() {
  srun --overlap --nodes=1 --ntasks=1 "--nodelist=$1" hostname --ip-address | awk '{print $1; exit}'
}

_alive_nodes() {  # [TIMEOUT_S]: nodes `ray status` lists (it waits ~40 s for a GCS not up yet: bounded)
  timeout "${1:-60}" "$RAY_BIN" status --address "$RAY_ADDRESS" 2>/dev/null | grep -c ' node_' || true
}

_on_term() {
  # Slurm's SIGTERM (the --signal before the time limit, scancel): the trainer gets it too and
  # finishes its step, writes a checkpoint and exits 143; the main loop then tears down.
  TERMS_RECEIVED=$((TERMS_RECEIVED + 1))
  if [ -n "${TRAIN_PID:-}" ] && kill -0 "$TRAIN_PID" 2>/dev/null; then
    _log "SIGTERM: passing it to the trainer ($TRAIN_PID), which finishes its step, checkpoints and exits 143"
    kill -TERM "$TRAIN_PID" 2>/dev/null || true
  else
    exit 143
  fi
}

_stop_steps() {
  # SIGTERM to the tasks of this job's steps (scancel --signal without --full leaves the batch
  # shell alone): launch/_ray_node.sh stops Ray and cleans its node, the step ends, its srun
  # returns. (A SIGTERM to srun itself would cancel the step: SIGKILL without the clean-up.) An
  # srun still running after STEP_STOP_S is killed.
  local pid waited=0 running=()
  for pid in "${STARTED_PIDS[@]}"; do
    kill -0 "$pid" 2>/dev/null && running+=("$pid")
  done
  [ "${#running[@]}" -gt 0 ] || return 0
  _log "stopping the Ray steps (srun ${running[*]})"
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || kill -TERM "${running[@]}" 2>/dev/null || true
  else
    kill -TERM "${running[@]}" 2>/dev/null || true
  fi
  for pid in "${STARTED_PIDS[@]}"; do
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "${STEP_STOP_S:-60}" ]; do
      sleep 1
      waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
      _log "srun step $pid still running after ${STEP_STOP_S:-60}s: killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
}

_cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # The trainer first (it holds the Ray driver), then the Ray steps this job started.
  if [ -n "${TRAIN_PID:-}" ] && kill -0 "$TRAIN_PID" 2>/dev/null; then
    _log "stopping the trainer ($TRAIN_PID): it finishes its step and writes a checkpoint"
    kill -TERM "$TRAIN_PID" 2>/dev/null || true
    wait "$TRAIN_PID" 2>/dev/null || true
  fi
  _stop_steps
  # The head node's step was cleaned while the trainer could still be running: sweep what a
  # killed trainer left in this node's /dev/shm (only dead processes' directories).
  [ -n "${SLURM_JOB_ID:-}" ] && { "$PYTHON" -m megatron_rl.distributed.node_cleanup --shm-only || true; }
  _log "teardown done (exit $rc)"
  exit "$rc"
}

_wait_for_nodes() {
  # Until `ray status` lists NUM_NODES nodes; fails with the reason when the head died or the
  # nodes did not all join within RAY_JOIN_TIMEOUT_S (wall clock, each status call bounded by it).
  local deadline=$((SECONDS + RAY_JOIN_TIMEOUT_S)) alive=0 left
  while left=$((deadline - SECONDS)); [ "$left" -gt 0 ]; do
    alive="$(_alive_nodes "$left")"
    [ "$alive" -ge "$NUM_NODES" ] && return 0
    kill -0 "${STARTED_PIDS[0]}" 2>/dev/null || _die "the Ray head on $1 exited (see $LOG_DIR/ray-head.log)"
    # The workers' srun ends when every worker's Ray failed to start (after _ray_node.sh's retries):
    # no node can join any more, so stop now rather than at RAY_JOIN_TIMEOUT_S.
    if [ "${#STARTED_PIDS[@]}" -gt 1 ] && ! kill -0 "${STARTED_PIDS[1]}" 2>/dev/null; then
      _die "the Ray workers' step exited before every node joined ($alive of $NUM_NODES; see $LOG_DIR/ray-worker-*.log)"
    fi
    sleep "$RAY_POLL_S"
  done
  _die "only $alive of $NUM_NODES nodes joined Ray within RAY_JOIN_TIMEOUT_S=${RAY_JOIN_TIMEOUT_S}s (see $LOG_DIR/ray-*.log)"
}

_launch() {
  local hosts head head_ip nworkers rc status seen
  mapfile -t hosts < <(_hostnames)
  [ "${#hosts[@]}" -eq "$NUM_NODES" ] || _die "allocation lists ${#hosts[@]} hosts, expected $NUM_NODES"
  mkdir -p "$LOG_DIR"
  cd "$ROOT" || _die "cannot cd to $ROOT"  # the recipes' relative paths (artifacts/, runs/) are relative to the repository
  STARTED_PIDS=()
  TERMS_RECEIVED=0
  trap _cleanup EXIT
  trap 'exit 130' INT
  trap _on_term TERM
  head="${hosts[0]}"
  head_ip="$(_head_ip "$head")"
  [ -n "$head_ip" ] || _die "could not resolve the IP of head node $head"
  export RAY_ADDRESS="$head_ip:$RAY_PORT" RAY_BIN PYTHON GPUS_PER_NODE
  _log "starting Ray head on $head ($RAY_ADDRESS, $DEVICE, $GPUS_PER_NODE GPUs per node); logs in $LOG_DIR"
  srun --overlap --nodes=1 --ntasks=1 "--nodelist=$head" "--output=$LOG_DIR/ray-head.log" \
    bash "$ROOT/launch/_ray_node.sh" head "$RAY_PORT" &
  STARTED_PIDS+=("$!")
  nworkers=$((${#hosts[@]} - 1))
  if [ "$nworkers" -gt 0 ]; then
    _log "starting $nworkers Ray workers on ${hosts[*]:1}"
    srun --overlap "--nodes=$nworkers" "--ntasks=$nworkers" --ntasks-per-node=1 "--exclude=$head" \
      "--output=$LOG_DIR/ray-worker-%n.log" \
      bash "$ROOT/launch/_ray_node.sh" worker "$RAY_ADDRESS" &
    STARTED_PIDS+=("$!")
  fi
  _wait_for_nodes "$head"
  _log "all $NUM_NODES nodes joined; starting the trainer"
  # In the background + wait, so a Slurm SIGTERM (time limit, scancel) reaches the traps at once.
  "$PYTHON" -m megatron_rl.train --config "$RECIPE" cluster.ray_address=auto "${OVERRIDES[@]}" "${EXTRA[@]}" \
    > >(tee "$LOG_DIR/trainer.log") 2>&1 &
  TRAIN_PID=$!
  rc=0
  while :; do
    # A trapped SIGTERM ends `wait` early (status 143) while the trainer still runs: wait again;
    # 127 means the status was already collected.
    seen="$TERMS_RECEIVED"
    status=0
    wait "$TRAIN_PID" || status=$?
    [ "$status" -eq 127 ] && break
    rc="$status"
    [ "$TERMS_RECEIVED" -eq "$seen" ] && break
  done
  TRAIN_PID=""
  _log "trainer exited with $rc"
  return "$rc"
}

slurm_main() {
  local dry_run=0 arg
  EXTRA=()
  for arg in "$@"; do
    case "$arg" in
      --dry-run) dry_run=1 ;;
      -h|--help) sed -n '2,/^set -euo/p' "$SCRIPT_PATH" | grep '^#' | grep -v '^#SBATCH'; return 0 ;;
      -*) _die "unknown option $arg (use --dry-run, --help, or section.key=value overrides)" ;;
      *) EXTRA+=("$arg") ;;
    esac
  done
  _setup_env
  if [ "$dry_run" -eq 1 ]; then
    _dry_run
    return
  fi
  if [ -z "${SLURM_JOB_ID:-}" ]; then
    _log "not inside a Slurm allocation: submitting with sbatch"
    _sbatch_command
    mkdir -p "$LOG_ROOT"
    ROLLPACKER_ROOT="$ROOT" RECIPE="$RECIPE" "${SBATCH_CMD[@]}"
    return
  fi
  _launch
}
