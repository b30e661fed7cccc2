#!/usr/bin/env bash
# Tear down what hack/dev.sh started.
set -euo pipefail
cd "$(dirname "$0")/.."
export IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
STATE=${IMP_DEV_STATE:-$IMP_CACHE/dev}
pidfile=$STATE/pids/imp-operator.pid
if [[ -f $pidfile ]]; then
  pid=$(cat "$pidfile")
  if [[ "$(ps -o comm= -p "$pid" 2>/dev/null)" == imp-operator ]]; then
    kill "$pid" && echo "[stop] imp-operator ($pid) stopped"
  fi
  rm -f "$pidfile"
fi
hack/stop-control-plane.sh "$STATE" --purge
