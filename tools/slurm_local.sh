#!/usr/bin/env bash
# A two-node Slurm cluster on this machine, for running the launch/ scripts for real:
#
#   bash tools/slurm_local.sh up       # install slurm-wlm + munge with apt if absent, start the cluster
#   eval "$(bash tools/slurm_local.sh env)"   # SLURM_CONF for sbatch, squeue, scancel, sinfo
#   bash tools/slurm_local.sh status   # daemons, nodes, queue, listening sockets
#   bash tools/slurm_local.sh down     # cancel its jobs, stop exactly the daemons it started
#
# What `up` starts (as root, every file under $SLURM_LOCAL_DIR): a munged of its own (own key and
# socket), a slurmctld and two slurmd, nodes n1 (127.0.0.1) and n2 (127.0.0.2), each with
# SLURM_LOCAL_CPUS CPUs (select/cons_tres, one partition "local"). Each daemon runs in its own
# UTS + mount namespace (unshare) whose host name is its node's and whose /etc/hosts maps n1 and
# n2 to their loopback addresses; with CommunicationParameters=NoInAddrAny the daemons bind the
# address of their host name, so nothing listens beyond loopback, and a job's processes see the
# host name and address of the node they run on (as on a real cluster: `hostname -i` on n2 is
# 127.0.0.2). The ports are its own (SLURM_LOCAL_PORT and the next two), so a Slurm this machine
# already runs (/etc/slurm, port 6817, /run/munge) is never touched.
#
# Environment: SLURM_LOCAL_DIR (default /tmp/slurm-local-$UID; munged wants every directory above
# its socket world-searchable, so not under a private mktemp dir), SLURM_LOCAL_PORT (slurmctld,
# default 16817; slurmd n1/n2 take +1/+2), SLURM_LOCAL_CPUS (2), SLURM_LOCAL_MEM_MB (8000).
# Exit codes of `up`: 0 up, 1 failed to start (logs named), 3 slurm-wlm/munge missing and apt could
# not install them (tests skip on 3).
set -euo pipefail
DIR="${SLURM_LOCAL_DIR:-/tmp/slurm-local-$(id -u)}"
CTLD_PORT="${SLURM_LOCAL_PORT:-16817}"
CPUS="${SLURM_LOCAL_CPUS:-2}"
MEM_MB="${SLURM_LOCAL_MEM_MB:-8000}"
CONF="$DIR/etc/slurm.conf"
NODES=(n1 n2)
declare -A NODE_ADDR=([n1]=127.0.0.1 [n2]=127.0.0.2)
declare -A NODE_PORT=([n1]=$((CTLD_PORT + 1)) [n2]=$((CTLD_PORT + 2)))
CTLD_HOST=slurmctl  # the controller's host name in its namespace (127.0.0.1)
export SLURM_CONF="$CONF"

_log() { echo "[slurm_local] $*" >&2; }
_die() { _log "error: $*"; exit "${2:-1}"; }

_install() {
  local missing=() tool
  for tool in slurmctld slurmd munged sbatch unshare; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  _log "installing slurm-wlm and munge with apt (missing: ${missing[*]})"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge; } \
       > "${TMPDIR:-/tmp}/slurm_local_apt.log" 2>&1; then
    tail -5 "${TMPDIR:-/tmp}/slurm_local_apt.log" >&2
    _die "apt could not install slurm-wlm and munge (no package mirror reachable?)" 3
  fi
  for tool in slurmctld slurmd munged sbatch unshare; do
    command -v "$tool" >/dev/null || _die "$tool still missing after installing slurm-wlm and munge" 3
  done
}

