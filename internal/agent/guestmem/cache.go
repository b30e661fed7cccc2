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

// Cache keeps the memory of snapshots restored on this node, one memfd each, filled once and
// sealed against every change (F_SEAL_WRITE, GROW, SHRINK, SEAL), which every later restore of
// that snapshot maps privately: a copy's VMM reads the snapshot's pages where they are, and only
// the pages its guest writes become its own (copy-on-write, charged to the VM). The first
// restore of a snapshot fills a memory of its own, as fast as before, and has the cache fill
// the shared one beside it (Warm); the restores after it copy nothing.
//
// The memfds are filled whole (no holes: a private mapping of a hole would add a page to the
// shared memfd, charged to whichever VM touched it) by a child in the Charge, and their total
// there, those a VM still maps included, never exceeds the budget: a memory that does not fit
// after the idle ones are let go is not cached.
type Cache struct {
	budget int64
	charge Charge

	mu      sync.Mutex
	entries map[string]*entry // by image path
	tick    uint64
}

type entry struct {
	key  fileKey
	size int64
	f    *os.File // nil while it is filled
	used uint64   // the cache's tick of its last use
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

// ErrNotCached is Get's answer for a memory the cache does not hold (yet): the restore fills a
// memory of its own (Create, Fill), and may Warm the cache for the next.
var ErrNotCached = errors.New("the snapshot's memory is not cached")

func (c *Cache) on(size int64) bool {
	return c != nil && c.charge != nil && c.budget > 0 && size <= c.budget
}

// Get returns a descriptor of the cached memory of the image at img (size bytes: the guest's),
// for a VMM to map privately; the caller closes it. ErrNotCached: the cache does not hold the
// memory of that file, or is filling it.
func (c *Cache) Get(img string, size int64) (*os.File, error) {
	if !c.on(size) {
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
	defer c.mu.Unlock()
	e := c.entries[img]
	if e == nil || e.key != key || e.f == nil {
		return nil, ErrNotCached
	}
	c.tick++
	e.used = c.tick
	fd, err := unix.FcntlInt(e.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicating the cached memory: %w", err)
	}
	return os.NewFile(uintptr(fd), e.f.Name()), nil
}

// Warm fills the cache's memory of the image at img in the background, unless it holds it or
// is filling it. The channel gets the fill's outcome: nil once the memory is cached,
// ErrNotCached if there was nothing to do (cached, being filled, or no room), or why the fill
// failed.
func (c *Cache) Warm(img string, size int64) <-chan error {
	done := make(chan error, 1)
	if !c.on(size) {
		done <- ErrNotCached
		return done
	}
	key, err := keyOf(img)
	if err != nil || key.size != size {
		done <- ErrNotCached
		return done
	}
	c.mu.Lock()
	if e := c.entries[img]; e != nil && e.key == key {
		c.mu.Unlock()
		done <- ErrNotCached
		return done
	}
	c.dropLocked(img) // another file under the path, if any
	if err := c.makeRoomLocked(size); err != nil {
		c.mu.Unlock()
		done <- err
		return done
	}
	e := &entry{key: key, size: size}
	c.tick++
	e.used = c.tick
	c.entries[img] = e
	c.mu.Unlock()
	go func() {
		f, err := c.fill(img, key, size)
		c.mu.Lock()
		defer c.mu.Unlock()
		switch {
		case c.entries[img] != e: // forgotten meanwhile
			closeIf(f)
			err = ErrNotCached
		case err != nil:
			delete(c.entries, img)
		default:
			e.f = f
		}
		done <- err
	}()
	return done
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
			if e.f == nil {
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
// VMs restored from them keep what they map; a fill under way ends unused.
func (c *Cache) Forget(dir string) {
	if c == nil {
		return
	}
	dir = filepath.Clean(dir) + string(filepath.Separator)
	c.mu.Lock()
	defer c.mu.Unlock()
	for p := range c.entries {
		if strings.HasPrefix(p, dir) {
			c.dropLocked(p)
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
func (c *Cache) fill(img string, key fileKey, size int64) (*os.File, error) {
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
	fctx, cancel := context.WithTimeout(context.Background(), fillTimeout)
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
