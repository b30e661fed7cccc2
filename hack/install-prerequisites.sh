#!/usr/bin/env bash
# Install the Debian packages the tests and the local environment use, when missing.
# Idempotent and quiet when everything is there; needs root (or sudo) only when installing.
set -euo pipefail
packages=(
  git make curl openssl ca-certificates   # scripts, PKI of the local control plane
  e2fsprogs                              # mkfs.ext4 -d builds base disks; debugfs reads them in tests
  qemu-system-x86                        # the qemu VMM driver (TCG without KVM)
  debootstrap                            # the agent image's Debian base (hack/agent-rootfs.sh)
  mmdebstrap                             # the OS image of spec.boot OS (hack/os-image.sh; debootstrap cannot: cloud-init)
  containerd runc                        # the real node of the end-to-end tests (hack/real-node.sh)
  util-linux                             # nsenter, mountpoint (the end-to-end tests)
  nftables conntrack                     # kube-proxy in nftables mode (the real node, make dev)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "prerequisites: all Debian packages present"
  exit 0
fi
echo "prerequisites: installing ${missing[*]}"
sudo=()
((EUID == 0)) || sudo=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
