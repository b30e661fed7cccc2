package disk

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/syscode-labs/imp/internal/guestinit"
)

// TestWritables makes writable disks of two VMs of one size and one of another: each is a
// clean ext4 file system with the writable label and its size, sparse, its own file; mkfs ran
// once per size; a VM's existing disk is kept; beyond Keep sizes the oldest template goes.
func TestWritables(t *testing.T) {
	dir := t.TempDir()
	count := filepath.Join(dir, "mkfs-runs")
	mkfs := filepath.Join(dir, "mkfs")
	if err := os.WriteFile(mkfs, []byte("#!/bin/sh\necho >>"+count+"\nexec mkfs.ext4 \"$@\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	w := &Writables{Dir: filepath.Join(dir, "templates"), Mkfs: mkfs, Keep: 1}
	for _, vm := range []struct {
		name string
		size int64
	}{{"a", 1 << 30}, {"b", 1 << 30}, {"c", 64 << 20}} {
		p := filepath.Join(dir, vm.name+".ext4")
		if err := w.Ensure(p, vm.size); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command("e2fsck", "-fn", p).CombinedOutput()
		if err != nil {
			t.Errorf("%s: e2fsck: %v\n%s", vm.name, err, out)
		}
		out, err = exec.Command("dumpe2fs", "-h", p).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "Filesystem volume name:   "+guestinit.WritableLabel) {
			t.Errorf("%s: not labelled %s: %v\n%s", vm.name, guestinit.WritableLabel, err, out)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		// Sparse, and so is the template: a file system's few metadata blocks, no journal
		// zeroed out.
		limit := max(vm.size/256, 1<<20)
		if st.Size != vm.size || st.Blocks*512 > limit {
			t.Errorf("%s: %d bytes, %d allocated; want %d, at most %d allocated", vm.name, st.Size, st.Blocks*512, vm.size, limit)
		}
		tmpl := filepath.Join(w.Dir, fmt.Sprintf("writable-%dM.ext4", vm.size>>20))
		if err := syscall.Stat(tmpl, &st); err != nil || st.Blocks*512 > limit {
			t.Errorf("template %s: %d bytes allocated (%v), want at most %d", tmpl, st.Blocks*512, err, limit)
		}
	}
	// The two VMs of a size share no blocks through the file system's eyes: writing one leaves
	// the other as it was.
	a, b := filepath.Join(dir, "a.ext4"), filepath.Join(dir, "b.ext4")
	if err := os.WriteFile(a, []byte("scribbled"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("e2fsck", "-fn", b).CombinedOutput(); err != nil {
		t.Errorf("b changed with a: %v\n%s", err, out)
	}
	// Ensure keeps an existing disk.
	if err := w.Ensure(a, 1<<30); err != nil {
		t.Fatal(err)
	}
	if data, _ := os.ReadFile(a); string(data) != "scribbled" {
		t.Errorf("Ensure replaced an existing disk")
	}
	runs, _ := os.ReadFile(count)
	if n := strings.Count(string(runs), "\n"); n != 2 {
		t.Errorf("mkfs ran %d times for two sizes", n)
	}
	left, _ := filepath.Glob(filepath.Join(w.Dir, "*.ext4"))
	if len(left) != 1 || !strings.HasSuffix(left[0], "writable-64M.ext4") {
		t.Errorf("templates %v, want the 64M one only (Keep 1)", left)
	}
}
