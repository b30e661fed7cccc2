package guestmem_test

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
)

// TestMain: Fill's child is this binary again.
func TestMain(m *testing.M) {
	guestmem.Init()
	os.Exit(m.Run())
}

const size = 32 << 20

// image is a memory image of size bytes: a page of data every 64 KiB, zero pages, and a hole.
func image(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "memory")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	page := bytes.Repeat([]byte{0xa5}, 4096)
	for off := int64(0); off < size/2; off += 64 << 10 {
		if _, err := f.WriteAt(page, off); err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt(make([]byte, 4096), off+4096); err != nil { // zero, allocated
			t.Fatal(err)
		}
	}
	return path
}

// TestFillChargesTheVM: a restore's memory is filled by a child in the VM's cgroup, its pages
// charged there (not to the agent), and holds the image.
func TestFillChargesTheVM(t *testing.T) {
	path := image(t)
	set, err := cgroup.Prepare(cgroup.Root, "test-guestmem-fill", cgroup.Limits{MemoryBytes: 256 << 20, Pids: 64})
	if err != nil {
		t.Skipf("no cgroups here: %v", err)
	}
	t.Cleanup(func() { cgroup.Remove(cgroup.Root, "test-guestmem-fill") })
	mem, err := guestmem.Create("test", size)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	img, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	var dirs []string
	var child int
	err = guestmem.Fill(context.Background(), mem, img, func(pid int) error {
		child = pid
		var jerr error
		dirs, jerr = set.Join(pid, false)
		return jerr
	})
	if err != nil {
		t.Fatal(err)
	}
	if child == 0 || child == os.Getpid() {
		t.Fatalf("the fill ran in pid %d, not a child", child)
	}
	got := readAll(t, mem)
	want, _ := os.ReadFile(path)
	if !bytes.Equal(got, want) {
		t.Error("the filled memory is not the image")
	}
	charged := int64(-1)
	for _, d := range dirs {
		if v, ok := stat(filepath.Join(d, "memory.stat"), "shmem"); ok {
			charged = v
		}
	}
	if charged == -1 {
		t.Skip("no memory controller among the cgroups")
	}
	if charged < size/2/16 {
		t.Errorf("the VM's cgroup is charged %d bytes of shared memory, want the %d the fill wrote", charged, size/2/16)
	}
	t.Logf("the VM's cgroup is charged %d bytes of shared memory", charged)
}

// TestFillRefusesAnImageOfAnotherSize: an image that is not the guest's memory's size (a pulled
// snapshot of other resources) is refused before anything is copied.
func TestFillRefusesAnImageOfAnotherSize(t *testing.T) {
	mem, err := guestmem.Create("test", size*2)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	img, err := os.Open(image(t))
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	err = guestmem.Fill(context.Background(), mem, img, func(int) error { t.Error("a child started"); return nil })
	if err == nil || !strings.Contains(err.Error(), "not the guest's") {
		t.Errorf("Fill = %v, want a size mismatch", err)
	}
}

func stat(path, key string) (int64, bool) {
	f, err := os.Open(path)
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if ok && k == key {
			n, err := strconv.ParseInt(v, 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

func readAll(t *testing.T, f *os.File) []byte {
	t.Helper()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, fi.Size())
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}
