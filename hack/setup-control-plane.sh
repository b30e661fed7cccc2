#!/usr/bin/env bash
# Build (from the Go module proxy only) and install the binaries of a local
# Kubernetes control plane for integration tests:
#   etcd, etcdctl                      go.etcd.io/etcd/{server,etcdctl}/v3
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet, kube-proxy
#                                      k8s.io/kubernetes (throwaway module + replaces)
#   coredns                            github.com/coredns/coredns (the cluster DNS of the
#                                      e2e's real node and of make dev)
#   local-path-provisioner             github.com/rancher/local-path-provisioner (dynamic local
#                                      volumes of the e2e's real node, as kind and k3s have them)
#   kwok                               sigs.k8s.io/kwok/cmd/kwok
#   helm                               helm.sh/helm/v3/cmd/helm
#   otelcol                            an OpenTelemetry Collector (OTLP receiver, file exporter)
#                                      from hack/otelcol (its own module: go.opentelemetry.io/collector
#                                      v0.161.0, the contrib file exporter), the e2e's trace sink
#   registry (OCI registry, in-memory, `registry -port N`, listens on localhost only)
#                                      github.com/google/go-containerregistry/cmd/registry
# plus kwok-stages.yaml (kwok Stage objects, see below) next to the binaries.
#
# Usage: setup-control-plane.sh [DEST_DIR]        (default: $IMP_CACHE/cp/bin, IMP_CACHE=~/.cache/imp)
# The DEST_DIR can be used directly as KUBEBUILDER_ASSETS for controller-runtime envtest
# (it holds etcd, kube-apiserver and kubectl).
#
# Re-runnable: a binary that already exists in DEST_DIR is not rebuilt (delete it to
# rebuild). Builds are done in GOPATH-free module dirs under $CP_BUILD_DIR and use the
# normal Go module and build caches, so a second build of another k8s binary is incremental.
#
# Env overrides (defaults in brackets):
#   K8S_VERSION [1.37.2]  ETCD_VERSION [3.6.16]  KWOK_VERSION [v0.8.0]
#   HELM_VERSION [v3.22.0]  GGCR_VERSION [v0.22.1]  CP_BUILD_DIR [$IMP_CACHE/cp/build]
#   DISTRIBUTION_VERSION [v3.1.2]  COREDNS_VERSION [v1.15.0]  LOCAL_PATH_VERSION [v0.0.30]
#   COMPONENTS ["etcd k8s kwok helm registry coredns localpath otelcol"]   (subset to build; add "distribution" for
#               the CNCF registry as DEST/distribution-registry)
# Cold-cache wall times seen on a 2-core VM shared with other work: kube-apiserver 22 min
# (21 CPU-min), then kube-controller-manager 3.2 min, kube-scheduler 16 s, kubectl 1 min,
# etcd 1.7 min, kwok 2.7 min, helm 2.3 min, ggcr registry seconds. With warm Go caches and
# no binaries in DEST the whole script took 57 s. Disk: module cache ~3 GB, build cache ~6 GB.
set -euo pipefail

IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
DEST=${1:-$IMP_CACHE/cp/bin}
K8S_VERSION=${K8S_VERSION:-1.37.2}
ETCD_VERSION=${ETCD_VERSION:-3.6.16}
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
HELM_VERSION=${HELM_VERSION:-v3.22.0}
GGCR_VERSION=${GGCR_VERSION:-v0.22.1}
DISTRIBUTION_VERSION=${DISTRIBUTION_VERSION:-v3.1.2}
COREDNS_VERSION=${COREDNS_VERSION:-v1.15.0}
LOCAL_PATH_VERSION=${LOCAL_PATH_VERSION:-v0.0.30}
CP_BUILD_DIR=${CP_BUILD_DIR:-$IMP_CACHE/cp/build}
COMPONENTS=${COMPONENTS:-"etcd k8s kwok helm registry coredns localpath otelcol"}

command -v go >/dev/null || { echo "go not found in PATH" >&2; exit 1; }
mkdir -p "$DEST" "$CP_BUILD_DIR"
DEST=$(cd "$DEST" && pwd)
export GOFLAGS="${GOFLAGS:-} -buildvcs=false"
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}

log() { printf '[setup %s] %s\n' "$(date +%T)" "$*"; }
want() { [[ " $COMPONENTS " == *" $1 "* ]]; }
have() { [[ -x "$DEST/$1" ]]; }

# timed CMD...: run and print the wall time
timed() {
  local t0=$SECONDS
  "$@"
  log "  done in $((SECONDS - t0))s"
}

