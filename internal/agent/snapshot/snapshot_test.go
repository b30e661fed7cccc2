package snapshot

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/disk"
)

// TestStore: a snapshot is in place whole or not at all, its files the agent's alone; a
// manifest in another snapshot's directory is refused; Remove takes what a taking left too.
func TestStore(t *testing.T) {
	s := &Store{Dir: filepath.Join(t.TempDir(), "snapshots")}
	uid := types.UID("u1")
	tmp, err := s.Begin(uid)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tmp, StateFile), []byte("state"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Read(uid); err == nil {
		t.Fatal("a snapshot being taken reads as one")
	}
	if err := s.Commit(tmp, &Manifest{Namespace: "ns", Name: "snap", UID: uid, Token: "t"}); err != nil {
		t.Fatal(err)
	}
	m, err := s.Read(uid)
	if err != nil || m.Namespace != "ns" || m.Token != "t" {
		t.Fatalf("read %+v, %v", m, err)
	}
	for _, p := range []string{s.Path(uid), s.File(uid, ManifestFile)} {
		fi, err := os.Stat(p)
		if err != nil || fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s: %v %v", p, fi.Mode(), err)
		}
	}
	// A manifest copied into another snapshot's directory says whose it is.
	other := types.UID("u2")
	if err := os.MkdirAll(s.Path(other), 0o700); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(s.File(uid, ManifestFile))
	_ = os.WriteFile(s.File(other, ManifestFile), data, 0o600)
	if _, err := s.Read(other); err == nil || !strings.Contains(err.Error(), "is of snapshot u1") {
		t.Errorf("a manifest of another snapshot: %v", err)
	}
	if _, err := s.Begin(other); err != nil {
		t.Fatal(err)
	}
	uids, _ := s.List()
	if len(uids) != 2 {
		t.Errorf("list %v", uids)
	}
	if err := s.Remove(other); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.Path(other) + ".tmp"); !os.IsNotExist(err) {
		t.Errorf("what a taking left stays: %v", err)
	}
}

// TestCompatible: a restore needs the VMM, its version, acceleration, kernel, initramfs and CPU
// the snapshot was taken with.
func TestCompatible(t *testing.T) {
	h := Host{VMM: impv1.VMMQEMU, VMMVersion: "7.2", Accel: "tcg", Kernel: "k", Initramfs: "i", CPU: "c"}
	m := &Manifest{Host: h}
	if err := m.Compatible(h); err != nil {
		t.Fatal(err)
	}
	for want, change := range map[string]func(*Host){
		"taken under qemu; this node runs the VM under firecracker": func(h *Host) { h.VMM = impv1.VMMFirecracker },
		"taken under qemu 7.2; this node has 8.0":                   func(h *Host) { h.VMMVersion = "8.0" },
		"with tcg acceleration; this node has kvm":                  func(h *Host) { h.Accel = "kvm" },
		"guest kernel":      func(h *Host) { h.Kernel = "other" },
		"initramfs":         func(h *Host) { h.Initramfs = "other" },
		"another CPU model": func(h *Host) { h.CPU = "other" },
	} {
		o := h
		change(&o)
		if err := m.Compatible(o); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v", want, err)
		}
	}
	if CPU("model name\t: A\nflags\t: x y\n") == CPU("model name\t: A\nflags\t: x y z\n") {
		t.Error("CPU ignores the flags")
	}
}

// TestCopyDisk: a sparse copy keeps the data and the holes, and never writes through a link or
// over a file.
func TestCopyDisk(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	_ = f.Truncate(64 << 20)
	_, _ = f.WriteAt(bytes.Repeat([]byte("a"), 4096), 0)
	_, _ = f.WriteAt(bytes.Repeat([]byte("b"), 4096), 32<<20)
	f.Close()
	dst := filepath.Join(dir, "dst")
	if err := CopyDisk(src, dst); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(src)
	b, _ := os.ReadFile(dst)
	if !bytes.Equal(a, b) {
		t.Fatal("the copy differs")
	}
	if n, _ := disk.Allocated(dst); n > 1<<20 {
		t.Errorf("the copy allocates %d bytes of a 64 MiB file holding 8 KiB", n)
	}
	if err := CopyDisk(src, dst); err == nil {
		t.Error("copied over an existing file")
	}
	link := filepath.Join(dir, "link")
	_ = os.Symlink(src, link)
	if err := CopyDisk(link, filepath.Join(dir, "x")); err == nil {
		t.Error("copied through a symbolic link")
	}
}
