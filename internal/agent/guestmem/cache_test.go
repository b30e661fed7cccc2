package guestmem_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
)

// charge is a cgroup of the test's, as the agent's cache has one.
type charge struct{ set *cgroup.Set }

func (c charge) Join(pid int) error {
	_, err := c.set.Join(pid, false)
	return err
}

func (c charge) Shmem() (int64, error) { return c.set.MemoryStat("shmem") }

// get is a restore's, by VM user: the memory of img once the cache has filled it (Warm).
func get(c *guestmem.Cache, img string, size int64, user string) (*os.File, error) {
	<-c.Warm(img, size)
	return c.Get(img, size, user)
}

func testCharge(t *testing.T, name string) charge {
	t.Helper()
	set, err := cgroup.Prepare(cgroup.Root, name, cgroup.Limits{MemoryBytes: 1 << 30, Pids: 16})
	if err != nil {
		t.Skipf("no cgroups here: %v", err)
	}
	t.Cleanup(func() { cgroup.Remove(cgroup.Root, name) })
	if _, err := set.MemoryStat("shmem"); err != nil {
		t.Skipf("no memory controller here: %v", err)
	}
	return charge{set}
}

// cached says whether the cache holds img's memory (a restore of it would get it).
func cached(t *testing.T, c *guestmem.Cache, img string) bool {
	t.Helper()
	f, err := c.Get(img, size, "probe")
	if err != nil {
		return false
	}
	f.Close()
	c.Release("probe")
	return true
}

// TestCacheSharesOneMemory: the first restore of a snapshot is told to fill its own (the cache
// fills beside it); the restores after it get one memory, filled once, whole (no holes: every
// page allocated, charged to the cache's cgroup), holding the image. To make room, only
// memories no running VM was given go, least recently used first, and only if that makes enough
// room; a forgotten snapshot's memory goes once nothing maps it; a file replaced under its path
// is filled anew.
func TestCacheSharesOneMemory(t *testing.T) {
	ch := testCharge(t, "test-guestmem-cache")
	c := guestmem.NewCache(3*size, ch)
	defer c.Close()
	img := image(t)
	if _, err := c.Get(img, size, "vm-a"); !errors.Is(err, guestmem.ErrNotCached) {
		t.Fatalf("the first restore of a snapshot got %v, not ErrNotCached: it fills its own", err)
	}
	a, err := get(c, img, size, "vm-a")
	if err != nil {
		t.Fatal(err)
	}
	b, err := get(c, img, size, "vm-b")
	if err != nil {
		t.Fatal(err)
	}
	var sa, sb unix.Stat_t
	_ = unix.Fstat(int(a.Fd()), &sa)
	_ = unix.Fstat(int(b.Fd()), &sb)
	if sa.Ino != sb.Ino {
		t.Error("two restores of one snapshot got two memories")
	}
	if sa.Blocks*512 < size {
		t.Errorf("the cached memory holds %d bytes, not all its %d: a hole would be filled by whichever VM touched it", sa.Blocks*512, size)
	}
	want, _ := os.ReadFile(img)
	if !bytes.Equal(readAll(t, a), want) {
		t.Error("the cached memory is not the image")
	}
	if held, _ := ch.Shmem(); held < size {
		t.Errorf("the cache's cgroup is charged %d bytes of shared memory, not the memory's %d", held, size)
	}
	if fd, err := unix.FcntlInt(a.Fd(), unix.F_GETFD, 0); err != nil || fd&unix.FD_CLOEXEC == 0 {
		t.Error("a cached memory's descriptor is not close-on-exec")
	}
	if _, err := get(c, img, size*4, "vm-x"); err == nil {
		t.Error("a memory bigger than the budget was served")
	}

	// Two more fit beside img's, whose VMs run: img2's VM is gone, then img3's.
	img2, img3, img4, img5 := image(t), image(t), image(t), image(t)
	for i, p := range []string{img2, img3} {
		m, err := get(c, p, size, fmt.Sprint("vm-", i))
		if err != nil {
			t.Fatal(err)
		}
		m.Close()
		c.Release(fmt.Sprint("vm-", i))
	}
	// A fourth takes the place of the least recently used one no VM runs on (img2's), and
	// of no other.
	m4, err := get(c, img4, size, "vm-4")
	if err != nil {
		t.Fatalf("a memory that fits once an idle one goes: %v", err)
	}
	defer m4.Close()
	if cached(t, c, img2) || !cached(t, c, img3) || !cached(t, c, img) {
		t.Errorf("making room let go of img2 %v, img3 %v, img %v; want img2's alone", !cached(t, c, img2), !cached(t, c, img3), !cached(t, c, img))
	}
	m3, err := c.Get(img3, size, "vm-3")
	if err != nil {
		t.Fatal(err)
	}
	// Every memory has a VM: a fifth does not fit, and none is let go for it.
	if m5, err := get(c, img5, size, "vm-5"); err == nil {
		m5.Close()
		t.Error("a memory was cached with every memory in the budget mapped by a VM")
	}
	if !cached(t, c, img3) || !cached(t, c, img4) || !cached(t, c, img) {
		t.Error("a memory a VM runs on was let go for one that did not fit")
	}
	if held, _ := ch.Shmem(); held > 3*size {
		t.Errorf("the cache's cgroup holds %d bytes of shared memory, over its budget of %d", held, 3*size)
	}

	// Snapshots removed: their memories leave the cache; those VMs map stay until unmapped.
	c.Forget(filepath.Dir(img3))
	c.Forget(filepath.Dir(img4))
	if cached(t, c, img3) || cached(t, c, img4) {
		t.Error("a forgotten memory is still served")
	}
	if held, _ := ch.Shmem(); held < 3*size {
		t.Errorf("memories VMs still map were freed: the cgroup holds %d bytes", held)
	}
	m3.Close()
	m4.Close()
	a.Close()
	b.Close()
	c.Forget(filepath.Dir(img))
	if held, _ := ch.Shmem(); held > size/4 {
		t.Errorf("with every memory forgotten and unmapped, the cache's cgroup holds %d bytes", held)
	}

	// The image replaced under its path (pulled again): a new memory.
	if err := os.WriteFile(img2, bytes.Repeat([]byte{1}, size), 0o600); err != nil {
		t.Fatal(err)
	}
	n, err := get(c, img2, size, "vm-n")
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if got := readAll(t, n); got[0] != 1 || got[size-1] != 1 {
		t.Error("the memory of an image replaced under its path is the old one")
	}
	if _, err := get(c, img3, size/2, "vm-y"); err == nil {
		t.Error("an image of another size than the guest's memory was served")
	}
}