build_etcd() {
  if have etcd && have etcdctl; then log "etcd, etcdctl: present, skipping"; return; fi
  local dir="$CP_BUILD_DIR/etcd-v$ETCD_VERSION"
  mkdir -p "$dir"
  # go.etcd.io/etcd/server/v3's go.mod has replace directives, so
  # `go install go.etcd.io/etcd/server/v3@vX` is refused; build from a throwaway module.
  if [[ ! -f "$dir/go.sum" ]]; then
    cat >"$dir/go.mod" <<EOF
module cpbuild/etcd

go 1.26.0

require (
	go.etcd.io/etcd/server/v3 v$ETCD_VERSION
	go.etcd.io/etcd/etcdctl/v3 v$ETCD_VERSION
)
EOF
    cat >"$dir/tools.go" <<'EOF'
//go:build tools

package tools

import (
	_ "go.etcd.io/etcd/etcdctl/v3"
	_ "go.etcd.io/etcd/server/v3"
)
EOF
    (cd "$dir" && go mod tidy)
  fi
  log "building etcd v$ETCD_VERSION"
  (cd "$dir" && timed go build -trimpath -ldflags "-s -w" -o "$DEST/etcd" go.etcd.io/etcd/server/v3)
  (cd "$dir" && timed go build -trimpath -ldflags "-s -w" -o "$DEST/etcdctl" go.etcd.io/etcd/etcdctl/v3)
}

