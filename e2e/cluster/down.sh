#!/usr/bin/env bash
# Stop a test control plane started by up.sh: ends exactly the processes that up.sh recorded
# (by pid, after checking that each pid still runs the binary it started), then removes the
# state directory (kept when HEADROOM_KEEP_CLUSTER_DIR=1, e.g. to read the logs).
#
# Usage: down.sh [NAME]   (NAME defaults to $HEADROOM_CLUSTER_NAME or "default")
set -euo pipefail

HR_CACHE="${HEADROOM_CACHE:-$HOME/.cache/headroom}"
NAME="${1:-${HEADROOM_CLUSTER_NAME:-default}}"
DIR="$(realpath -m "${HEADROOM_CLUSTER_DIR:-$HR_CACHE/cluster/$NAME}")"
log() { echo "[cluster-down $NAME] $*" >&2; }
# proc_alive PID: the process exists and is not a zombie (exited, waiting to be reaped).
proc_alive() {
  local st
  st="$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" || return 1
  [[ -n "$st" && "$st" != Z && "$st" != X ]]
}

if [[ ! -d "$DIR" ]]; then
  log "nothing to stop ($DIR does not exist)"
  exit 0
fi

# The pid files are the record of what up.sh started (cluster.env carries the same list).
declare -a names=() pids=()
if [[ -d "$DIR/pids" ]]; then
  for f in "$DIR"/pids/*.pid; do
    [[ -f "$f" ]] || continue
    names+=("$(basename "$f" .pid)")
    pids+=("$(cat "$f")")
  done
fi

# ours NAME PID: the pid is alive and still runs the process up.sh started under that name.
ours() {
  local name=$1 pid=$2 exe
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  proc_alive "$pid" || return 1
  exe="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -d' ' -f1)"
  [[ "$(basename "$exe")" == "$name" || ( "$name" == etcd && "$exe" == *etcd* ) ]] || return 1
  # And it belongs to this cluster: its command line names the state directory.
  tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$DIR" || return 1
}

# Stop in reverse start order: kwok, scheduler, controller-manager, apiserver, etcd last.
order=(kwok kube-scheduler kube-controller-manager kube-apiserver etcd)
signal_all() {
  local sig=$1 n i
  for n in "${order[@]}"; do
    for i in "${!names[@]}"; do
      [[ "${names[$i]}" == "$n" ]] || continue
      if ours "$n" "${pids[$i]}"; then kill "-$sig" "${pids[$i]}" 2>/dev/null || true; fi
    done
  done
}
any_alive() {
  local i
  for i in "${!names[@]}"; do ours "${names[$i]}" "${pids[$i]}" && return 0; done
  return 1
}

signal_all TERM
for _ in $(seq 1 100); do
  any_alive || break
  sleep 0.1
done
if any_alive; then
  log "some processes ignored SIGTERM for 10s; sending SIGKILL"
  signal_all KILL
  for _ in $(seq 1 50); do any_alive || break; sleep 0.1; done
fi
if any_alive; then
  log "ERROR: could not stop every process"
  exit 1
fi
for i in "${!names[@]}"; do log "stopped ${names[$i]} (pid ${pids[$i]})"; done

if [[ "${HEADROOM_KEEP_CLUSTER_DIR:-0}" == 1 ]]; then
  rm -f "$DIR/cluster.env" "$DIR/pod-net"  # pod-net: no longer claims its loopback /16
  rm -rf "$DIR/pids"
  log "kept $DIR (HEADROOM_KEEP_CLUSTER_DIR=1)"
else
  rm -rf "$DIR"
  log "removed $DIR"
fi
# Drop up.sh's lock file unless an up.sh holds it right now.
( flock -n 9 && rm -f "$DIR.lock" ) 9>>"$DIR.lock" 2>/dev/null || true
