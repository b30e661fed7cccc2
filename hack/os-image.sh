#!/usr/bin/env bash
# The Debian image of OS-mode VMs (ImpVM spec.boot OS, docs/os.md), from Debian's packages, no
# prebuilt image: a bookworm root with systemd, cloud-init and openssh-server, built by
# mmdebstrap into $IMP_CACHE/os-debian once (about a minute), and printed.
#   hack/os-image.sh                 build (or reuse) the root and print its directory
#   hack/os-image.sh REGISTRY/REPO:TAG   and push it as an image; prints the digest reference
# Your own image needs the same: /sbin/init (systemd), no SSH host keys of its build, an empty
# /etc/machine-id (docs/os.md).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${IMP_CACHE:-$HOME/.cache/imp}
OUT=$CACHE/os-debian
STAMP=$(sha256sum "$0" | cut -c1-16)
# One build at a time: the agent's tests and the end-to-end test may ask at once.
mkdir -p "$CACHE"
exec 9>"$CACHE/os-debian.lock"
flock 9
if ! [[ -f $OUT/.imp-stamp && $(cat "$OUT/.imp-stamp") == "$STAMP" ]]; then
  if ! command -v mmdebstrap >/dev/null; then
    # debootstrap fails on a virtual dependency of cloud-init; mmdebstrap resolves it with apt.
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >&2
  fi
  MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
  rm -rf "$OUT.tmp"
  echo "os-image: mmdebstrap bookworm from $MIRROR (about a minute, once)" >&2
  mmdebstrap --quiet --variant=apt --include=systemd-sysv,udev,cloud-init,openssh-server \
    bookworm "$OUT.tmp" "$MIRROR" >&2
  # Each VM makes its own SSH host keys at its first boot (cloud-init does too, per instance)
  # and its own machine ID: none of the build's is kept.
  rm -f "$OUT.tmp"/etc/ssh/ssh_host_*
  : > "$OUT.tmp/etc/machine-id"
  cat > "$OUT.tmp/etc/systemd/system/imp-ssh-host-keys.service" <<'EOF'
[Unit]
Description=SSH host keys of this machine
ConditionPathExistsGlob=!/etc/ssh/ssh_host_*_key
Before=ssh.service

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A
EOF
  mkdir -p "$OUT.tmp/etc/systemd/system/ssh.service.wants"
  ln -s ../imp-ssh-host-keys.service "$OUT.tmp/etc/systemd/system/ssh.service.wants/imp-ssh-host-keys.service"
  echo localhost > "$OUT.tmp/etc/hostname"
  # No locales are built into the image: cloud-init's default (en_US.UTF-8) would fail its
  # locale module; C.UTF-8 is libc's own.
  printf 'locale: C.UTF-8\n' > "$OUT.tmp/etc/cloud/cloud.cfg.d/90-imp-image.cfg"
  rm -rf "$OUT.tmp"/var/cache/apt/archives/*.deb "$OUT.tmp"/var/lib/apt/lists/* "$OUT.tmp"/dev/* \
    "$OUT.tmp"/proc/* "$OUT.tmp"/sys/* "$OUT.tmp"/run/*
  echo "$STAMP" > "$OUT.tmp/.imp-stamp"
  rm -rf "$OUT" "$OUT.layer.tar.gz" && mv "$OUT.tmp" "$OUT"
fi
if [[ $# -eq 0 ]]; then
  echo "$OUT"
  exit 0
fi
go run ./hack/devtool os-image "$1" "$OUT"
