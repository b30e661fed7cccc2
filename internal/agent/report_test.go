package agent

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/agent/disk"
)

func TestCollectImages(t *testing.T) {
	state := t.TempDir()
	images := filepath.Join(state, "images")
	a := &Agent{Opts: Options{StateDir: state}, images: &disk.BaseStore{Dir: images}}
	if err := os.MkdirAll(images, 0o700); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-time.Hour)
	for name, mtime := range map[string]time.Time{"sha256-aaa.ext4": old, "sha256-bbb.ext4": old, "sha256-ccc.ext4": time.Now()} {
		p := filepath.Join(images, name)
		if err := os.WriteFile(p, nil, 0o444); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p, mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}
	vm := filepath.Join(state, "vms", "uid-1")
	if err := os.MkdirAll(vm, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := writeMeta(vm, &meta{UID: "uid-1", Digest: "sha256:bbb"}); err != nil {
		t.Fatal(err)
	}
	removed, err := a.collectImages(10 * time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 || removed[0] != "sha256-aaa.ext4" {
		t.Errorf("removed %v, want only the old unused sha256-aaa.ext4 (bbb is in use, ccc is new)", removed)
	}
}

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
		a := &Agent{Opts: Options{KVMDevice: dev, Firecracker: filepath.Join(dir, "firecracker"), Jailer: filepath.Join(dir, "jailer"), Accel: "tcg"}}
		caps := a.probeVMMs(context.Background())
		if len(caps) != 1 || caps[0].Kind != "qemu" || caps[0].Acceleration != "tcg" {
			t.Errorf("KVM device %s: capabilities %+v, want qemu (tcg) only", dev, caps)
		}
	}
}
