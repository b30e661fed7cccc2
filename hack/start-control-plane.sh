#!/usr/bin/env bash
# Start a local Kubernetes control plane on loopback: etcd, kube-apiserver and, when their
# binaries exist, kube-controller-manager, kube-scheduler and kwok (fake nodes/pods).
# Binaries come from setup-control-plane.sh.
#
# Usage: start-control-plane.sh [STATE_DIR]            (default: $IMP_CACHE/cp/state)
# Writes STATE_DIR/kubeconfig (admin, system:masters) and STATE_DIR/env; PIDs in
# STATE_DIR/pids, logs in STATE_DIR/logs. Stop with stop-control-plane.sh [STATE_DIR].
#
# Env (defaults in brackets):
#   CP_BIN_DIR [$IMP_CACHE/cp/bin]
#   ETCD_PORT [12379]  ETCD_PEER_PORT [12380]  APISERVER_PORT [16443]
#   KCM_PORT [10257]  SCHEDULER_PORT [10259]  KWOK_PORT [10247]
#   WITH_KCM [1]  WITH_SCHEDULER [1]  WITH_KWOK [1]   (0 = don't start; also skipped if
#                                                      the binary is missing)
#   WITH_REGISTRY [0]  REGISTRY_PORT [15000]  (in-memory OCI registry for `helm push
#                      oci://127.0.0.1:15000/charts --plain-http`)
#   SERVICE_CIDR [10.0.0.0/24]  POD_CIDR [10.244.0.0/16] (kwok's fake pod IPs)
#   START_TIMEOUT [120] seconds per component
#   KWOK_EXTRA_STAGES  a file of further kwok Stage objects (tests add failure stages)
#   APISERVER_EXTRA_ARGS, KCM_EXTRA_ARGS, SCHEDULER_EXTRA_ARGS, ETCD_EXTRA_ARGS (word-split)
# Fake nodes for kwok: create Nodes with annotation kwok.x-k8s.io/node=fake
# (see STATE_DIR/kwok-example-node.yaml).
set -euo pipefail

STATE=${1:-${IMP_CACHE:-$HOME/.cache/imp}/cp/state}
BIN=${CP_BIN_DIR:-${IMP_CACHE:-$HOME/.cache/imp}/cp/bin}
ETCD_PORT=${ETCD_PORT:-12379}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-12380}
APISERVER_PORT=${APISERVER_PORT:-16443}
KCM_PORT=${KCM_PORT:-10257}
SCHEDULER_PORT=${SCHEDULER_PORT:-10259}
KWOK_PORT=${KWOK_PORT:-10247}
WITH_KCM=${WITH_KCM:-1}
WITH_SCHEDULER=${WITH_SCHEDULER:-1}
WITH_KWOK=${WITH_KWOK:-1}
WITH_REGISTRY=${WITH_REGISTRY:-0}
REGISTRY_PORT=${REGISTRY_PORT:-15000}
SERVICE_CIDR=${SERVICE_CIDR:-10.0.0.0/24}
POD_CIDR=${POD_CIDR:-10.244.0.0/16}
START_TIMEOUT=${START_TIMEOUT:-120}

mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd)
PKI=$STATE/pki LOGS=$STATE/logs PIDS=$STATE/pids
mkdir -p "$PKI" "$LOGS" "$PIDS"
T0=$(date +%s.%N)

log() { printf '[start %s] %s\n' "$(date +%T)" "$*"; }
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1fs", b-a}'; }
die() { echo "ERROR: $*" >&2; "$(dirname "$0")/stop-control-plane.sh" "$STATE" >&2 || true; exit 1; }

for b in etcd kube-apiserver; do
  [[ -x $BIN/$b ]] || { echo "missing $BIN/$b (run setup-control-plane.sh)" >&2; exit 1; }
done
command -v openssl >/dev/null || { echo "openssl not found" >&2; exit 1; }
command -v curl >/dev/null || { echo "curl not found" >&2; exit 1; }