// TestCacheOffWithoutBudgetOrCgroup: a cache that cannot bound what it holds serves nothing.
func TestCacheOffWithoutBudgetOrCgroup(t *testing.T) {
	img := image(t)
	for _, c := range []*guestmem.Cache{nil, guestmem.NewCache(0, charge{}), guestmem.NewCache(1<<30, nil)} {
		if _, err := get(c, img, size, "vm"); !errors.Is(err, guestmem.ErrNotCached) {
			t.Errorf("Get = %v, want ErrNotCached", err)
		}
	}
}

// TestCachedMemoryCannotBeChanged is the attack of a hostile VMM on a snapshot's memory that
// other VMs map: with the descriptor it is given, and the file reopened read-write through
// /proc as QEMU does, it writes, maps it shared and writable (or read-only, then makes the
// mapping writable), truncates, grows, punches a hole, discards pages (MADV_REMOVE), copies
// into it (copy_file_range) and adds a seal; each is refused, and what it writes to its private mapping is its
// own: a second mapping, and the next restore, see the snapshot unchanged. (Seals do not depend
// on the uid: the test runs as root, QEMU as the VM's.)
func TestCachedMemoryCannotBeChanged(t *testing.T) {
	ch := testCharge(t, "test-guestmem-attack")
	c := guestmem.NewCache(2*size, ch)
	defer c.Close()
	img := image(t)
	want, _ := os.ReadFile(img)
	mem, err := get(c, img, size, "vm-a")
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	re, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", mem.Fd()), os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("reopening the memory read-write, as QEMU does: %v", err)
	}
	defer re.Close()
	for _, f := range []*os.File{mem, re} {
		fd := int(f.Fd())
		if _, err := unix.Pwrite(fd, []byte("owned"), 0); err == nil {
			t.Error("a write to the shared memory succeeded")
		}
		if b, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
			b[0] ^= 0xff
			_ = unix.Munmap(b)
			t.Error("the shared memory was mapped shared and writable")
		}
		if b, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ, unix.MAP_SHARED); err == nil {
			if unix.Mprotect(b, unix.PROT_READ|unix.PROT_WRITE) == nil {
				t.Error("a read-only shared mapping of the shared memory was made writable")
			}
			if unix.Madvise(b, unix.MADV_REMOVE) == nil {
				t.Error("pages of the shared memory were discarded")
			}
			_ = unix.Munmap(b)
		}
		if src, err := os.Open(img); err == nil {
			off := int64(0)
			if n, err := unix.CopyFileRange(int(src.Fd()), nil, fd, &off, 4096, 0); err == nil && n > 0 {
				t.Error("the shared memory was copied into")
			}
			src.Close()
		}
		if err := unix.Ftruncate(fd, size/2); err == nil {
			t.Error("the shared memory was shrunk")
		}
		if err := unix.Ftruncate(fd, size*2); err == nil {
			t.Error("the shared memory was grown")
		}
		if err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, size); err == nil {
			t.Error("a hole was punched in the shared memory")
		}
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_FUTURE_WRITE); err == nil {
			t.Error("the shared memory's seals were changed")
		}
	}
	// What the VMM can do: map it privately, as QEMU does, and write there.
	priv, err := unix.Mmap(int(re.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("a private mapping, as QEMU makes: %v", err)
	}
	for i := range priv {
		priv[i] = 0x5a
	}
	other, err := unix.Mmap(int(mem.Fd()), 0, size, unix.PROT_READ, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(other, want) {
		t.Error("another mapping sees what a VM wrote to its own")
	}
	_ = unix.Munmap(other)
	_ = unix.Munmap(priv)
	next, err := get(c, img, size, "vm-b")
	if err != nil {
		t.Fatal(err)
	}
	defer next.Close()
	if !bytes.Equal(readAll(t, next), want) {
		t.Error("the next restore's memory is not the snapshot's")
	}
}
