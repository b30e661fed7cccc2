package disk

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
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
	t.Cleanup(w.Wait)
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

// TestWritableSpares: after a VM's disk of a size, Spares copies of its template are made and
// synced in the background; the next VM's disk of that size is one of them, renamed, with no
// copy on its start, and they are made again. VMs starting at once never share one. An evicted
// template's spares go with it.
func TestWritableSpares(t *testing.T) {
	dir := t.TempDir()
	w := &Writables{Dir: filepath.Join(dir, "templates"), Keep: 1, Spares: 2}
	t.Cleanup(w.Wait)
	spares := func(mib int) map[uint64]string { // inode → path
		paths, _ := filepath.Glob(filepath.Join(w.Dir, fmt.Sprintf("writable-%dM.ext4.spare-*", mib)))
		m := map[uint64]string{}
		for _, p := range paths {
			var st syscall.Stat_t
			if strings.HasSuffix(p, ".tmp") {
				t.Errorf("an unfinished spare is left: %s", p)
			} else if syscall.Stat(p, &st) == nil {
				m[st.Ino] = p
			}
		}
		return m
	}
	inode := func(p string) uint64 {
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		return st.Ino
	}
	clean := func(p string) {
		if out, err := exec.Command("e2fsck", "-fn", p).CombinedOutput(); err != nil {
			t.Errorf("%s: e2fsck: %v\n%s", p, err, out)
		}
	}
	if err := w.Ensure(filepath.Join(dir, "first.ext4"), 64<<20); err != nil {
		t.Fatal(err)
	}
	w.Wait()
	ready := spares(64)
	if len(ready) != 2 {
		t.Fatalf("%d spares after the first disk, want 2", len(ready))
	}
	second := filepath.Join(dir, "second.ext4")
	if err := w.Ensure(second, 64<<20); err != nil {
		t.Fatal(err)
	}
	if _, ok := ready[inode(second)]; !ok {
		t.Error("the second disk is not one of the spares: it was copied on its start")
	}
	clean(second)
	w.Wait()
	if n := len(spares(64)); n != 2 {
		t.Errorf("%d spares after one was taken, want 2 again", n)
	}

	// Eight VMs at once: each its own disk, whether a spare or a copy.
	var wg sync.WaitGroup
	paths := make([]string, 8)
	errs := make([]error, 8)
	for i := range paths {
		paths[i] = filepath.Join(dir, fmt.Sprintf("at-once-%d.ext4", i))
		wg.Go(func() { errs[i] = w.Ensure(paths[i], 64<<20) })
	}
	wg.Wait()
	seen := map[uint64]string{}
	for i, p := range paths {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if other, ok := seen[inode(p)]; ok {
			t.Errorf("%s and %s are one file", p, other)
		}
		seen[inode(p)] = p
		clean(p)
	}

	// Another size: the 64M template goes (Keep 1), and its spares with it.
	if err := w.Ensure(filepath.Join(dir, "bigger.ext4"), 128<<20); err != nil {
		t.Fatal(err)
	}
	w.Wait()
	if n := len(spares(64)); n != 0 {
		t.Errorf("%d spares of an evicted template are left", n)
	}
	if n := len(spares(128)); n != 2 {
		t.Errorf("%d spares of the new size, want 2", n)
	}
}

// TestWritablesStop: once stopped, a VM's disk is still made, but no spare is begun after it.
func TestWritablesStop(t *testing.T) {
	dir := t.TempDir()
	w := &Writables{Dir: filepath.Join(dir, "templates"), Spares: 2}
	w.Stop()
	if err := w.Ensure(filepath.Join(dir, "a.ext4"), 64<<20); err != nil {
		t.Fatal(err)
	}
	w.Wait()
	if spares, _ := filepath.Glob(filepath.Join(w.Dir, "*"+spareSuffix+"*")); len(spares) != 0 {
		t.Errorf("spares made after Stop: %v", spares)
	}
}
