package nodereport

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmmdriver"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

func TestCollectImages(t *testing.T) {
	state := t.TempDir()
	images := filepath.Join(state, "images")
	r := &Reporter{StateDir: state, Images: &disk.BaseStore{Dir: images}}
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
	if err := vmrun.WriteMeta(vm, &vmrun.Meta{UID: "uid-1", Digest: "sha256:bbb"}); err != nil {
		t.Fatal(err)
	}
	removed, err := r.collectImages(10 * time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 || removed[0] != "sha256-aaa.ext4" {
		t.Errorf("removed %v, want only the old unused sha256-aaa.ext4 (bbb is in use, ccc is new)", removed)
	}
}

// TestVMBytesCountsWhatPlacementCounts (review of issue 27, item 6): the node offers what is
// free plus what the files placement counts already take — writable disks and saved memory —
// and nothing a VMM can add to them: a base disk hard-linked into a jail, a link from a jail to
// the host's root, another file system.
func TestVMBytesCountsWhatPlacementCounts(t *testing.T) {
	state := t.TempDir()
	cfg := vmmdriver.Config{StateDir: state, Firecracker: "/usr/local/bin/firecracker"}
	r := &Reporter{StateDir: state, JailRoot: func(uid types.UID) string { return vmmdriver.JailRoot(cfg, uid) }}
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
	jail := r.JailRoot("fc-vm")
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
	got := r.vmBytes()
	if want := int64(3+2+1+2+4) * mib; got < want || got > want+mib {
		t.Errorf("vmBytes %d MiB; want %d MiB (writable disks, disk volumes and saved memory alone)", got/mib, want/mib)
	}
	// A jail whose snapshot directory is a link out of it counts nothing there.
	_ = os.RemoveAll(filepath.Join(jail, "snapshot"))
	if err := os.Symlink(filepath.Join(state, "images"), filepath.Join(jail, "snapshot")); err != nil {
		t.Fatal(err)
	}
	write(filepath.Join(state, "images", "vm.mem"), 8*mib)
	if got := r.vmBytes(); got >= int64(9)*mib {
		t.Errorf("vmBytes %d MiB through a jail's link", got/mib)
	}
}
