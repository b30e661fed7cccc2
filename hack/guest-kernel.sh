#!/usr/bin/env bash
# Fetch Debian's cloud kernel (vmlinuz + modules) for development and tests into
# $IMP_CACHE/guest/kernel, without installing it. Prints the kernel's path.
# Production nodes configure their own (Firecracker-compatible) kernel; see docs.
set -euo pipefail
IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
dir=$IMP_CACHE/guest
if ! ls "$dir"/kernel/boot/vmlinuz-* >/dev/null 2>&1; then
  mkdir -p "$dir/debs"
  pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
  if [[ -z $pkg ]]; then # a fresh machine's package lists may be empty
    apt-get update -qq
    pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
  fi
  [[ -n $pkg ]] || { echo "guest-kernel: no linux-image-cloud-amd64 in apt (run apt-get update)" >&2; exit 1; }
  (cd "$dir/debs" && apt-get download "$pkg" 2>/dev/null)
  rm -rf "$dir/kernel.tmp"
  dpkg-deb -x "$dir"/debs/"$pkg"_*.deb "$dir/kernel.tmp"
  rm -rf "$dir/kernel" && mv "$dir/kernel.tmp" "$dir/kernel"
fi
ls "$dir"/kernel/boot/vmlinuz-* | head -1
