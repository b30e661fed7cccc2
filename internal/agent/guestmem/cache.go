package guestmem

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Charge is where a Cache's memories are charged and bounded: a cgroup of their own, whose
// usage is the truth of what they hold (a memory the cache let go stays while a VM maps it).
type Charge interface {
	// Join moves process pid into it.
	Join(pid int) error
	// Usage is the memory charged there now, in bytes.
	Usage() (int64, error)
}

// Cache keeps the memory of each snapshot restored on this node as one memfd, filled once and
// sealed against every change (F_SEAL_WRITE, GROW, SHRINK, SEAL), which every restore of that
// snapshot maps privately: a copy's VMM reads the snapshot's pages where they are, and only
// the pages its guest writes become its own (copy-on-write, charged to the VM). No restore
// after the first copies the memory.
//
// The memfds are filled whole (no holes: a private mapping of a hole would add a page to the
// shared memfd, charged to whichever VM touched it) by a child in the Charge, and their total
// there, those a VM still maps included, never exceeds the budget: a memory that does not fit
// after the idle ones are let go is not cached, and its restore fills a memory of its own.
type Cache struct {
	budget int64
	charge Charge

	mu      sync.Mutex
	entries map[string]*entry // by image path
	tick    uint64
}

type entry struct {
	key   fileKey
	size  int64
	ready chan struct{} // closed once f or err is set
	f     *os.File
	err   error
	used  uint64 // the cache's tick of its last use
}

// fileKey is which file an image path named when its memory was filled: a snapshot pulled
// again, or taken anew under the same path, is another.
type fileKey struct {
	dev, ino uint64
	size     int64
	mtime    int64
}

// NewCache returns a cache of at most budget bytes, charged to charge. A nil charge or a
// budget of 0 caches nothing: without a cgroup the memory a VM still maps is not known.
func NewCache(budget int64, charge Charge) *Cache {
	return &Cache{budget: budget, charge: charge, entries: map[string]*entry{}}
}

// ErrNotCached is Get's answer for a memory that does not fit the cache (or a cache that is
// off): the restore fills a memory of its own (Create, Fill).
var ErrNotCached = errors.New("the snapshot's memory is not cached")

