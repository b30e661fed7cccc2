#!/usr/bin/env bash
# Bring IMP up locally and run a VM: a control plane built from source, IMP's CRDs, the operator
# and the node agent as processes (this machine as node imp-dev, labelled imp/enabled=true), a
# local OCI registry with a small image, kube-proxy (nftables mode) and CoreDNS as the chart's
# cluster has them, and an ImpVM that boots under QEMU (KVM when it works, TCG otherwise) behind a
# Service. Ends with the VM Running, its console, an exec into it, and the Service answering
# from this machine. Tear down with hack/dev-down.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
STATE=${IMP_DEV_STATE:-$IMP_CACHE/dev}
REGISTRY_PORT=${REGISTRY_PORT:-15000}
SUB_PORT=${SUB_PORT:-18443}
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
# IMP's namespace, as the chart's: the VMs' run Secrets and the agents' heartbeat Leases; and
# the access CA's, which agents must not read.
for ns in imp-system imp-system-access; do
  kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
done
# The ImpVM subresources (exec, console, port-forward, logs), as the chart serves them: the API
# server proxies them to the operator's subresource server through the Service imp-subresources.
# It routes to the Service's endpoints itself (--enable-aggregator-routing; no kube-proxy here),
# which cannot be a loopback address: the operator listens on this machine's own address, and
# the EndpointSlice (no kube-controller-manager here to make it) names it. The operator puts its
# CA in the APIService's caBundle.
HOST_IP=${HOST_IP:-$(hostname -I | awk '{print $1}')}
[[ -n $HOST_IP ]] || { echo "this machine has no address but loopback: set HOST_IP to one the API server may dial" >&2; exit 1; }
kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Service
metadata: {name: imp-subresources, namespace: imp-system}
spec:
  ports: [{name: https, port: 443, targetPort: $SUB_PORT}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: imp-subresources-dev
  namespace: imp-system
  labels: {kubernetes.io/service-name: imp-subresources}
addressType: IPv4
endpoints: [{addresses: ["$HOST_IP"], conditions: {ready: true}}]
ports: [{name: https, port: $SUB_PORT, protocol: TCP}]
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: v1alpha1.subresources.imp.dev}
spec:
  group: subresources.imp.dev
  version: v1alpha1
  groupPriorityMinimum: 1000
  versionPriority: 15
  service: {name: imp-subresources, namespace: imp-system, port: 443}
YAML

log "building binaries, the guest initramfs and a sample image"
go build -o bin/ ./cmd/imp-operator ./cmd/imp-agent ./cmd/kubectl-imp ./hack/devtool
CGO_ENABLED=0 go build -o bin/imp-init ./cmd/imp-init
CGO_ENABLED=0 go build -o bin/hello ./internal/testguest/hello
mkdir -p "$STATE/boot"
bin/devtool initramfs "$STATE/boot/initramfs.cpio.gz" bin/imp-init "$MODULES"
IMAGE=127.0.0.1:$REGISTRY_PORT/imp/hello:v1
bin/devtool image "$IMAGE" bin/hello web

log "registering this machine as node $NODE"
kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Node
metadata:
  name: $NODE
  labels: {imp/enabled: "true", kubernetes.io/hostname: $NODE}
YAML
kubectl patch node "$NODE" --subresource=status --type=merge -p \
  "{\"status\":{\"addresses\":[{\"type\":\"InternalIP\",\"address\":\"127.0.0.1\"}],\"conditions\":[{\"type\":\"Ready\",\"status\":\"True\",\"reason\":\"ImpDev\",\"message\":\"hack/dev.sh\",\"lastHeartbeatTime\":\"$(date -u +%FT%TZ)\",\"lastTransitionTime\":\"$(date -u +%FT%TZ)\"}]}}" >/dev/null

start() { # name, args...
  local name=$1; shift
  nohup "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$STATE/pids/$name.pid"
}
start imp-operator bin/imp-operator --kubeconfig "$KUBECONFIG" --leader-elect=false \
  --metrics-bind-address 127.0.0.1:18080 --health-probe-bind-address 127.0.0.1:18081 --log-format text \
  --subresources-bind-address "$HOST_IP:$SUB_PORT" --subresources-namespace imp-system
# The agent's access endpoint (the operator reaches it at the node's InternalIP, 127.0.0.1): its
# certificate from the operator's access CA. The chart's agents ask the certificates API with
# their pod-bound token instead (--access-cert-request); this one has the admin's kubeconfig.
for i in $(seq 300); do
  kubectl -n imp-system-access get secret imp-access-ca >/dev/null 2>&1 && break
  [[ $i == 300 ]] && { echo "the operator made no access CA (logs in $STATE/logs)" >&2; exit 1; }
  sleep 0.2
done
mkdir -p "$STATE/access-ca"
for f in tls.crt tls.key; do
  kubectl -n imp-system-access get secret imp-access-ca -o "jsonpath={.data.${f//./\\.}}" | base64 -d >"$STATE/access-ca/$f"
done
bin/devtool agent-cert "$STATE/access-ca/tls.crt" "$STATE/access-ca/tls.key" "$NODE" "$STATE/access"
rm -rf "$STATE/access-ca"
start imp-agent bin/imp-agent --kubeconfig "$KUBECONFIG" --node-name "$NODE" --state-dir "$STATE/node" \
  --local-registry "127.0.0.1:$REGISTRY_PORT" --access-cert-dir "$STATE/access" --access-bind-address 127.0.0.1:10260 \
  --migration-bind-address 127.0.0.1:10261 --migration-bandwidth 1Gi \
  --kernel "$KERNEL" --initramfs "$STATE/boot/initramfs.cpio.gz" --reserve-vcpus 0 --vcpu-overcommit 4 --endpoint-blocks \
  --metrics-bind-address 127.0.0.1:18090 --health-probe-bind-address 127.0.0.1:18091 --log-format text
