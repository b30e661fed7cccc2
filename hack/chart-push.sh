#!/usr/bin/env bash
# Package charts/imp and push it to oci://REGISTRY/charts (plain HTTP for loopback registries).
# Usage: hack/chart-push.sh REGISTRY        (make chart-push REGISTRY=...)
set -euo pipefail
cd "$(dirname "$0")/.."
REGISTRY=${1:?usage: hack/chart-push.sh REGISTRY}
HELM=${HELM:-$(command -v helm || echo "${IMP_CACHE:-$HOME/.cache/imp}/cp/bin/helm")}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$HELM" lint --strict charts/imp >/dev/null
"$HELM" package charts/imp -d "$WORK" >/dev/null
flags=()
case $REGISTRY in 127.*|localhost*|\[::1\]*) flags+=(--plain-http) ;; esac
"$HELM" push "$WORK"/imp-*.tgz "oci://$REGISTRY/charts" "${flags[@]}"
