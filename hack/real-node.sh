#!/usr/bin/env bash
# This machine as a real node of a control plane from start-control-plane.sh: Debian's
# containerd and runc, the kubelet built by setup-control-plane.sh, a CNI bridge for pods,
# images from an OCI registry on 127.0.0.1. The end-to-end tests run the chart's pods on it.
#
# Usage: real-node.sh up STATE CP_STATE   join the control plane of CP_STATE (its pki and
#                                         kubeconfig) as node $NODE_NAME; returns once Ready
#        real-node.sh down STATE          stop it and undo every change it made to the host;
#                                         safe to run again, and after a crashed run
#
# Env: NODE_NAME [imp-host]  REGISTRY (host:port; up pushes the sandbox image there)
#      APISERVER_PORT (the control plane's)  KUBELET_PORT [10350]  KUBELET_HEALTHZ_PORT [10348]
#      POD_CIDR [10.88.0.0/16]  SERVICE_IP [10.0.0.1] (the kubernetes Service's ClusterIP)
#      DNS_IP [10.0.0.10] (the cluster DNS Service's)  COREDNS_PORT [1053]
#      KUBE_PROXY_HEALTHZ_PORT [10346]  KUBE_PROXY_METRICS_PORT [10345]
#      CP_BIN_DIR [$IMP_CACHE/cp/bin] (kubelet, kubectl, kube-proxy, coredns, local-path-provisioner)
#
# The control plane must run with (start-control-plane.sh's APISERVER_EXTRA_ARGS)
#   --kubelet-client-certificate CP_STATE/pki/admin.crt --kubelet-client-key CP_STATE/pki/admin.key
#   --kubelet-preferred-address-types InternalIP --bind-address 0.0.0.0
# so that it reaches the kubelet (logs, exec) and pods reach it. kube-proxy (nftables mode) serves
# the node's Services, the kubernetes Service included (its EndpointSlice names the API server on
# the node's address: the control plane runs --endpoint-reconciler-type none), and CoreDNS
# (a process on the node's address, port COREDNS_PORT) is the cluster DNS behind the kube-dns
# Service at DNS_IP, which the kubelet gives pods. local-path-provisioner serves the StorageClass
# local-path (WaitForFirstConsumer) from directories under STATE/local-path.
#
# What it changes on the host, all undone by down (recorded under STATE): processes (containerd,
# its shims, kubelet), mounts under STATE, the pods' network namespaces and CNI cache, the bridge
# impnode0, /var/lib/cni, a shared tmpfs at STATE/run (for hostPaths that need mount propagation), cgroups kubepods, the sysctls the kubelet rewrites, the nftables table
# imp-node-service (of earlier versions), kube-proxy's tables ip and ip6 kube-proxy,
# /run/containerd/s.
set -euo pipefail
cd "$(dirname "$0")/.."
IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
BIN=${CP_BIN_DIR:-$IMP_CACHE/cp/bin}
NODE_NAME=${NODE_NAME:-imp-host}
KUBELET_PORT=${KUBELET_PORT:-10350}
KUBELET_HEALTHZ_PORT=${KUBELET_HEALTHZ_PORT:-10348}
POD_CIDR=${POD_CIDR:-10.88.0.0/16}
SERVICE_IP=${SERVICE_IP:-10.0.0.1}
DNS_IP=${DNS_IP:-10.0.0.10}
COREDNS_PORT=${COREDNS_PORT:-1053}
KUBE_PROXY_HEALTHZ_PORT=${KUBE_PROXY_HEALTHZ_PORT:-10346}
KUBE_PROXY_METRICS_PORT=${KUBE_PROXY_METRICS_PORT:-10345}
BRIDGE=impnode0
SYSCTLS=(vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys
  kernel/keys/root_maxbytes net/ipv4/ip_forward net/ipv4/conf/all/route_localnet)

log() { printf '[node %s] %s\n' "$(date +%T)" "$*"; }
waitfor() { # seconds description cmd...
  local end=$((SECONDS + $1)) d=$2; shift 2
  until "$@" >/dev/null 2>&1; do ((SECONDS < end)) || { log "timed out: $d"; return 1; }; sleep 0.3; done
}