for f in "$PIDS"/*.pid; do
  [[ -e $f ]] || continue
  if kill -0 "$(cat "$f")" 2>/dev/null; then
    echo "already running ($f); run stop-control-plane.sh $STATE first" >&2; exit 1
  fi
  rm -f "$f"
done

# ---------------------------------------------------------------- PKI (once per STATE)
gen_pki() {
  [[ -f $PKI/.done ]] && return
  log "generating PKI in $PKI"
  local o="openssl"
  $o req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=cp-test-ca" \
    -keyout "$PKI/ca.key" -out "$PKI/ca.crt" 2>/dev/null
  # serving cert for the apiserver; 10.0.0.1 = first IP of the default SERVICE_CIDR
  local svc_ip
  svc_ip=$(awk -F'[./]' '{printf "%d.%d.%d.%d", $1,$2,$3,$4+1}' <<<"$SERVICE_CIDR")
  cat >"$PKI/apiserver.ext" <<EOF
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:$svc_ip,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
  $o req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" -keyout "$PKI/apiserver.key" \
    -out "$PKI/apiserver.csr" 2>/dev/null
  $o x509 -req -in "$PKI/apiserver.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -extfile "$PKI/apiserver.ext" -out "$PKI/apiserver.crt" 2>/dev/null
  # client certs: name|CN|O
  printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >"$PKI/client.ext"
  local spec name cn org
  for spec in "admin|admin|system:masters" \
              "kube-controller-manager|system:kube-controller-manager|" \
              "kube-scheduler|system:kube-scheduler|" \
              "kwok|kwok|system:masters"; do
    IFS='|' read -r name cn org <<<"$spec"
    $o req -newkey rsa:2048 -nodes -subj "/CN=$cn${org:+/O=$org}" -keyout "$PKI/$name.key" \
      -out "$PKI/$name.csr" 2>/dev/null
    $o x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
      -days 3650 -extfile "$PKI/client.ext" -out "$PKI/$name.crt" 2>/dev/null
  done
  # service-account token signing key pair
  $o genrsa -out "$PKI/sa.key" 2048 2>/dev/null
  $o rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  # static bearer token for the admin user (handy for curl)
  echo "$($o rand -hex 16),admin-token,admin-token-uid,system:masters" >"$PKI/tokens.csv"
  rm -f "$PKI"/*.csr
  touch "$PKI/.done"
}

# The front proxy, as kubeadm sets one up: the API server proxies aggregated APIs (IMP's
# subresources.imp.dev) with this client certificate and the user in X-Remote-User. Apart from
# gen_pki so that a STATE made before it gets it too.
gen_front_proxy() {
  [[ -f $PKI/front-proxy-client.crt ]] && return
  local o="openssl"
  $o req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=front-proxy-ca" \
    -keyout "$PKI/front-proxy-ca.key" -out "$PKI/front-proxy-ca.crt" 2>/dev/null
  $o req -newkey rsa:2048 -nodes -subj "/CN=front-proxy-client" -keyout "$PKI/front-proxy-client.key" \
    -out "$PKI/front-proxy-client.csr" 2>/dev/null
  $o x509 -req -in "$PKI/front-proxy-client.csr" -CA "$PKI/front-proxy-ca.crt" -CAkey "$PKI/front-proxy-ca.key" \
    -CAcreateserial -days 3650 -extfile "$PKI/client.ext" -out "$PKI/front-proxy-client.crt" 2>/dev/null
  rm -f "$PKI"/*.csr
}

write_kubeconfig() { # name file
  local name=$1 out=$2
  cat >"$out" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: cp
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority-data: $(base64 -w0 <"$PKI/ca.crt")
users:
- name: $name
  user:
    client-certificate-data: $(base64 -w0 <"$PKI/$name.crt")
    client-key-data: $(base64 -w0 <"$PKI/$name.key")
contexts:
- name: cp
  context: {cluster: cp, user: $name}
current-context: cp
EOF
  chmod 600 "$out"
}

# start NAME BINARY ARGS...: start in background, record PID
start() {
  local name=$1; shift
  nohup "$@" >"$LOGS/$name.log" 2>&1 </dev/null &
  echo $! >"$PIDS/$name.pid"
}

# wait_ok NAME CMD...: poll CMD until it succeeds, fail if the process died or timed out
wait_ok() {
  local name=$1; shift
  local t0 pid
  t0=$(date +%s.%N)
  pid=$(cat "$PIDS/$name.pid")
  local deadline=$((SECONDS + START_TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 25 "$LOGS/$name.log" >&2; die "$name exited during startup (log: $LOGS/$name.log)"
    fi
    ((SECONDS < deadline)) || { tail -n 25 "$LOGS/$name.log" >&2; die "$name not ready after ${START_TIMEOUT}s"; }
    sleep 0.2
  done
  log "$name ready (pid $pid) after $(elapsed "$t0")"
}

ADMIN_CURL=(curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key")

gen_pki
gen_front_proxy
write_kubeconfig admin "$STATE/kubeconfig"
write_kubeconfig kube-controller-manager "$STATE/kube-controller-manager.kubeconfig"
write_kubeconfig kube-scheduler "$STATE/kube-scheduler.kubeconfig"
write_kubeconfig kwok "$STATE/kwok.kubeconfig"

# ---------------------------------------------------------------- etcd
etcd_args=(
  --name default --data-dir "$STATE/etcd"
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT"
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT"
  --initial-cluster "default=http://127.0.0.1:$ETCD_PEER_PORT"
)
# test-only speedup, etcd >= 3.5 (Debian's 3.4 lacks it)
if "$BIN/etcd" --help 2>&1 | grep -q -- '--unsafe-no-fsync'; then etcd_args+=(--unsafe-no-fsync); fi
# shellcheck disable=SC2206
etcd_args+=(${ETCD_EXTRA_ARGS:-})
start etcd "$BIN/etcd" "${etcd_args[@]}"
wait_ok etcd curl -sf "http://127.0.0.1:$ETCD_PORT/health"

# ---------------------------------------------------------------- kube-apiserver
# shellcheck disable=SC2054  # "Node,RBAC" is one flag value
apiserver_args=(
  --etcd-servers "http://127.0.0.1:$ETCD_PORT"
  --bind-address 127.0.0.1 --secure-port "$APISERVER_PORT"
  # 127.0.0.1 is rejected by the default (lease) endpoint reconciler since it is loopback:
  # "cannot use public IP 127.0.0.1 with endpoint reconciler ... may not be in the loopback range".
  --advertise-address 127.0.0.1 --endpoint-reconciler-type none
  --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key"
  --client-ca-file "$PKI/ca.crt" --token-auth-file "$PKI/tokens.csv"
  --service-account-issuer https://kubernetes.default.svc.cluster.local
  --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key"
  --service-cluster-ip-range "$SERVICE_CIDR"
  --authorization-mode Node,RBAC
  --allow-privileged=true
  --requestheader-client-ca-file "$PKI/front-proxy-ca.crt" --requestheader-allowed-names front-proxy-client
  --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group
  --requestheader-extra-headers-prefix X-Remote-Extra-
  --proxy-client-cert-file "$PKI/front-proxy-client.crt" --proxy-client-key-file "$PKI/front-proxy-client.key"
  # No kube-proxy here: aggregated APIs are reached at their Services' endpoints, not ClusterIPs.
  --enable-aggregator-routing=true
)
# shellcheck disable=SC2206
apiserver_args+=(${APISERVER_EXTRA_ARGS:-})
start kube-apiserver "$BIN/kube-apiserver" "${apiserver_args[@]}"
wait_ok kube-apiserver "${ADMIN_CURL[@]}" "https://127.0.0.1:$APISERVER_PORT/readyz"

# ---------------------------------------------------------------- controller-manager
if [[ $WITH_KCM == 1 && -x $BIN/kube-controller-manager ]]; then
  K=$STATE/kube-controller-manager.kubeconfig
  kcm_args=(
    --kubeconfig "$K" --authentication-kubeconfig "$K" --authorization-kubeconfig "$K"
    --bind-address 127.0.0.1 --secure-port "$KCM_PORT" --leader-elect=false
    --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt"
    --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key"
    --use-service-account-credentials=true --cluster-name cp
  )
  # shellcheck disable=SC2206
  kcm_args+=(${KCM_EXTRA_ARGS:-})
  start kube-controller-manager "$BIN/kube-controller-manager" "${kcm_args[@]}"
  wait_ok kube-controller-manager curl -skf "https://127.0.0.1:$KCM_PORT/healthz"
fi

# ---------------------------------------------------------------- scheduler
if [[ $WITH_SCHEDULER == 1 && -x $BIN/kube-scheduler ]]; then
  K=$STATE/kube-scheduler.kubeconfig
  sched_args=(
    --kubeconfig "$K" --authentication-kubeconfig "$K" --authorization-kubeconfig "$K"
    --bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT" --leader-elect=false
  )
  # shellcheck disable=SC2206
  sched_args+=(${SCHEDULER_EXTRA_ARGS:-})
  start kube-scheduler "$BIN/kube-scheduler" "${sched_args[@]}"
  wait_ok kube-scheduler curl -skf "https://127.0.0.1:$SCHEDULER_PORT/healthz"
fi

# ---------------------------------------------------------------- kwok
if [[ $WITH_KWOK == 1 && -x $BIN/kwok && -f $BIN/kwok-stages.yaml ]]; then
  cat >"$STATE/kwok.yaml" <<EOF
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  manageAllNodes: false
  manageNodesWithAnnotationSelector: kwok.x-k8s.io/node=fake
  # kwok leaves the status of nodes with this annotation alone (no initialize/heartbeat
  # stages; the node lease is still renewed), e.g. to hold Ready=False (the stock
  # node-initialize stage resets a Ready=False node at once). Deprecated in kwok ("use
  # Stage API instead") but honoured by v0.8.0. Seen: when a (re)started kwok takes over
  # the node lease it runs the stages once more for that node, annotation or not.
  disregardStatusWithAnnotationSelector: kwok.x-k8s.io/status=custom
  cidr: $POD_CIDR
  nodeIP: 10.240.0.1
  nodeLeaseDurationSeconds: 40
  # kwok does not default these when a config file is given ("node leases parallelism
  # must be greater than 0")
  nodeLeaseParallelism: 4
  podPlayStageParallelism: 4
  nodePlayStageParallelism: 4
  podsOnNodeSyncParallelism: 1
---
$(cat "$BIN/kwok-stages.yaml")
$(if [[ -n ${KWOK_EXTRA_STAGES:-} ]]; then printf -- '---\n'; cat "$KWOK_EXTRA_STAGES"; fi)
EOF
  cat >"$STATE/kwok-example-node.yaml" <<'EOF'
apiVersion: v1
kind: Node
metadata:
  name: fake-node-1
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels: {type: kwok, kubernetes.io/hostname: fake-node-1, kubernetes.io/os: linux, kubernetes.io/arch: amd64}
spec:
  taints: [{key: kwok.x-k8s.io/node, value: fake, effect: NoSchedule}]
EOF
  start kwok "$BIN/kwok" --kubeconfig "$STATE/kwok.kubeconfig" --config "$STATE/kwok.yaml" \
    --server-address "127.0.0.1:$KWOK_PORT"
  wait_ok kwok curl -sf "http://127.0.0.1:$KWOK_PORT/healthz"
fi

# ---------------------------------------------------------------- OCI registry (optional)
if [[ $WITH_REGISTRY == 1 && -x $BIN/registry ]]; then
  # go-containerregistry's in-memory registry: plain HTTP, localhost only, lost on stop
  start registry "$BIN/registry" -port "$REGISTRY_PORT"
  wait_ok registry curl -sf "http://127.0.0.1:$REGISTRY_PORT/v2/"
fi

cat >"$STATE/env" <<EOF
export KUBECONFIG=$STATE/kubeconfig
export KUBEBUILDER_ASSETS=$BIN
export CP_STATE_DIR=$STATE
export CP_ADMIN_TOKEN=$(cut -d, -f1 "$PKI/tokens.csv")
export CP_APISERVER=https://127.0.0.1:$APISERVER_PORT
export PATH=$BIN:\$PATH
EOF
if [[ -f $PIDS/registry.pid ]]; then echo "export CP_OCI_REGISTRY=127.0.0.1:$REGISTRY_PORT" >>"$STATE/env"; fi
log "control plane up in $(elapsed "$T0"): KUBECONFIG=$STATE/kubeconfig (source $STATE/env)"
