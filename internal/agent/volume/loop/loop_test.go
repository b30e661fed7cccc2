package loop

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestAttach binds a disk image to a loop device and reaches it through the node Attach made:
// writes land in the image; the device is the image's alone (another image gets another
// device), bound without partition scanning, and unbound once its last user closes it. A
// read-only binding refuses writes. Whatever was at the node's path is replaced, a link never
// followed. Without a loop control device in /dev, one is made for the moment.
func TestAttach(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: loop devices")
	}
	dir := t.TempDir()
	img := func(name, content string) *os.File {
		t.Helper()
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, append([]byte(content), make([]byte, 4<<20-len(content))...), 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.OpenFile(p, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	a, b := img("a.img", "image a"), img("b.img", "image b")
	// A link at the node's path, to a file the binding must not touch.
	victim := filepath.Join(dir, "victim")
	if err := os.WriteFile(victim, []byte("untouched"), 0o600); err != nil {
		t.Fatal(err)
	}
	nodeA, nodeB := filepath.Join(dir, "vol-a.img"), filepath.Join(dir, "vol-b.img")
	if err := os.Symlink(victim, nodeA); err != nil {
		t.Fatal(err)
	}

	var d Devices
	da, err := d.Attach(nodeA, a, false)
	if err != nil {
		t.Fatal(err)
	}
	defer da.Close()
	// Where the agent's /dev has no loop control device, it makes one for the moment.
	db, err := Devices{Control: filepath.Join(dir, "absent")}.Attach(nodeB, b, false)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()

	var st unix.Stat_t
	if err := unix.Lstat(nodeA, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK || st.Mode&0o777 != 0o600 || st.Uid != 0 {
		t.Fatalf("the node at %s: mode %o uid %d, %v; want a block device, 0600, root's", nodeA, st.Mode, st.Uid, err)
	}
	if v, _ := os.ReadFile(victim); string(v) != "untouched" {
		t.Fatalf("the link's target changed: %q", v)
	}
	sys := func(f *os.File, attr string) string {
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			t.Fatal(err)
		}
		v, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/loop/%s", unix.Major(st.Rdev), unix.Minor(st.Rdev), attr))
		if err != nil {
			return ""
		}
		return strings.TrimSpace(string(v))
	}
	if got := sys(da, "backing_file"); got != a.Name() {
		t.Errorf("the device is bound to %q; want %s", got, a.Name())
	}
	if sys(da, "partscan") != "0" || sys(da, "autoclear") != "1" {
		t.Errorf("partscan %q, autoclear %q; want 0 and 1", sys(da, "partscan"), sys(da, "autoclear"))
	}
	t.Logf("direct I/O to the image: %s", sys(da, "dio"))
	if left, _ := filepath.Glob(filepath.Join(dir, "*loop-control")); len(left) != 0 {
		t.Errorf("left behind: %v", left)
	}
	head := make([]byte, 7)
	if _, err := db.ReadAt(head, 0); err != nil || string(head) != "image b" {
		t.Errorf("the second device reads %q, %v; want its own image", head, err)
	}

	// Through the node, as a VMM opens it.
	vmm, err := os.OpenFile(nodeA, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vmm.WriteAt(bytes.Repeat([]byte("w"), 4096), 4096); err != nil {
		t.Fatal(err)
	}
	if err := vmm.Sync(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	if _, err := a.ReadAt(got, 4096); err != nil || !bytes.Equal(got, bytes.Repeat([]byte("w"), 4096)) {
		t.Errorf("the write through the device is not in the image: %q…, %v", got[:8], err)
	}

	// Unbound once its last user closes it: the agent first, then the VMM.
	da.Close()
	if sys(vmm, "backing_file") == "" {
		t.Fatal("unbound while the VMM has it open")
	}
	var rdev unix.Stat_t
	_ = unix.Fstat(int(vmm.Fd()), &rdev)
	vmm.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := os.Stat(fmt.Sprintf("/sys/dev/block/%d:%d/loop/backing_file", unix.Major(rdev.Rdev), unix.Minor(rdev.Rdev)))
		if err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("still bound after its last user closed it")
		}
		time.Sleep(20 * time.Millisecond)
	}

	// Read-only.
	ro, err := os.Open(filepath.Join(dir, "b.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	nodeR := filepath.Join(dir, "vol-r.img")
	dr, err := d.Attach(nodeR, ro, true)
	if err != nil {
		t.Fatal(err)
	}
	defer dr.Close()
	if n, err := unix.IoctlGetInt(int(dr.Fd()), unix.BLKROGET); err != nil || n != 1 {
		t.Errorf("BLKROGET %d, %v; want read-only", n, err)
	}
	if w, err := os.OpenFile(nodeR, os.O_WRONLY, 0); err == nil {
		_, werr := w.WriteAt([]byte("x"), 0)
		serr := w.Sync()
		w.Close()
		if werr == nil && serr == nil {
			t.Error("a write to the read-only device went through")
		}
	}
}

// TestPartitionScanningNodesAreRefused: a node whose loop module scans every device's
// partitions (max_part set) would have its kernel parse the partition table a guest wrote:
// nothing is bound there.
func TestPartitionScanningNodesAreRefused(t *testing.T) {
	sys := t.TempDir()
	params := filepath.Join(sys, "module", "loop", "parameters")
	if err := os.MkdirAll(params, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(params, "max_part"), []byte("8\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	f, err := os.Create(filepath.Join(dir, "disk.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	node := filepath.Join(dir, "vol.img")
	if dev, err := (Devices{Sys: sys}).Attach(node, f, false); err == nil || !strings.Contains(err.Error(), "max_part=8") {
		if dev != nil {
			dev.Close()
		}
		t.Fatalf("bound on a node scanning partitions: %v", err)
	}
	if _, err := os.Lstat(node); !os.IsNotExist(err) {
		t.Errorf("a node was made: %v", err)
	}
}
