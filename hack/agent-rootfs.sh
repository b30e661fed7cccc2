#!/usr/bin/env bash
# Build the agent image's base root filesystem without Docker: Debian bookworm (minbase) with
# what imp-agent executes on a node — QEMU (the fallback VMM, microvm machine), mkfs.ext4 and
# debugfs (disks), iproute2 and nftables (for people debugging a node from the pod). Cached in
# $IMP_CACHE/agent-rootfs; rebuilt only when this script changes.
#
# Usage: hack/agent-rootfs.sh     prints the directory
set -euo pipefail
CACHE=${IMP_CACHE:-$HOME/.cache/imp}
OUT=$CACHE/agent-rootfs
STAMP=$(sha256sum "$0" | cut -c1-16)
if [[ -f $OUT/.imp-stamp && $(cat "$OUT/.imp-stamp") == "$STAMP" ]]; then
  echo "$OUT"; exit 0
fi
command -v debootstrap >/dev/null || { apt-get update -qq >&2 && apt-get install -y -qq debootstrap >&2; }
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp"
echo "agent-rootfs: debootstrap bookworm from $MIRROR (a few minutes, once)" >&2
debootstrap --variant=minbase --include=qemu-system-x86,e2fsprogs,iproute2,nftables,ca-certificates \
  bookworm "$OUT.tmp" "$MIRROR" >&2
# Trim what an image does not need.
rm -rf "$OUT.tmp"/var/cache/apt/archives/*.deb "$OUT.tmp"/var/lib/apt/lists/* "$OUT.tmp"/usr/share/doc/* \
  "$OUT.tmp"/usr/share/man/* "$OUT.tmp"/usr/share/locale/* "$OUT.tmp"/dev/* "$OUT.tmp"/proc/* "$OUT.tmp"/sys/*
echo "$STAMP" > "$OUT.tmp/.imp-stamp"
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "$OUT"
