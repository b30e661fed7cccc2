#!/usr/bin/env bash
# Tear down what hack/dev.sh started.
set -euo pipefail
cd "$(dirname "$0")/.."
export IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
hack/stop-control-plane.sh "${IMP_DEV_STATE:-$IMP_CACHE/dev}" --purge
