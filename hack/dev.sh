#!/usr/bin/env bash
# Bring IMP up locally and run a VM: control plane from source, CRDs, operator and agent as
# processes, a sample ImpVM booting under QEMU (KVM when present, TCG otherwise).
#
# Today it brings up the control plane and installs the API; the operator, the agent and a
# booting VM arrive with issues 3 and 4, and this script grows with them.
set -euo pipefail
cd "$(dirname "$0")/.."
export IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
STATE=${IMP_DEV_STATE:-$IMP_CACHE/dev}
hack/install-prerequisites.sh
hack/setup-control-plane.sh "$IMP_CACHE/cp/bin"
CP_BIN_DIR=$IMP_CACHE/cp/bin WITH_KWOK=0 hack/start-control-plane.sh "$STATE"
# shellcheck disable=SC1091
. "$STATE/env"
kubectl apply -f config/crd/bases
kubectl wait --for=condition=Established --timeout=60s crd/impvms.imp.dev crd/impvmclasses.imp.dev crd/impnetworks.imp.dev >/dev/null
kubectl apply -f config/samples
kubectl get imp -A
cat <<MSG

The API is up (KUBECONFIG=$KUBECONFIG). The operator and the node agent that would run the
sample VM are not built yet (issues 3 and 4). Tear down with: hack/dev-down.sh
MSG