for p in 18081 18091; do
  until curl -sf "http://127.0.0.1:$p/readyz" >/dev/null; do sleep 0.2; done
done
log "imp-operator and imp-agent ready (logs in $STATE/logs)"
# Services as a cluster serves them: kube-proxy programs this machine's nftables (ClusterIPs,
# NodePorts) from EndpointSlices, IMP's included; CoreDNS answers cluster names on 127.0.0.1:1053.
cat >"$STATE/Corefile" <<EOF
.:1053 {
    bind 127.0.0.1
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $KUBECONFIG
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
EOF
start coredns "$IMP_CACHE/cp/bin/coredns" -conf "$STATE/Corefile"
start kube-proxy "$IMP_CACHE/cp/bin/kube-proxy" --proxy-mode nftables --kubeconfig "$KUBECONFIG" --hostname-override "$NODE" \
  --nodeport-addresses primary --healthz-bind-address 127.0.0.1:18256 --metrics-bind-address 127.0.0.1:18249 \
  --conntrack-max-per-core 0 --conntrack-tcp-timeout-established 0 --conntrack-tcp-timeout-close-wait 0
until curl -sf http://127.0.0.1:18256/healthz >/dev/null; do sleep 0.2; done
log "kube-proxy (nftables) and CoreDNS (127.0.0.1:1053) ready"

kubectl apply -f - <<YAML
apiVersion: imp.dev/v1alpha1
kind: ImpNetwork
metadata: {name: default, namespace: default}
spec: {cidr: 10.100.0.0/24}
---
apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata:
  name: hello
  namespace: default
  labels: {app: hello}
spec:
  image: $IMAGE
  env:
  - name: GREETING
    value: hello-from-make-dev
  resources:
    vcpus: 1
    memory: 256Mi
  diskSize: 256Mi
  networkRef: {name: default}
  ports: [{name: http, port: 8080}]
  readinessProbe: {httpGet: {path: /healthz, port: http}, periodSeconds: 2}
---
apiVersion: v1
kind: Service
metadata: {name: hello, namespace: default}
spec:
  selector: {app: hello}
  ports: [{name: http, port: 80, targetPort: http}]
YAML
kubectl wait impvm/hello --for=condition=Ready --timeout=300s >/dev/null
kubectl get impvm -A -o wide
echo
uid=$(kubectl get impvm hello -o jsonpath='{.metadata.uid}')
sleep 2
log "console of impvm/hello ($STATE/node/vms/$uid/console.log):"
tail -n 5 "$STATE/node/vms/$uid/console.log"
# The subresources, through the API server, as a user reaches them.
for i in $(seq 300); do
  kubectl get --raw /apis/subresources.imp.dev/v1alpha1 >/dev/null 2>&1 && break
  [[ $i == 300 ]] && { kubectl get apiservice v1alpha1.subresources.imp.dev -o wide >&2; echo "the API server does not serve the ImpVM subresources (logs in $STATE/logs)" >&2; exit 1; }
  sleep 0.2
done
PATH=$PWD/bin:$PATH
log "kubectl imp exec hello -- /bin/app tool-exit 0 hello from the guest:"
kubectl imp exec hello -- /bin/app tool-exit 0 hello from the guest 2>/dev/null
log "kubectl imp logs hello --limit-bytes 200:"
kubectl imp logs hello --limit-bytes 200; echo
SVC_IP=$(kubectl get svc hello -o jsonpath='{.spec.clusterIP}')
for i in $(seq 150); do
  [[ $(kubectl get endpointslices -l kubernetes.io/service-name=hello,endpointslice.kubernetes.io/managed-by=imp.dev \
    -o jsonpath='{.items[*].endpoints[*].conditions.ready}') == true ]] && break
  sleep 0.2
done
log "curl http://$SVC_IP/ (Service hello, through kube-proxy to the VM's endpoint):"
curl -s --max-time 10 "http://$SVC_IP/"
cat <<MSG

IMP is up with a VM running. With
  export KUBECONFIG=$KUBECONFIG PATH=$PWD/bin:\$PATH
try: kubectl get imp -A; kubectl imp list; kubectl imp exec hello -- /bin/app tool-exit 0 hi;
  kubectl imp exec -it hello -- /bin/app tool-tty; kubectl imp logs -f hello; kubectl imp console hello;
  kubectl imp suspend hello; kubectl imp resume hello;
  curl http://$SVC_IP/   (Service hello: kubectl get endpointslices -l kubernetes.io/service-name=hello);
  kubectl imp exec hello -- /bin/app tool-touch /dev/imp-unready   (its readiness probe fails: not Ready, no endpoint)
A whole OS (systemd; docs/os.md), its Debian image built from Debian's packages once (a minute):
  hack/os-image.sh 127.0.0.1:$REGISTRY_PORT/debian:bookworm && kubectl apply -f config/samples/imp_v1alpha1_impvm_os.yaml
  kubectl wait impvm/debian --for=condition=Ready --timeout=300s; kubectl imp exec debian -- systemctl is-system-running
Tear down with: hack/dev-down.sh
MSG
