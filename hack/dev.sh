#!/usr/bin/env bash
# Bring IMP up locally and run a VM: control plane from source, CRDs, operator and agent as
# processes, a sample ImpVM booting under QEMU (KVM when present, TCG otherwise).
#
# Today: the control plane, the API and the operator. The node agent that boots the VM arrives
# with issue 4; until then the sample VMs stay Pending ("0/0 nodes are available"), which is
# what the operator should say about a cluster with no IMP node.
set -euo pipefail
cd "$(dirname "$0")/.."
export IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
STATE=${IMP_DEV_STATE:-$IMP_CACHE/dev}
hack/install-prerequisites.sh
hack/setup-control-plane.sh "$IMP_CACHE/cp/bin" >/dev/null
CP_BIN_DIR=$IMP_CACHE/cp/bin WITH_KWOK=0 hack/start-control-plane.sh "$STATE"
# shellcheck disable=SC1091
. "$STATE/env"
kubectl apply -f config/crd/bases
kubectl wait --for=condition=Established --timeout=60s crd --all >/dev/null

go build -o bin/ ./cmd/imp-operator
nohup bin/imp-operator --kubeconfig "$KUBECONFIG" --leader-elect=false \
  --metrics-bind-address 127.0.0.1:18080 --health-probe-bind-address 127.0.0.1:18081 \
  --log-format text >"$STATE/logs/imp-operator.log" 2>&1 </dev/null &
echo $! >"$STATE/pids/imp-operator.pid"
until curl -sf http://127.0.0.1:18081/readyz >/dev/null; do sleep 0.2; done
echo "[dev] imp-operator ready (log: $STATE/logs/imp-operator.log, metrics: http://127.0.0.1:18080/metrics)"

kubectl apply -f config/samples
kubectl wait --for=jsonpath='{.status.phase}'=Pending --timeout=30s impvm/hello >/dev/null
kubectl get imp -A
echo
kubectl get impvm hello -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}'
cat <<MSG

IMP's API and operator are up (export KUBECONFIG=$KUBECONFIG). The node agent that would boot
the sample VM arrives with issue 4. Tear down with: hack/dev-down.sh
MSG
