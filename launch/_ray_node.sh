#!/usr/bin/env bash
# One Ray node of a Slurm job; launch/_slurm_common.sh runs it on every node through srun:
#   _ray_node.sh head PORT            (the first node)
#   _ray_node.sh worker HEAD_IP:PORT  (every other node)
# It starts `ray start --block` with this node's own address (`hostname --ip-address`: Ray's own
# guess is the address of the default route, not the one the nodes share), the CPUs Slurm gave the
# job here (SLURM_CPUS_ON_NODE) and GPUS_PER_NODE GPUs. On SIGTERM (the job's teardown, scancel,
# the time limit) it stops Ray, then removes what this job left on this node: processes of this
# step that outlived Ray (reparented away from Slurm's process tracking) and the /dev/shm
# directories of the job's dead processes (python -m megatron_rl.distributed.node_cleanup).
# Ray's files go to a directory of this job and node (RAY_NODE_TMPDIR, default /tmp/ray-j<job>-<node>:
# short, as Ray's socket paths must be), not the machine-wide /tmp/ray, so two jobs, or two nodes of
# a test cluster sharing one machine, never mix their sessions; it is removed after Ray stopped.
# A start that fails (`ray start` exits non-zero within RAY_START_WINDOW_S, default 120 s: on a loaded
# node the raylet can miss Ray's hard-coded 30 s registration wait) is retried, up to
# RAY_START_TRIES (default 3) starts, after this step's leftover processes are cleaned; a later exit
# is a node failure and is not retried.
# Environment: RAY_BIN, PYTHON, GPUS_PER_NODE (set by _slurm_common.sh), RAY_NODE_IP, RAY_START_TRIES,
# RAY_START_WINDOW_S (optional).
set -euo pipefail
# Trapped from the start: a SIGTERM while Ray is still starting (a job failing early) must still
# stop Ray and clean the node, not kill this script and orphan Ray's processes.
stopping=0
ray_pid=""
trap 'stopping=1; [ -z "$ray_pid" ] || kill -TERM "$ray_pid" 2>/dev/null || true' TERM INT
role="${1:?usage: _ray_node.sh head PORT | worker HEAD_IP:PORT}"
target="${2:?usage: _ray_node.sh head PORT | worker HEAD_IP:PORT}"
node_ip="${RAY_NODE_IP:-$(hostname --ip-address | awk '{print $1}')}"
temp_dir="${RAY_NODE_TMPDIR:-/tmp/ray-j${SLURM_JOB_ID:-0}-$(hostname -s)}"
args=(start --block "--node-ip-address=$node_ip" "--num-gpus=${GPUS_PER_NODE:-0}" "--temp-dir=$temp_dir" --disable-usage-stats
      --dashboard-agent-listen-port=0)  # a free port: nodes sharing a machine would collide on 52365
[ -n "${SLURM_CPUS_ON_NODE:-}" ] && args+=("--num-cpus=$SLURM_CPUS_ON_NODE")
case "$role" in
  head) args+=(--head "--port=$target" --include-dashboard=false) ;;
  worker) args+=("--address=$target") ;;
  *) echo "_ray_node.sh: unknown role $role" >&2; exit 2 ;;
esac
echo "[ray-node $(hostname) $(date +%H:%M:%S)] $role at $node_ip: $RAY_BIN ${args[*]}" >&2

# Ray 2.60 drains a node for up to 30 s on SIGTERM (for Serve replicas); this job's trainer has
# stopped by then, and scancel's SIGKILL follows its SIGTERM after KillWait (often 30 s): skip it.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"
tries="${RAY_START_TRIES:-3}"
window="${RAY_START_WINDOW_S:-120}"

clean_node() {  # the processes of this step that outlived Ray, and Ray's directory of this node
  if [ -n "${SLURM_STEP_ID:-}" ] && [ -n "${PYTHON:-}" ]; then
    "$PYTHON" -m megatron_rl.distributed.node_cleanup || true
  fi
  rm -rf "$temp_dir"
}

attempt=1
while :; do
  started=$SECONDS
  "$RAY_BIN" "${args[@]}" &
  ray_pid=$!
  [ "$stopping" -eq 0 ] || kill -TERM "$ray_pid" 2>/dev/null || true  # a SIGTERM before Ray started
  rc=0
  while :; do
    rc=0
    wait "$ray_pid" || rc=$?
    kill -0 "$ray_pid" 2>/dev/null || break  # a trapped signal ended the wait, not Ray: wait again
  done
  lasted=$((SECONDS - started))
  if [ "$stopping" -eq 0 ] && [ "$rc" -ne 0 ] && [ "$lasted" -lt "$window" ] && [ "$attempt" -lt "$tries" ]; then
    echo "[ray-node $(hostname) $(date +%H:%M:%S)] ray start failed with $rc after ${lasted}s (start $attempt of $tries): cleaning up and starting again" >&2
    clean_node
    attempt=$((attempt + 1))
    continue
  fi
  break
done
trap - TERM INT
echo "[ray-node $(hostname) $(date +%H:%M:%S)] ray exited with $rc; cleaning up this node" >&2
clean_node
[ "$stopping" -eq 1 ] && exit 0  # stopped on purpose
exit "$rc"
