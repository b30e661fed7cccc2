package agent

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
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

// TestVMBytesCountsWhatPlacementCounts (review of issue 27, item 6): the node offers what is
// free plus what the files placement counts already take — writable disks and saved memory —
// and nothing a VMM can add to them: a base disk hard-linked into a jail, a link from a jail to
// the host's root, another file system.
func TestVMBytesCountsWhatPlacementCounts(t *testing.T) {
	state := t.TempDir()
	a := &Agent{Opts: Options{StateDir: state, Firecracker: "/usr/local/bin/firecracker"}}
	write := func(p string, n int) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, make([]byte, n), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	const mib = 1 << 20
	write(filepath.Join(state, "vms", "qemu-vm", "rw.ext4"), 3*mib)
	write(filepath.Join(state, "vms", "qemu-vm", qemu.StateFile), 2*mib)
	write(filepath.Join(state, "vms", "qemu-vm", "console.log"), 5*mib) // not placement's
	write(filepath.Join(state, "vms", "fc-vm", "rw.ext4"), mib)
	write(filepath.Join(state, "vms", "fc-vm", "vol-data.img"), 2*mib) // a disk volume
	jail := a.jailRoot("fc-vm")
	write(filepath.Join(jail, "snapshot", "vm.mem"), 4*mib)
	// What a VMM may plant in its jail: the base disk, linked in as the driver links it; a link
	// to the host's root; the writable disk's link (counted once).
	base := filepath.Join(state, "images", "sha256-aaa.ext4")
	write(base, 16*mib)
	for _, l := range [][2]string{{base, "disks/base.ext4"}, {filepath.Join(state, "vms", "fc-vm", "rw.ext4"), "disks/rw.ext4"}} {
		_ = os.MkdirAll(filepath.Join(jail, filepath.Dir(l[1])), 0o700)
		if err := os.Link(l[0], filepath.Join(jail, l[1])); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("/", filepath.Join(jail, "host")); err != nil {
		t.Fatal(err)
	}
	got := a.vmBytes()
	if want := int64(3+2+1+2+4) * mib; got < want || got > want+mib {
		t.Errorf("vmBytes %d MiB; want %d MiB (writable disks, disk volumes and saved memory alone)", got/mib, want/mib)
	}
	// A jail whose snapshot directory is a link out of it counts nothing there.
	_ = os.RemoveAll(filepath.Join(jail, "snapshot"))
	if err := os.Symlink(filepath.Join(state, "images"), filepath.Join(jail, "snapshot")); err != nil {
		t.Fatal(err)
	}
	write(filepath.Join(state, "images", "vm.mem"), 8*mib)
	if got := a.vmBytes(); got >= int64(9)*mib {
		t.Errorf("vmBytes %d MiB through a jail's link", got/mib)
	}
}

// TestRuntimePatchReplacesTheWholeReport: every field of status.runtime the report leaves unset
// is named null in the patch, so nothing of an earlier run's report (its readiness, its exit)
// survives into the next.
func TestRuntimePatchReplacesTheWholeReport(t *testing.T) {
	p, err := RuntimePatch(impv1.RuntimeStatus{Instance: 1, Run: 2, State: impv1.RuntimeRunning})
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Status struct {
			Runtime map[string]any `json:"runtime"`
		} `json:"status"`
	}
	if err := json.Unmarshal(p, &got); err != nil {
		t.Fatal(err)
	}
	rt := reflect.TypeFor[impv1.RuntimeStatus]()
	if len(got.Status.Runtime) != rt.NumField() {
		t.Fatalf("the patch names %d fields of %d: %s", len(got.Status.Runtime), rt.NumField(), p)
	}
	for _, f := range []string{"ready", "exitCode", "guestReady", "reason"} {
		if v, ok := got.Status.Runtime[f]; !ok || v != nil {
			t.Errorf("%s: %v, %v; want null", f, v, ok)
		}
	}
}
