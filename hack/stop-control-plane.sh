#!/usr/bin/env bash
# Stop what start-control-plane.sh started, by the PIDs it recorded (never by name).
# Usage: stop-control-plane.sh [STATE_DIR] [--purge]     (default: $IMP_CACHE/cp/state)
#   --purge also deletes STATE_DIR (etcd data, PKI, logs).
set -uo pipefail

STATE=${IMP_CACHE:-$HOME/.cache/imp}/cp/state PURGE=0
for a in "$@"; do
  case $a in
    --purge) PURGE=1 ;;
    *) STATE=$a ;;
  esac
done
PIDS=$STATE/pids

stop_one() { # name
  local name=$1 f=$PIDS/$1.pid pid comm
  [[ -f $f ]] || return 0
  pid=$(cat "$f")
  # only signal the PID if it still runs the binary we started (PIDs can be reused)
  comm=$(ps -o comm= -p "$pid" 2>/dev/null || true)
  if [[ -z $comm || ${name:0:15} != "${comm:0:15}" ]]; then
    rm -f "$f"; return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do # up to 20 s (the apiserver drains for a few seconds)
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "[stop] $name ($pid) did not exit on TERM, sending KILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  echo "[stop] $name ($pid) stopped"
  rm -f "$f"
}

# reverse start order
for n in registry kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
  stop_one "$n"
done
if ((PURGE)); then
  rm -rf "$STATE"
  echo "[stop] removed $STATE"
fi
