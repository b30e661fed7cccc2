package vmmdriver

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
)

// TestNoFirecrackerWithoutKVM: firecracker and its jailer installed at a supported version,
// but no usable /dev/kvm: the node offers QEMU only.
func TestNoFirecrackerWithoutKVM(t *testing.T) {
	dir := t.TempDir()
	for name, out := range map[string]string{"firecracker": "Firecracker v1.16.1", "jailer": "Jailer v1.16.1"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("#!/bin/sh\necho '"+out+"'\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, dev := range []string{filepath.Join(dir, "kvm"), "/dev/null"} {
		caps := Probe(context.Background(), Config{KVMDevice: dev, Firecracker: filepath.Join(dir, "firecracker"), Jailer: filepath.Join(dir, "jailer"), Accel: "tcg"})
		if len(caps) != 1 || caps[0].Kind != "qemu" || caps[0].Acceleration != "tcg" {
			t.Errorf("KVM device %s: capabilities %+v, want qemu (tcg) only", dev, caps)
		}
	}
}

// TestTheGuestsCPU: under TCG a guest gets QEMU's own model wherever it runs; under KVM the
// host's, named by its model and flags: two nodes' guests are alike only when those are.
func TestTheGuestsCPU(t *testing.T) {
	if got := guestCPU("tcg"); got != "tcg:max" {
		t.Errorf("under TCG: %q", got)
	}
	kvm := guestCPU("kvm")
	if !strings.HasPrefix(kvm, "host:") || len(kvm) != len("host:")+64 || kvm == guestCPU("tcg") {
		t.Errorf("under KVM: %q", kvm)
	}
	if guestCPU("kvm") != kvm {
		t.Error("the host's CPU named twice, differently")
	}
}

// TestEveryLogIsCapped: the console and QEMU's own log of a VM are held under the one cap.
func TestEveryLogIsCapped(t *testing.T) {
	dir := t.TempDir()
	const capBytes = 4096
	for _, f := range []string{qemu.ConsoleLog, qemu.LogFile} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte(strings.Repeat("x", 100*capBytes)), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := New(context.Background(), Config{}).For("qemu").CapLogs(dir, capBytes); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{qemu.ConsoleLog, qemu.LogFile} {
		if fi, err := os.Stat(filepath.Join(dir, f)); err != nil || fi.Size() > capBytes {
			t.Errorf("%s: %v, %v bytes; want at most %d", f, err, fi.Size(), capBytes)
		}
	}
}