# prepare fetches what is not built elsewhere, once, into $IMP_CACHE/node: the CNI plugins
# (unpacked from Debian's package, not installed: it would pull in iptables, and with an
# iptables binary present the kubelet adds chains to the host's tables) and devtool (the
# sandbox's pause process, the Service NAT).
prepare() {
  local n=$IMP_CACHE/node
  mkdir -p "$n"
  if [[ ! -x $n/cni/usr/lib/cni/bridge ]]; then
    rm -rf "$n/debs" && mkdir -p "$n/debs"
    (cd "$n/debs" && apt-get download containernetworking-plugins >/dev/null 2>&1 ||
      { apt-get update -qq && apt-get download containernetworking-plugins; })
    rm -rf "$n/cni" && dpkg-deb -x "$n"/debs/containernetworking-plugins_*.deb "$n/cni"
  fi
  CGO_ENABLED=0 go build -o "$n/devtool" ./hack/devtool
}

up() {
  local state=$1 cp=$2
  : "${REGISTRY:?REGISTRY (host:port) is required}" "${APISERVER_PORT:?APISERVER_PORT is required}"
  for b in kubelet kubectl kube-proxy coredns local-path-provisioner; do [[ -x $BIN/$b ]] || { echo "missing $BIN/$b (hack/setup-control-plane.sh)" >&2; exit 1; }; done
  command -v containerd >/dev/null && command -v runc >/dev/null && command -v nft >/dev/null ||
    { echo "containerd, runc or nft (kube-proxy's) is missing (hack/install-prerequisites.sh)" >&2; exit 1; }
  prepare
  local n=$IMP_CACHE/node node_ip
  node_ip=$(ip -4 route get 1.1.1.1 | sed -n 's/.* src \([0-9.]*\).*/\1/p')
  [[ -n $node_ip ]] || { echo "no IPv4 address with a default route: the kubelet needs one" >&2; exit 1; }
  mkdir -p "$state"/{pids,logs,ctrd/certs.d/$REGISTRY,cni/net.d,cni/ipam,kubelet/root,kubelet/pki,kubelet/client,pod-logs}
  state=$(cd "$state" && pwd)
  echo "$cp" >"$state/cp"
  # Before anything changes: what down puts back.
  [[ -f $state/sysctl.orig ]] || for k in "${SYSCTLS[@]}"; do echo "$k $(cat "/proc/sys/$k")"; done >"$state/sysctl.orig"
  ls -d /var/run/netns/cni-* >"$state/netns.before" 2>/dev/null || true
  [[ -d /run/containerd/s ]] && touch "$state/shimdir.before"
  if [[ -d /var/lib/cni ]]; then ls -A /var/lib/cni/results >"$state/cniresults.before" 2>/dev/null || true; fi

  "$n/devtool" image "$REGISTRY/imp-node/pause:1" "$n/devtool" pause >/dev/null
  local sock=$state/ctrd/containerd.sock
  cat >"$state/ctrd/config.toml" <<EOF
version = 2
root = "$state/ctrd/root"
state = "$state/ctrd/state"
[grpc]
  address = "$sock"
[debug]
  address = ""
[metrics]
  address = ""
[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "$state/ctrd/opt"
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "$REGISTRY/imp-node/pause:1"
    # Without CAP_SYS_RESOURCE (containers, CI machines) lowering oom_score_adj fails: clamp it.
    restrict_oom_score_adj = true
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
          Root = "$state/ctrd/runc"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "$n/cni/usr/lib/cni"
      conf_dir = "$state/cni/net.d"
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = "$state/ctrd/certs.d"
EOF
  printf 'server = "http://%s"\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' "$REGISTRY" "$REGISTRY" \
    >"$state/ctrd/certs.d/$REGISTRY/hosts.toml"
  # Pods on a bridge holding the gateway address. isGateway=false: the plugin would turn on the
  # host's ip_forward; pods reach the host and each other without it.
  local gw
  gw=$(awk -F'[./]' '{printf "%d.%d.%d.%d", $1,$2,$3,$4+1}' <<<"$POD_CIDR")
  cat >"$state/cni/net.d/10-impnode.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "impnode", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": false, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$state/cni/ipam", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$gw"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}}
]}
EOF
  # STATE/run is a shared tmpfs, as /run is on a systemd host: hostPath volumes with
  # Bidirectional propagation (the agent's network.nsDir) must be on a shared mount.
  mkdir -p "$state/run"
  mountpoint -q "$state/run" || { mount -t tmpfs -o mode=0755 imp-node-run "$state/run" && mount --make-shared "$state/run"; }
  ip link show "$BRIDGE" >/dev/null 2>&1 || {
    ip link add "$BRIDGE" type bridge && ip addr add "$gw/${POD_CIDR#*/}" dev "$BRIDGE" && ip link set "$BRIDGE" up; }

  setsid containerd --config "$state/ctrd/config.toml" >"$state/logs/containerd.log" 2>&1 </dev/null &
  echo $! >"$state/pids/containerd.pid"
  waitfor 30 "containerd" ctr -a "$sock" version

  # The kubelet's client identity: system:node:<name>, signed by the cluster's CA. Not in its
  # --cert-dir, where it keeps its serving pair.
  local c=$state/kubelet/client
  printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >"$c/ext"
  openssl req -newkey rsa:2048 -nodes -subj "/CN=system:node:$NODE_NAME/O=system:nodes" -keyout "$c/key" -out "$c/csr" 2>/dev/null
  openssl x509 -req -in "$c/csr" -CA "$cp/pki/ca.crt" -CAkey "$cp/pki/ca.key" -CAcreateserial -days 2 \
    -extfile "$c/ext" -out "$c/crt" 2>/dev/null
  cat >"$state/kubelet/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: cp, cluster: {server: "https://127.0.0.1:$APISERVER_PORT", certificate-authority: $cp/pki/ca.crt}}]
