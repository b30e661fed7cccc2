#!/usr/bin/env bash
# The whole test suite, on a fresh machine too: installs what the tests need (Debian packages,
# the control plane built from the Go module proxy into $IMP_CACHE), checks generated code,
# formatting and vet, then runs every Go test (unit, envtest against a real kube-apiserver).
#
#   hack/test.sh            (what `make test` and .ci/run call)
#
# Env: IMP_CACHE [~/.cache/imp]   where built binaries live (kept between runs)
#      KUBEBUILDER_ASSETS         use these etcd/kube-apiserver/kubectl instead of building them
#      GO_TEST_FLAGS              extra flags for go test (e.g. -run Foo, -v)
#      IMP_FUZZTIME               -fuzztime of each fuzzer (default: executions worth ~20 s each)
#      IMP_E2E_VMM                firecracker: the end-to-end VM runs under Firecracker (a KVM
#                                 host with firecracker and jailer in /usr/local/bin); default
#                                 QEMU under TCG
set -euo pipefail
cd "$(dirname "$0")/.."
export IMP_CACHE=${IMP_CACHE:-$HOME/.cache/imp}
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
t0=$SECONDS
step() { printf '\n=== [%4ds] %s\n' "$((SECONDS - t0))" "$*"; }

step "prerequisites"
hack/install-prerequisites.sh

if [[ -z "${KUBEBUILDER_ASSETS:-}" ]]; then
  step "control plane binaries ($IMP_CACHE/cp/bin)"
  hack/setup-control-plane.sh "$IMP_CACHE/cp/bin"
  export KUBEBUILDER_ASSETS=$IMP_CACHE/cp/bin
fi

step "guest kernel ($IMP_CACHE/guest)"
hack/guest-kernel.sh

step "generated code"
hack/verify-generated.sh

step "gofmt and go vet"
unformatted=$(gofmt -l $(git ls-files '*.go'))
if [[ -n "$unformatted" ]]; then echo "gofmt would change:"; echo "$unformatted"; exit 1; fi
go vet ./...

step "go test"
# A test binary that crashed (a panic, a timeout) skips its cleanup and leaves its envtest etcd
# and kube-apiserver running, orphaned: stop those of earlier runs.
for pid in $(pgrep -f 'k8s_test_framework' || true); do
  if [[ "$(ps -o ppid= -p "$pid" 2>/dev/null | tr -d ' ')" == 1 ]]; then
    echo "stopping an orphaned test control plane process $pid"; kill -9 "$pid" 2>/dev/null || true
  fi
done
# go test's default cap is 10 minutes per package; the agent package boots a dozen guests under
# TCG and needs more than that on a 2-core machine whose cores are busy with something else.
# The end-to-end tests join this machine to their control plane as a real node; their TestMain
# undoes that, and this undoes it too when a test binary crashed before it could.
trap 'go test -short -count=1 -run "^$" ./test/e2e/ >/dev/null || echo "cleaning up the real node failed: hack/real-node.sh down /tmp/imp-e2e-node" >&2' EXIT
# shellcheck disable=SC2086
# CI keeps only the end of the output: a failure is repeated there, whatever package it was in.
log=$(mktemp /tmp/imp-go-test.XXXXXX)
if ! go test -count=1 -timeout 45m ${GO_TEST_FLAGS:-} ./... 2>&1 | tee "$log"; then
  echo; echo "=== what failed (all of it is above)"
  # A test's lines but the commands it ran (the end-to-end test logs each as "$ command"),
  # which would push its errors out of the tail.
  grep -E -e '^(--- FAIL|FAIL|panic:)' -e '^\s+[A-Za-z0-9_]+\.go:[0-9]+: ' "$log" | grep -vE '^\s+[A-Za-z0-9_]+\.go:[0-9]+: \$ ' |
    cut -c1-300 | tail -80
  echo "=== the failed tests"; grep -E '^\s*--- FAIL' "$log" | tail -20
  rm -f "$log"
  exit 1
fi
rm -f "$log"

step "fuzz"
# What a guest writes on its channel and what a registry serves as a layer are untrusted: a
# bounded run of each fuzzer on top of the seed corpus the unit tests already ran. Bounded by
# executions (about 20 s each here), not by time: a duration's deadline can end a worker mid-
# input and fail the run with "context deadline exceeded" and no crasher (go.dev/issue/75804),
# as it did here once. Minimizing an interesting input is bounded to 200 executions: Go's
# default (60 s each) spent most of the budget minimizing, at 0 execs/s. IMP_FUZZTIME, when
# set, is the -fuzztime of both.
for target in "FuzzGuestChannel ./internal/agent/guestchan/ 250000x" "FuzzApplyLayer ./internal/agent/disk/ 15000x"; do
  set -- $target
  go test -run '^$' -fuzz "^$1\$" -fuzztime "${IMP_FUZZTIME:-$3}" -fuzzminimizetime 200x "$2"
done

step "done in $((SECONDS - t0))s"
