#!/usr/bin/env bash
# Tear down what hack/dev.sh started: the VMs first (through IMP, so their VMMs stop), then the
# agent and operator, then the control plane.
set -uo pipefail
cd "$(dirname "$0")/.."
export IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
STATE=${IMP_DEV_STATE:-$IMP_CACHE/dev}
if [[ -f $STATE/env ]]; then
  # shellcheck disable=SC1091
  . "$STATE/env"
  kubectl delete impvm --all -A --timeout=120s 2>/dev/null
fi
for name in imp-agent imp-operator kube-proxy coredns; do
  pidfile=$STATE/pids/$name.pid
  [[ -f $pidfile ]] || continue
  pid=$(cat "$pidfile")
  if [[ "$(ps -o comm= -p "$pid" 2>/dev/null)" == "$name" ]]; then
    kill "$pid" && echo "[stop] $name ($pid) stopped"
  fi
  rm -f "$pidfile"
done
# A VM the agent could not stop (agent already gone): its VMM records its pid.
for rec in "$STATE"/node/vms/*/vmm.json; do
  [[ -f $rec ]] || continue
  pid=$(sed -n 's/.*"pid":\([0-9]*\).*/\1/p' "$rec")
  [[ "$(ps -o comm= -p "$pid" 2>/dev/null)" == qemu-system-x86* ]] && kill -9 "$pid"
done
if command -v nft >/dev/null; then # kube-proxy's tables
  nft delete table ip kube-proxy 2>/dev/null
  nft delete table ip6 kube-proxy 2>/dev/null
fi
hack/stop-control-plane.sh "$STATE" --purge