// Get returns a descriptor of the memory of the image at img (size bytes: the guest's), for a
// VMM to map privately, filling it first if it is not cached; the caller closes it. Restores
// of one snapshot at once wait for one fill.
func (c *Cache) Get(ctx context.Context, img string, size int64) (*os.File, error) {
	if c == nil || c.charge == nil || c.budget <= 0 || size > c.budget {
		return nil, ErrNotCached
	}
	key, err := keyOf(img)
	if err != nil {
		return nil, err
	}
	if key.size != size {
		return nil, fmt.Errorf("the memory image is %d bytes, not the guest's %d", key.size, size)
	}
	c.mu.Lock()
	e := c.entries[img]
	if e != nil && e.key != key {
		c.dropLocked(img) // another file under the path
		e = nil
	}
	filling := e == nil
	if filling {
		if err := c.makeRoomLocked(size); err != nil {
			c.mu.Unlock()
			return nil, err
		}
		e = &entry{key: key, size: size, ready: make(chan struct{})}
		c.entries[img] = e
	}
	c.tick++
	e.used = c.tick
	c.mu.Unlock()

	if filling {
		e.f, e.err = c.fill(ctx, img, key, size)
		close(e.ready)
		if e.err != nil {
			c.mu.Lock()
			if c.entries[img] == e {
				delete(c.entries, img)
			}
			c.mu.Unlock()
		}
	}
	select {
	case <-e.ready:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if e.err != nil {
		return nil, e.err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.entries[img] != e || e.f == nil {
		return nil, ErrNotCached // forgotten while it was filled
	}
	fd, err := unix.FcntlInt(e.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicating the cached memory: %w", err)
	}
	return os.NewFile(uintptr(fd), e.f.Name()), nil
}

// makeRoomLocked lets go of the least recently used idle memories until size more bytes fit
// the budget, by what the Charge says it holds (memories still filling counted whole), or
// returns ErrNotCached.
func (c *Cache) makeRoomLocked(size int64) error {
	for {
		used, err := c.charge.Usage()
		if err != nil {
			return fmt.Errorf("reading the snapshot memory cache's usage: %w", err)
		}
		for _, e := range c.entries {
			if e.f == nil && e.err == nil {
				used += e.size // filling: charged in part
			}
		}
		if used+size <= c.budget {
			return nil
		}
		var oldest string
		for p, e := range c.entries {
			if e.f != nil && (oldest == "" || e.used < c.entries[oldest].used) {
				oldest = p
			}
		}
		if oldest == "" {
			return ErrNotCached
		}
		c.dropLocked(oldest)
	}
}

func (c *Cache) dropLocked(img string) {
	e := c.entries[img]
	delete(c.entries, img)
	if e != nil && e.f != nil {
		e.f.Close() // its pages go once no VM maps them
	}
}

// Forget lets go of the memories of the images under dir: a snapshot removed from the node.
// VMs restored from them keep what they map.
func (c *Cache) Forget(dir string) {
	if c == nil {
		return
	}
	dir = filepath.Clean(dir) + string(filepath.Separator)
	c.mu.Lock()
	defer c.mu.Unlock()
	for p, e := range c.entries {
		if strings.HasPrefix(p, dir) && (e.f != nil || e.err != nil) {
			c.dropLocked(p)
		} else if strings.HasPrefix(p, dir) {
			delete(c.entries, p) // filling: its Get finds it gone and closes nothing it returns
			go func() { <-e.ready; closeIf(e.f) }()
		}
	}
}

// Close lets go of every memory.
func (c *Cache) Close() {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for p := range c.entries {
		c.dropLocked(p)
	}
}

func closeIf(f *os.File) {
	if f != nil {
		f.Close()
	}
}

// fill makes the memory of img: a memfd of size bytes, filled whole in a child charged to the
// cache, then sealed against every change.
func (c *Cache) fill(ctx context.Context, img string, key fileKey, size int64) (*os.File, error) {
	in, err := os.OpenFile(img, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("opening the memory image: %w", err)
	}
	defer in.Close()
	if k, err := keyOfFile(in); err != nil || k != key {
		return nil, fmt.Errorf("the memory image %s changed as it was opened", img)
	}
	fd, err := unix.MemfdCreate("imp-snapshot:"+filepath.Base(filepath.Dir(img)), unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("creating the snapshot's memory: %w", err)
	}
	mem := os.NewFile(uintptr(fd), "memfd:snapshot")
	ok := false
	defer func() {
		if !ok {
			mem.Close()
		}
	}()
	if err := mem.Truncate(size); err != nil {
		return nil, fmt.Errorf("sizing the snapshot's memory: %w", err)
	}
	if _, err := unix.FcntlInt(mem.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_GROW|unix.F_SEAL_SHRINK); err != nil {
		return nil, fmt.Errorf("sealing the snapshot's memory: %w", err)
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), fillTimeout)
	defer cancel()
	if err := fillIn(fctx, mem, in, true, c.charge.Join); err != nil {
		return nil, err
	}
	// Written by the child alone, through write(2): no mapping of it is writable, so the seal
	// takes, and from here no descriptor of it writes, maps it shared and writable, punches a
	// hole in it or changes its seals.
	if _, err := unix.FcntlInt(mem.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_WRITE|unix.F_SEAL_SEAL); err != nil {
		return nil, fmt.Errorf("sealing the snapshot's memory against writes: %w", err)
	}
	ok = true
	return mem, nil
}

// fillTimeout bounds a fill: a copy of at most a guest's memory.
const fillTimeout = 2 * time.Minute

func keyOf(path string) (fileKey, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return fileKey{}, fmt.Errorf("the memory image: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fileKey{}, fmt.Errorf("the memory image %s is not a regular file", path)
	}
	return fileKey{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim.Nano()}, nil
}

func keyOfFile(f *os.File) (fileKey, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fileKey{}, err
	}
	return fileKey{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim.Nano()}, nil
}
