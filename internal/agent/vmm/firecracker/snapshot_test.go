package firecracker_test

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
)

// TestSnapshotFilesOutOfAJail: the VMM owns its jail and writes its snapshot there, so what the
// agent copies out may be anything the VMM planted: a FIFO (which a blocking open would wait on
// for ever), a symbolic link to a host file, a hard link to one, a file larger than the VM's
// memory. Each is refused, at once, and nothing of the host file is copied; an honest file is
// copied, 0600.
func TestSnapshotFilesOutOfAJail(t *testing.T) {
	dir := t.TempDir()
	root, out := filepath.Join(dir, "jail"), filepath.Join(dir, "out")
	for _, d := range []string{filepath.Join(root, "snapshot"), out} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	host := filepath.Join(dir, "host-secret")
	if err := os.WriteFile(host, []byte("the node's secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	jail := func(name string) string { return filepath.Join(root, "snapshot", name) }
	if err := syscall.Mkfifo(jail("fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = os.Symlink(host, jail("symlink"))
	_ = os.Link(host, jail("hardlink"))
	big, _ := os.Create(jail("big"))
	_ = big.Truncate(1 << 40) // sparse: costs the VMM nothing
	big.Close()
	_ = os.WriteFile(jail("honest"), []byte("guest memory"), 0o640)

	for name, want := range map[string]string{
		"fifo": "not a file of its own", "hardlink": "not a file of its own", "symlink": "too many levels of symbolic links",
		"big": "more than",
	} {
		done := make(chan error, 1)
		go func() { done <- firecracker.CopyOut(root, "/snapshot/"+name, filepath.Join(out, name), 256<<20) }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("%s: %v, want an error saying %q", name, err, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the copy blocked", name)
		}
		if b, err := os.ReadFile(filepath.Join(out, name)); err == nil && strings.Contains(string(b), "secret") {
			t.Errorf("%s: the host file was copied out", name)
		}
	}
	if err := firecracker.CopyOut(root, "/snapshot/honest", filepath.Join(out, "honest"), 256<<20); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(out, "honest")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("the copy: %v %v", fi, err)
	}
}
