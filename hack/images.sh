#!/usr/bin/env bash
# Build IMP's images without a Docker engine and push them to REGISTRY (host:port; loopback
# and hosts in INSECURE are reached over plain HTTP). Prints one line per image:
#   imp-operator=REGISTRY/imp-operator@sha256:...
#   imp-agent=REGISTRY/imp-agent@sha256:...
# The tag is the chart's appVersion unless TAG is set.
#
# Usage: hack/images.sh REGISTRY        (make images REGISTRY=...)
set -euo pipefail
cd "$(dirname "$0")/.."
REGISTRY=${1:?usage: hack/images.sh REGISTRY}
TAG=${TAG:-$(awk -F'"' '/^appVersion:/{print $2}' charts/imp/Chart.yaml)}
IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export TMPDIR=$WORK

KERNEL=$(hack/guest-kernel.sh)
MODULES=$IMP_CACHE/guest/kernel/lib/modules/$(basename "$KERNEL" | sed 's/^vmlinuz-//')
ROOTFS=$(hack/agent-rootfs.sh)
export CGO_ENABLED=0
LDFLAGS="-s -w"
go build -trimpath -ldflags "$LDFLAGS" -o "$WORK/" ./cmd/imp-operator ./cmd/imp-agent ./cmd/imp-init
go build -o "$WORK/devtool" ./hack/devtool
"$WORK/devtool" initramfs "$WORK/initramfs.cpio.gz" "$WORK/imp-init" "$MODULES"
"$WORK/devtool" images "$REGISTRY" "$TAG" "$WORK/imp-operator" "$WORK/imp-agent" "$WORK/initramfs.cpio.gz" "$ROOTFS"