users: [{name: kubelet, user: {client-certificate: $c/crt, client-key: $c/key}}]
contexts: [{name: cp, context: {cluster: cp, user: kubelet}}]
current-context: cp
EOF
  cat >"$state/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false                 # hosts still on cgroup v1 (this one is hybrid)
cgroupDriver: cgroupfs              # containerd 1.6 cannot tell the kubelet its driver
containerRuntimeEndpoint: unix://$sock
address: $node_ip                   # the kubelet refuses a loopback node address
port: $KUBELET_PORT
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
readOnlyPort: 0
authentication: {anonymous: {enabled: false}, webhook: {enabled: true}, x509: {clientCAFile: $cp/pki/ca.crt}}
authorization: {mode: Webhook}
podLogsDir: $state/pod-logs
clusterDomain: cluster.local
clusterDNS: [$DNS_IP]
resolvConf: /etc/resolv.conf
oomScoreAdj: 0                      # without CAP_SYS_RESOURCE -999 cannot be set
evictionHard: {memory.available: "100Mi", nodefs.available: "2%", imagefs.available: "2%", nodefs.inodesFree: "2%"}
serializeImagePulls: false
EOF
  setsid "$BIN/kubelet" --config "$state/kubelet/config.yaml" --kubeconfig "$state/kubelet/kubeconfig" \
    --root-dir "$state/kubelet/root" --cert-dir "$state/kubelet/pki" --hostname-override "$NODE_NAME" \
    --node-ip "$node_ip" --v=2 >"$state/logs/kubelet.log" 2>&1 </dev/null &
  echo $! >"$state/pids/kubelet.pid"
  local kc=("$BIN/kubectl" --kubeconfig "$cp/kubeconfig")
  waitfor 120 "node $NODE_NAME Ready" bash -c \
    "[[ \$(${kc[*]} get node $NODE_NAME -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}') == True ]]"
  log "node $NODE_NAME ($node_ip) Ready"
  services "$state" "$cp" "$node_ip"
  storage "$state" "$cp"
}

