package firecracker_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
)

// TestPlaceInCopiesAcrossFileSystems: where a jail and its files are on different file systems
// (here /dev/shm and the test's directory), a file is copied in; the copy is kept while it is of
// the source (same size and modification time), and replaced once the source is another file of
// the same size (a base disk built anew, a restore's snapshot base), which a kept stale copy
// would have left the VM running on.
func TestPlaceInCopiesAcrossFileSystems(t *testing.T) {
	jail, err := os.MkdirTemp("/dev/shm", "imp-placein-")
	if err != nil {
		t.Skip("no /dev/shm:", err)
	}
	t.Cleanup(func() { os.RemoveAll(jail) })
	if err := os.Mkdir(filepath.Join(jail, "disks"), 0o755); err != nil {
		t.Fatal(err)
	}
	root, err := os.OpenRoot(jail)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	src := filepath.Join(t.TempDir(), "base.ext4")
	place := func() string {
		t.Helper()
		if err := firecracker.PlaceIn(root, "disks/base.ext4", src); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(jail, "disks/base.ext4"))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if err := os.WriteFile(src, []byte("first base"), 0o444); err != nil {
		t.Fatal(err)
	}
	if got := place(); got != "first base" {
		t.Fatalf("placed %q", got)
	}
	if got := place(); got != "first base" {
		t.Fatalf("placed again %q", got)
	}
	// Another file of the same size in the source's place.
	if err := os.Remove(src); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(src, []byte("other base"), 0o444); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(src, time.Now().Add(time.Hour), time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if got := place(); got != "other base" {
		t.Errorf("the jail kept the stale copy %q of a replaced source", got)
	}
}
