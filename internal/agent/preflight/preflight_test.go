package preflight_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/syscode-labs/imp/internal/agent/preflight"
)

func script(t *testing.T, dir, name, out string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte("#!/bin/sh\necho '"+out+"'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestRun(t *testing.T) {
	dir := t.TempDir()
	kernel := filepath.Join(dir, "vmlinuz")
	if err := os.WriteFile(kernel, []byte("kernel"), 0o644); err != nil {
		t.Fatal(err)
	}
	const kernelSum = "47d2ac2c1d3a8ac38a2e7ff1f0c0b2f3bafb56ae0d40b8e0d1f9d1bf6a7a9a8f" // not its sum
	fc16 := script(t, dir, "firecracker", "Firecracker v1.16.1")
	fc12 := script(t, dir, "firecracker-old", "Firecracker v1.12.0")
	jailer := script(t, dir, "jailer", "Jailer v1.16.1")
	noKVM := filepath.Join(dir, "no-kvm")
	for _, tc := range []struct {
		name    string
		cfg     preflight.Config
		wantErr string // empty: passes
	}{
		{"TCG allowed, nothing installed", preflight.Config{KVMDevice: noKVM, Firecracker: filepath.Join(dir, "none")}, ""},
		{"KVM required and absent", preflight.Config{KVMDevice: noKVM, RequireKVM: true}, "kvm: opening " + noKVM},
		{"supported firecracker and jailer", preflight.Config{KVMDevice: noKVM, Firecracker: fc16, Jailer: jailer}, ""},
		{"firecracker too old", preflight.Config{KVMDevice: noKVM, Firecracker: fc12}, "firecracker: " + fc12 + " is version 1.12.0; IMP supports 1.15 to 1.16"},
		{"pinned and absent", preflight.Config{KVMDevice: noKVM, Firecracker: filepath.Join(dir, "none"),
			Pins: []preflight.Pin{{Name: "firecracker", Path: filepath.Join(dir, "none"), SHA256: kernelSum}}}, "firecracker: " + filepath.Join(dir, "none") + " is not installed"},
		{"pin mismatch", preflight.Config{KVMDevice: noKVM, Pins: []preflight.Pin{{Name: "kernel", Path: kernel, SHA256: kernelSum}}},
			"pin kernel: " + kernel + " has sha256 6923dd1bc0460082c5d55a831908c24a282860b7f1cd6c2b79cf1bc8857c639c, pinned " + kernelSum},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checks, err := preflight.Run(context.Background(), tc.cfg)
			var b strings.Builder
			preflight.Report(&b, checks)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("preflight failed: %v\n%s", err, b.String())
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("error %v, want it to contain %q\n%s", err, tc.wantErr, b.String())
			}
		})
	}
}

func TestPinMatches(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "initramfs")
	if err := os.WriteFile(p, []byte("kernel"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := preflight.Run(context.Background(), preflight.Config{KVMDevice: filepath.Join(dir, "x"),
		Pins: []preflight.Pin{{Name: "initramfs", Path: p, SHA256: "sha256:6923dd1bc0460082c5d55a831908c24a282860b7f1cd6c2b79cf1bc8857c639c"}}})
	if err != nil {
		t.Fatal(err)
	}
}

func TestSupported(t *testing.T) {
	for v, want := range map[string]bool{"1.15.0": true, "1.16.1": true, "1.14.9": false, "1.17.0": false, "2.16.0": false, "x": false} {
		if got := preflight.Supported(v); got != want {
			t.Errorf("Supported(%q) = %v, want %v", v, got, want)
		}
	}
}