# storage runs rancher's local-path-provisioner, as kind and k3s clusters have it: the class
# local-path (WaitForFirstConsumer, reclaim Delete) makes each claim a directory under
# STATE/local-path on the node its first consumer is scheduled to, through a helper pod whose
# command is devtool's (hack/devtool/localpath.go: there is no busybox image here).
storage() {
  local state=$1 cp=$2
  local kc=("$BIN/kubectl" --kubeconfig "$cp/kubeconfig") n=$IMP_CACHE/node
  mkdir -p "$state/local-path/volumes"
  "$n/devtool" image "$REGISTRY/imp-node/local-path-helper:1" "$n/devtool" >/dev/null
  cat >"$state/local-path/config.json" <<EOF
{"nodePathMap": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": ["$state/local-path/volumes"]}],
 "setupCommand": "/bin/app", "teardownCommand": "/bin/app", "cmdTimeoutSeconds": 60}
EOF
  cat >"$state/local-path/helper-pod.yaml" <<EOF
apiVersion: v1
kind: Pod
metadata: {name: helper-pod}
spec:
  containers:
  - {name: helper-pod, image: "$REGISTRY/imp-node/local-path-helper:1", imagePullPolicy: IfNotPresent}
EOF
  cat <<EOF | "${kc[@]}" apply -f - >/dev/null
apiVersion: v1
kind: Namespace
metadata: {name: local-path-storage}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: local-path-provisioner-service-account, namespace: local-path-storage}
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: local-path}
provisioner: rancher.io/local-path
volumeBindingMode: WaitForFirstConsumer
reclaimPolicy: Delete
EOF
  setsid "$BIN/local-path-provisioner" --debug start --kubeconfig "$cp/kubeconfig" --namespace local-path-storage \
    --config "$state/local-path/config.json" --helper-pod-file "$state/local-path/helper-pod.yaml" \
    --helper-image "$REGISTRY/imp-node/local-path-helper:1" \
    --service-account-name local-path-provisioner-service-account \
    >"$state/logs/local-path-provisioner.log" 2>&1 </dev/null &
  echo $! >"$state/pids/local-path-provisioner.pid"
  log "local-path-provisioner serves the class local-path from $state/local-path/volumes"
}