# pid of daemon NAME if it runs and is ours (its command line names our directory), else nothing.
_pid_of() {
  local file="$DIR/run/$1.pid" pid
  [ -f "$file" ] || return 0
  pid="$(cat "$file")"
  [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF "$DIR" && echo "$pid"
  return 0
}

_port_in_use() {
  # A listener on the port at any address (ss), else a connect test on loopback.
  if command -v ss >/dev/null; then
    [ -n "$(ss -Hltn "sport = :$1")" ]
  else
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
  fi
}

# Start "$@" in a UTS + mount namespace whose host name is HOST and whose /etc/hosts is ours;
# unshare and bash exec into the daemon, so $! is the daemon's pid (recorded as run/NAME.pid).
_start_in_node_ns() {
  local name="$1" host="$2"
  shift 2
  # shellcheck disable=SC2016  # expanded by the inner bash
  unshare --uts --mount --propagation private -- bash -c \
    'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' \
    _ "$host" "$DIR/etc/hosts" "$@" > "$DIR/log/$name.out" 2>&1 < /dev/null &
  echo "$!" > "$DIR/run/$name.pid"
}

_wait_for() {  # SECONDS DESCRIPTION COMMAND...: poll COMMAND every half second
  local deadline=$((SECONDS + $1)) what="$2"
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.5
  done
  _log "$what"
}

_write_config() {
  local node
  {
    echo "127.0.0.1 localhost $CTLD_HOST n1"
    echo "127.0.0.2 n2"
    grep -v -w -e n1 -e n2 -e "$CTLD_HOST" /etc/hosts || true
  } > "$DIR/etc/hosts"
  cat > "$CONF" <<EOF
# Written by tools/slurm_local.sh: a two-node cluster on loopback; everything lives under $DIR.
ClusterName=rollpacker-local
SlurmctldHost=$CTLD_HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
# Bind the address of the daemon's host name (loopback in its namespace), not 0.0.0.0.
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld-daemon.pid
SlurmdPidFile=$DIR/run/slurmd-%n-daemon.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# No cgroups here: steps are tracked by process tree, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
# The nodes' size is what this file says, whatever the machine has (both run on the same cores).
SlurmdParameters=config_overrides
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# One line per finished job (state, exit code), kept after the controller forgets the job.
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
# scancel / time limit: SIGTERM, then SIGKILL this many seconds later.
KillWait=30
MinJobAge=600
EOF
  for node in "${NODES[@]}"; do
    echo "NodeName=$node NodeHostname=$node NodeAddr=${NODE_ADDR[$node]} Port=${NODE_PORT[$node]} CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN" >> "$CONF"
  done
  echo "PartitionName=local Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
}

_start_munge() {
  # munged checks its directories: the socket's world-searchable, the key's private to us.
  mkdir -p "$DIR/munge" "$DIR/munge-key"
  chmod 0755 "$DIR/munge"
  chmod 0700 "$DIR/munge-key"
  if [ ! -s "$DIR/munge-key/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge-key/munge.key" bs=1024 count=1 status=none
    chmod 0400 "$DIR/munge-key/munge.key"
  fi
  munged --foreground --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge-key/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge-key/munged.seed" > "$DIR/log/munged.out" 2>&1 < /dev/null &
  echo "$!" > "$DIR/run/munged.pid"
  _wait_for 15 "munged up (pid $(cat "$DIR/run/munged.pid"))" test -S "$DIR/munge/munge.socket" \
    || _die "munged did not start: $(tail -3 "$DIR/log/munged.out")"
}

_queue_empty() { [ -z "$(squeue -h -o %i 2>/dev/null)" ]; }

_nodes_idle() {
  [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c -E ' (idle|mix|alloc)$')" -eq "${#NODES[@]}" ]
}

cmd_up() {
  [ "$(id -u)" -eq 0 ] || _die "run as root (slurmd starts jobs as their users)"
  _install
  if [ -n "$(_pid_of slurmctld)" ]; then
    _log "already up in $DIR"
    cmd_status
    return 0
  fi
  local port node parent
  for port in "$CTLD_PORT" "${NODE_PORT[@]}"; do
    _port_in_use "$port" && _die "port $port is in use (another Slurm? set SLURM_LOCAL_PORT)"
  done
  mkdir -p "$DIR"/{etc,state,spool,log,run}
  chmod 0755 "$DIR"
  parent="$DIR"
  while [ "$parent" != / ]; do
    parent="$(dirname "$parent")"
    [ -x "$parent" ] && [ "$(( $(stat -c %a "$parent") % 10 & 1 ))" -eq 1 ] \
      || _die "$parent is not world-searchable; munged refuses a socket below it (set SLURM_LOCAL_DIR under /tmp)"
  done
  rm -rf "$DIR/state"/* "$DIR/spool"/*
  _write_config
  _start_munge
  _start_in_node_ns slurmctld "$CTLD_HOST" slurmctld -D -c -i -f "$CONF"
  _wait_for 30 "slurmctld up on 127.0.0.1:$CTLD_PORT (pid $(cat "$DIR/run/slurmctld.pid"))" scontrol ping \
    || _die "slurmctld did not answer: see $DIR/log/slurmctld.log"
  for node in "${NODES[@]}"; do
    mkdir -p "$DIR/spool/$node"
    _start_in_node_ns "slurmd-$node" "$node" slurmd -D -N "$node" -f "$CONF"
  done
  _wait_for 60 "nodes ${NODES[*]} up" _nodes_idle \
    || _die "the nodes did not come up: $(sinfo -N 2>&1 | tail -3); see $DIR/log/slurmd-*.log"
  echo "export SLURM_CONF=$CONF"
}

# Processes of this cluster's jobs still alive: their environment names a job (SLURM_JOB_ID) and
# our slurm.conf (sbatch passes the submitter's SLURM_CONF on). Never this script or its callers:
# a shell or test that exported SLURM_CONF has no SLURM_JOB_ID of ours.
_job_processes() {
  local env_file pid env_text
  for env_file in /proc/[0-9]*/environ; do
    pid="${env_file#/proc/}"
    pid="${pid%/environ}"
    [ "$pid" != "$$" ] || continue
    env_text="$(tr '\0' '\n' 2>/dev/null < "$env_file")" || continue  # gone, or not ours to read
    grep -qxF "SLURM_CONF=$CONF" <<< "$env_text" && grep -qE '^SLURM_JOB_ID=[0-9]+$' <<< "$env_text" && echo "$pid"
  done
  return 0
}

_stop_pid() {  # NAME PID: SIGTERM, up to 15 s, then SIGKILL
  local name="$1" pid="$2" i
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < 30; i++)); do
    kill -0 "$pid" 2>/dev/null || { _log "stopped $name ($pid)"; return 0; }
    sleep 0.5
  done
  kill -KILL "$pid" 2>/dev/null || true
  _log "killed $name ($pid): it ignored SIGTERM for 15 s"
}

cmd_down() {
  local name pid left
  if [ -n "$(_pid_of slurmctld)" ]; then
    if [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
      _log "cancelling the jobs still queued or running: $(squeue -h -o %i | tr '\n' ' ')"
      scancel --full --partition=local 2>/dev/null || true
      _wait_for 60 "jobs gone" _queue_empty || _log "jobs still listed after 60 s"
    fi
  fi
  for name in slurmd-n1 slurmd-n2 slurmctld munged; do
    pid="$(_pid_of "$name")"
    [ -n "$pid" ] && _stop_pid "$name" "$pid"
    rm -f "$DIR/run/$name.pid"
  done
  left="$(_job_processes | tr '\n' ' ')"
  if [ -n "${left// /}" ]; then
    _log "killing processes of this cluster's jobs that outlived them: $left"
    # shellcheck disable=SC2086  # a list of pids
    kill -KILL $left 2>/dev/null || true
  fi
  _log "down (logs kept in $DIR/log)"
}

cmd_status() {
  local name pid state=0
  for name in munged slurmctld slurmd-n1 slurmd-n2; do
    pid="$(_pid_of "$name")"
    if [ -n "$pid" ]; then echo "$name: running (pid $pid)"; else echo "$name: not running"; state=1; fi
  done
  [ "$state" -eq 0 ] || return 1
  echo "SLURM_CONF=$CONF"
  sinfo -N -o '%N %t %c %m' 2>&1 || true
  squeue 2>&1 || true
  if command -v ss >/dev/null; then
    echo "listening:"
    ss -Hltnp | grep -E "slurm|munge" | awk '{print "  " $4 " " $6}' || true
  fi
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
