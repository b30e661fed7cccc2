#!/usr/bin/env bash
# Bring IMP up locally and run a VM: a control plane built from source, IMP's CRDs, the operator
# and the node agent as processes (this machine as node imp-dev, labelled imp/enabled=true), a
# local OCI registry with a small image, and an ImpVM that boots under QEMU (KVM when it works,
# TCG otherwise). Ends with the VM Running and its console. Tear down with hack/dev-down.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
STATE=${IMP_DEV_STATE:-$IMP_CACHE/dev}
REGISTRY_PORT=${REGISTRY_PORT:-15000}
NODE=imp-dev
log() { printf '[dev %s] %s\n' "$(date +%T)" "$*"; }

hack/install-prerequisites.sh
hack/setup-control-plane.sh "$IMP_CACHE/cp/bin" >/dev/null
KERNEL=$(hack/guest-kernel.sh)
MODULES=$IMP_CACHE/guest/kernel/lib/modules/$(basename "$KERNEL" | sed 's/^vmlinuz-//')
# No kube-controller-manager: with no kubelet here, its node lifecycle controller would mark the
# node NotReady. No kwok: no fake nodes needed.
CP_BIN_DIR=$IMP_CACHE/cp/bin WITH_KCM=0 WITH_KWOK=0 WITH_REGISTRY=1 REGISTRY_PORT=$REGISTRY_PORT \
  hack/start-control-plane.sh "$STATE"
# shellcheck disable=SC1091
. "$STATE/env"
kubectl apply -f config/crd/bases >/dev/null
kubectl wait --for=condition=Established --timeout=60s crd --all >/dev/null
# IMP's namespace, as the chart's: the VMs' run Secrets and the agents' heartbeat Leases.
kubectl create namespace imp-system --dry-run=client -o yaml | kubectl apply -f - >/dev/null

log "building binaries, the guest initramfs and a sample image"
go build -o bin/ ./cmd/imp-operator ./cmd/imp-agent ./hack/devtool
CGO_ENABLED=0 go build -o bin/imp-init ./cmd/imp-init
CGO_ENABLED=0 go build -o bin/hello ./internal/testguest/hello
mkdir -p "$STATE/boot"
bin/devtool initramfs "$STATE/boot/initramfs.cpio.gz" bin/imp-init "$MODULES"
IMAGE=127.0.0.1:$REGISTRY_PORT/imp/hello:v1
bin/devtool image "$IMAGE" bin/hello serve

log "registering this machine as node $NODE"
kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Node
metadata:
  name: $NODE
  labels: {imp/enabled: "true", kubernetes.io/hostname: $NODE}
YAML
kubectl patch node "$NODE" --subresource=status --type=merge -p \
  "{\"status\":{\"conditions\":[{\"type\":\"Ready\",\"status\":\"True\",\"reason\":\"ImpDev\",\"message\":\"hack/dev.sh\",\"lastHeartbeatTime\":\"$(date -u +%FT%TZ)\",\"lastTransitionTime\":\"$(date -u +%FT%TZ)\"}]}}" >/dev/null

start() { # name, args...
  local name=$1; shift
  nohup "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$STATE/pids/$name.pid"
}
start imp-operator bin/imp-operator --kubeconfig "$KUBECONFIG" --leader-elect=false \
  --metrics-bind-address 127.0.0.1:18080 --health-probe-bind-address 127.0.0.1:18081 --log-format text
start imp-agent bin/imp-agent --kubeconfig "$KUBECONFIG" --node-name "$NODE" --state-dir "$STATE/node" \
  --local-registry "127.0.0.1:$REGISTRY_PORT" \
  --kernel "$KERNEL" --initramfs "$STATE/boot/initramfs.cpio.gz" --reserve-vcpus 0 --vcpu-overcommit 4 \
  --metrics-bind-address 127.0.0.1:18090 --health-probe-bind-address 127.0.0.1:18091 --log-format text
for p in 18081 18091; do
  until curl -sf "http://127.0.0.1:$p/readyz" >/dev/null; do sleep 0.2; done
done
log "imp-operator and imp-agent ready (logs in $STATE/logs)"

kubectl apply -f - <<YAML
apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata:
  name: hello
  namespace: default
spec:
  image: $IMAGE
  env:
  - name: GREETING
    value: hello-from-make-dev
  resources:
    vcpus: 1
    memory: 256Mi
  diskSize: 256Mi
YAML
kubectl wait impvm/hello --for=condition=Ready --timeout=300s >/dev/null
kubectl get impvm -A -o wide
echo
uid=$(kubectl get impvm hello -o jsonpath='{.metadata.uid}')
sleep 2
log "console of impvm/hello ($STATE/node/vms/$uid/console.log):"
tail -n 5 "$STATE/node/vms/$uid/console.log"
cat <<MSG

IMP is up with a VM running (export KUBECONFIG=$KUBECONFIG; kubectl get imp -A).
The plugin: go build -o bin/ ./cmd/kubectl-imp; then, with bin/ on PATH,
  kubectl imp list; kubectl imp logs hello --state-dir $STATE/node; kubectl imp suspend hello; kubectl imp resume hello
Tear down with: hack/dev-down.sh
MSG