build_k8s() {
  local bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy) b missing=()
  for b in "${bins[@]}"; do have "$b" || missing+=("$b"); done
  if ((${#missing[@]} == 0)); then log "kubernetes binaries: present, skipping"; return; fi
  local dir="$CP_BUILD_DIR/k8s-v$K8S_VERSION"
  local minor=${K8S_VERSION#*.}; minor=${minor%%.*}
  local staging_version="v0.${K8S_VERSION#*.}"          # 1.37.2 -> v0.37.2
  mkdir -p "$dir"
  # The kubelet and kube-proxy joined the list later: a module resolved without them is
  # resolved again.
  if [[ ! -f "$dir/go.sum" ]] || ! grep -q cmd/kube-proxy "$dir/tools.go" 2>/dev/null; then
    # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with
    # ./staging/...; `go install k8s.io/kubernetes/cmd/...@v` is therefore refused.
    # Replace every v0.0.0 staging requirement with the published staging version.
    local kmod
    kmod=$(cd "$dir" && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" |
      sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
    [[ -f "$kmod" ]] || { echo "cannot find go.mod of k8s.io/kubernetes@v$K8S_VERSION" >&2; exit 1; }
    {
      printf 'module cpbuild/k8s\n\ngo 1.26.0\n\nrequire k8s.io/kubernetes v%s\n\nreplace (\n' "$K8S_VERSION"
      awk -v v="$staging_version" '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" && NF == 2 {printf "\t%s => %s %s\n", $1, $1, v}' "$kmod"
      printf ')\n'
    } >"$dir/go.mod"
    cat >"$dir/tools.go" <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
EOF
    log "resolving k8s.io/kubernetes v$K8S_VERSION dependencies (go mod tidy)"
    (cd "$dir" && timed go mod tidy)
  fi
  # Same version stamping as hack/lib/version.sh (without it: v0.0.0-master+$Format:%H$,
  # which breaks kubectl/helm version checks).
  local ldf="-s -w" kv
  for kv in "gitVersion=v$K8S_VERSION" "gitMajor=1" "gitMinor=$minor" "gitTreeState=clean"; do
    ldf+=" -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
  done
  for b in "${missing[@]}"; do
    log "building $b v$K8S_VERSION"
    (cd "$dir" && timed go build -ldflags "$ldf" -o "$DEST/$b" "k8s.io/kubernetes/cmd/$b")
  done
}

write_kwok_stages() {
  local out="$DEST/kwok-stages.yaml"
  [[ -f "$out" ]] && { log "kwok-stages.yaml: present, skipping"; return; }
  local kdir
  kdir=$(cd "$CP_BUILD_DIR" && GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  local s="$kdir/kustomize/stage"
  {
    echo "# kwok Stages: stock node-initialize, pod-ready, pod-complete, pod-delete from"
    echo "# sigs.k8s.io/kwok@$KWOK_VERSION kustomize/stage, plus a node heartbeat that keeps"
    echo "# node conditions as they are (the stock node-heartbeat re-renders them all from"
    echo "# NodeConditions, so a MemoryPressure=True status patch is reverted within 20-45 s)."
    for f in node/fast/node-initialize.yaml pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
      echo '---'; cat "$s/$f"
    done
    cat <<'EOF'
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-heartbeat-keep-conditions
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.phase'
      operator: 'In'
      values:
      - 'Running'
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'In'
      values:
      - 'True'
  delay:
    durationMilliseconds: 20000
    jitterDurationMilliseconds: 25000
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      {{ range .status.conditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ .lastTransitionTime | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type | Quote }}
      {{ end }}
EOF
  } >"$out.tmp"
  mv "$out.tmp" "$out"
  log "wrote $out"
}

build_kwok() {
  if have kwok; then log "kwok: present, skipping"; else
    log "building kwok $KWOK_VERSION"
    (cd "$CP_BUILD_DIR" && GOBIN="$DEST" timed go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION")
  fi
  write_kwok_stages
}

build_helm() {
  if have helm; then log "helm: present, skipping"; return; fi
  # Stamp like helm's Makefile does: without these, `helm version` says "v3.22" and the
  # offline default Capabilities.KubeVersion (helm template / lint) is v1.20.0.
  local hmod cg_minor ldf
  hmod=$(cd "$CP_BUILD_DIR" && GOFLAGS=-mod=mod go mod download -json "helm.sh/helm/v3@$HELM_VERSION" |
    sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
  cg_minor=$(awk '$1 == "k8s.io/client-go" {split($2, v, "."); print v[2]; exit}' "$hmod")
  ldf="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  ldf+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$cg_minor"
  ldf+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$cg_minor"
  log "building helm $HELM_VERSION"
  (cd "$CP_BUILD_DIR" && GOBIN="$DEST" timed go install -ldflags "$ldf" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION")
}

build_registry() {
  if have registry; then log "registry: present, skipping"; return; fi
  log "building go-containerregistry registry $GGCR_VERSION"
  (cd "$CP_BUILD_DIR" && GOBIN="$DEST" timed go install -ldflags "-s -w" "github.com/google/go-containerregistry/cmd/registry@$GGCR_VERSION")
}

# optional (not in the default COMPONENTS): the CNCF distribution registry, persistent
# storage, needs a config file; installed as distribution-registry
build_distribution() {
  if have distribution-registry; then log "distribution-registry: present, skipping"; return; fi
  local tmp
  tmp=$(mktemp -d)
  log "building distribution registry $DISTRIBUTION_VERSION"
  (cd "$CP_BUILD_DIR" && GOBIN="$tmp" timed go install -ldflags "-s -w" "github.com/distribution/distribution/v3/cmd/registry@$DISTRIBUTION_VERSION")
  mv "$tmp/registry" "$DEST/distribution-registry"
  rmdir "$tmp"
}

# build_main BINARY MODULE VERSION: a module whose root is a main package, built in a throwaway
# module that requires it (go mod tidy resolves its dependencies there), as DEST/BINARY.
build_main() {
  local bin=$1 mod=$2 version=$3
  if have "$bin"; then log "$bin: present, skipping"; return; fi
  local dir="$CP_BUILD_DIR/$bin-$version"
  mkdir -p "$dir"
  if [[ ! -f "$dir/go.sum" ]]; then
    printf 'module cpbuild/%s\n\ngo 1.26.0\n\nrequire %s %s\n' "$bin" "$mod" "$version" >"$dir/go.mod"
    printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$mod" >"$dir/tools.go"
    log "resolving $bin $version dependencies (go mod tidy)"
    (cd "$dir" && timed go mod tidy)
  fi
  log "building $bin $version"
  (cd "$dir" && timed go build -trimpath -ldflags "-s -w" -o "$DEST/$bin" "$mod")
}

# build_otelcol: the collector of hack/otelcol, rebuilt when its sources change (their hash is
# in the binary's name beside it).
build_otelcol() {
  local src sum
  src=$(cd "$(dirname "$0")/otelcol" && pwd)
  sum=$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-12)
  if have otelcol && [[ -f "$DEST/.otelcol-$sum" ]]; then log "otelcol: present, skipping"; return; fi
  log "building otelcol (hack/otelcol)"
  (cd "$src" && GOFLAGS="-buildvcs=false -mod=readonly" timed go build -trimpath -ldflags "-s -w" -o "$DEST/otelcol" .)
  rm -f "$DEST"/.otelcol-* && touch "$DEST/.otelcol-$sum"
}

t_start=$SECONDS
want etcd && build_etcd
want k8s && build_k8s
want kwok && build_kwok
want helm && build_helm
want registry && build_registry
want distribution && build_distribution
want coredns && build_main coredns github.com/coredns/coredns "$COREDNS_VERSION"
want otelcol && build_otelcol
want localpath && build_main local-path-provisioner github.com/rancher/local-path-provisioner "$LOCAL_PATH_VERSION"
log "all done in $((SECONDS - t_start))s; contents of $DEST:"
ls -l "$DEST"