# services runs what serves the cluster's Services on the node: kube-proxy, CoreDNS, and the
# EndpointSlices of the kubernetes and kube-dns Services (no controller keeps those here).
services() {
  local state=$1 cp=$2 node_ip=$3
  local kc=("$BIN/kubectl" --kubeconfig "$cp/kubeconfig")
  cat <<EOF | "${kc[@]}" apply -f - >/dev/null
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kubernetes-node
  namespace: default
  labels: {kubernetes.io/service-name: kubernetes, endpointslice.kubernetes.io/managed-by: imp-real-node}
addressType: IPv4
endpoints: [{addresses: ["$node_ip"], conditions: {ready: true}}]
ports: [{name: https, port: $APISERVER_PORT, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  clusterIP: $DNS_IP
  ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-node
  namespace: kube-system
  labels: {kubernetes.io/service-name: kube-dns, endpointslice.kubernetes.io/managed-by: imp-real-node}
addressType: IPv4
endpoints: [{addresses: ["$node_ip"], conditions: {ready: true}}]
ports: [{name: dns, port: $COREDNS_PORT, protocol: UDP}, {name: dns-tcp, port: $COREDNS_PORT, protocol: TCP}]
EOF
  cat >"$state/Corefile" <<EOF
.:$COREDNS_PORT {
    bind $node_ip
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $cp/kubeconfig
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
EOF
  setsid "$BIN/coredns" -conf "$state/Corefile" >"$state/logs/coredns.log" 2>&1 </dev/null &
  echo $! >"$state/pids/coredns.pid"
  setsid "$BIN/kube-proxy" --proxy-mode nftables --kubeconfig "$cp/kubeconfig" --hostname-override "$NODE_NAME" \
    --cluster-cidr "$POD_CIDR" --nodeport-addresses primary --healthz-bind-address "127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT" \
    --metrics-bind-address "127.0.0.1:$KUBE_PROXY_METRICS_PORT" --conntrack-max-per-core 0 \
    --conntrack-tcp-timeout-established 0 --conntrack-tcp-timeout-close-wait 0 --v=2 \
    >"$state/logs/kube-proxy.log" 2>&1 </dev/null &
  echo $! >"$state/pids/kube-proxy.pid"
  waitfor 60 "kube-proxy healthy" curl -sf "http://127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT/healthz"
  waitfor 60 "the kubernetes Service through kube-proxy" curl -sk "https://$SERVICE_IP/healthz"
  log "kube-proxy (nftables) and CoreDNS ($node_ip:$COREDNS_PORT behind $DNS_IP) serve the node's Services"
}

stop_pid() { # file
  [[ -f $1 ]] || return 0
  local pid; pid=$(cat "$1")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

down() {
  local state=$1
  [[ -d $state ]] || return 0
  state=$(cd "$state" && pwd)
  set +e
  local sock=$state/ctrd/containerd.sock n=$IMP_CACHE/node
  stop_pid "$state/pids/kubelet.pid"
  stop_pid "$state/pids/kube-proxy.pid"
  stop_pid "$state/pids/coredns.pid"
  stop_pid "$state/pids/local-path-provisioner.pid"
  if command -v nft >/dev/null; then
    nft delete table ip kube-proxy 2>/dev/null
    nft delete table ip6 kube-proxy 2>/dev/null
  fi
  # Containers: through containerd while it runs, then every shim of ours by its socket.
  if [[ -S $sock ]]; then
    local id
    for id in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do ctr -a "$sock" -n k8s.io tasks kill -s KILL "$id"; done
    sleep 1
    for id in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do ctr -a "$sock" -n k8s.io tasks delete -f "$id"; done
  fi
  stop_pid "$state/pids/containerd.pid"
  local p
  for p in $(grep -l -a -F -- "$sock" /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3); do
    [[ $(cat "/proc/$p/comm" 2>/dev/null) == containerd-shim* ]] && kill -KILL "$p"
  done
  # Container processes whose shim is gone (hostPID containers are not in a PID namespace of
  # their own): those still in kubepods cgroups.
  local c
  for c in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/unified/kubepods; do
    [[ -d $c ]] && find "$c" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -KILL 2>/dev/null
  done
  sleep 0.5
  # Mounts under STATE (the kubelet's root, volumes, container root file systems), deepest first.
  awk -v s="$state/" 'index($5, s) == 1 {print $5}' /proc/self/mountinfo | sort -r | xargs -r -n1 umount -l
  for p in /var/run/netns/cni-*; do
    [[ -e $p ]] && ! grep -qxF "$p" "$state/netns.before" 2>/dev/null && { umount "$p" 2>/dev/null; rm -f "$p"; }
  done
  [[ -f $state/shimdir.before ]] || rmdir /run/containerd/s /run/containerd 2>/dev/null
  # The CNI results containerd cached (its loopback's, ours): all of them when it made the
  # directory, else those that appeared.
  if [[ -f $state/cniresults.before ]]; then
    for p in /var/lib/cni/results/*; do
      [[ -e $p ]] && ! grep -qxF "${p##*/}" "$state/cniresults.before" && rm -f "$p"
    done
  else
    rm -rf /var/lib/cni
  fi
  ip link del "$BRIDGE" 2>/dev/null
  [[ -x $n/devtool ]] && "$n/devtool" service-nat down
  for c in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/unified/kubepods; do
    [[ -d $c ]] && find "$c" -depth -type d -exec rmdir {} + 2>/dev/null
  done
  if [[ -f $state/sysctl.orig ]]; then
    local k v
    while read -r k v; do echo "$v" >"/proc/sys/$k"; done <"$state/sysctl.orig"
  fi
  if awk -v s="$state/" 'index($5, s) == 1 {f=1} END {exit !f}' /proc/self/mountinfo; then
    log "mounts remain under $state: leaving it"
    return 1
  fi
  rm -rf "$state"
  log "down: $state removed, host restored"
}

case ${1:-} in
  up) up "${2:?STATE}" "${3:?CP_STATE}" ;;
  down) down "${2:?STATE}" ;;
  prepare) prepare ;;
  *) echo "usage: $0 up STATE CP_STATE | down STATE | prepare" >&2; exit 2 ;;
esac
