package guestmem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Charge is where a Cache's memories are charged and bounded: a cgroup of their own, whose
// shared memory is the truth of what they hold (a memory the cache let go stays while a VM
// maps it, and an agent that restarted finds the memories its VMs map there).
type Charge interface {
	// Join moves process pid into it.
	Join(pid int) error
	// Shmem is the shared memory (memfd pages) charged there now, in bytes.
	Shmem() (int64, error)
}

// Cache keeps the memory of snapshots restored on this node, one memfd each, filled once and
// sealed against every change (F_SEAL_WRITE, GROW, SHRINK, SEAL), which every later restore of
// that snapshot maps privately: a copy's VMM reads the snapshot's pages where they are, and only
// the pages its guest writes become its own (copy-on-write, charged to the VM). The first
// restore of a snapshot fills a memory of its own, as fast as before, and has the cache fill
// the shared one beside it (Warm); the restores after it copy nothing.
//
// The memfds are filled whole (no holes: a private mapping of a hole would add a page to the
// shared memfd, charged to whichever VM touched it) by a child in the Charge, and the shared
// memory there, that of memories VMs still map included, never exceeds the budget: to make
// room, memories no running VM was given go, least recently used first, and only if that makes
// enough room; else the memory is not cached.
type Cache struct {
	budget int64
	charge Charge

	mu      sync.Mutex
	entries map[string]*entry // by image path
	tick    uint64
}

type entry struct {
	key    fileKey
	size   int64
	f      *os.File           // nil while it is filled
	cancel context.CancelFunc // ends the fill
	users  map[string]bool    // the VMs (their UIDs) given it, until Release
	used   uint64             // the cache's tick of its last use
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
// for the VMM of VM user to map privately; the caller closes it, and Releases user once that VMM
// is gone (until then the memory is not let go to make room). ErrNotCached: the cache does not
// hold the memory of that file, or is filling it.
func (c *Cache) Get(img string, size int64, user string) (*os.File, error) {
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
	fd, err := unix.FcntlInt(e.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicating the cached memory: %w", err)
	}
	c.tick++
	e.used = c.tick
	e.users[user] = true
	return os.NewFile(uintptr(fd), e.f.Name()), nil
}

// Release says the VMM of VM user, given memories by Get, is gone.
func (c *Cache) Release(user string) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.entries {
		delete(e.users, user)
	}
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
	ctx, cancel := context.WithTimeout(context.Background(), fillTimeout)
	e := &entry{key: key, size: size, cancel: cancel, users: map[string]bool{}}
	c.tick++
	e.used = c.tick
	c.entries[img] = e
	c.mu.Unlock()
	go func() {
		defer cancel()
		f, err := c.fill(ctx, img, key, size)
		c.mu.Lock()
		defer c.mu.Unlock()
		switch {
		case c.entries[img] != e: // let go of meanwhile
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

// makeRoomLocked makes size bytes of room within the budget, by what the Charge holds (fills
// under way counted whole): it lets go of memories no VM was given, least recently used first,
// only if they make enough room, and returns ErrNotCached if they would not.
func (c *Cache) makeRoomLocked(size int64) error {
	held, err := c.charge.Shmem()
	if err != nil {
		return fmt.Errorf("reading the snapshot memory cache's usage: %w", err)
	}
	var idle []string
	var freeable int64
	for p, e := range c.entries {
		switch {
		case e.f == nil:
			held += e.size // filling: charged in part
		case len(e.users) == 0:
			idle = append(idle, p)
			freeable += e.size
		}
	}
	if held+size <= c.budget {
		return nil
	}
	if held-freeable+size > c.budget {
		return ErrNotCached // what VMs map leaves no room: nothing is let go for nothing
	}
	slices.SortFunc(idle, func(a, b string) int { return cmp.Compare(c.entries[a].used, c.entries[b].used) })
	for _, p := range idle {
		held -= c.entries[p].size
		c.dropLocked(p)
		if held+size <= c.budget {
			break
		}
	}
	return nil
}

// dropLocked lets go of the memory of img: its pages go once no VM maps them; a fill under way
// is ended.
func (c *Cache) dropLocked(img string) {
	e := c.entries[img]
	delete(c.entries, img)
	if e == nil {
		return
	}
	if e.f != nil {
		e.f.Close()
	} else if e.cancel != nil {
		e.cancel()
	}
}

// Forget lets go of the memories of the images under dir: a snapshot removed from the node.
// VMs restored from them keep what they map; a fill under way is ended.
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
	if err := fillIn(ctx, mem, in, true, c.charge.Join); err != nil {
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
	return keyOfStat(&st), nil
}

func keyOfFile(f *os.File) (fileKey, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fileKey{}, err
	}
	return keyOfStat(&st), nil
}

func keyOfStat(st *unix.Stat_t) fileKey {
	return fileKey{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim.Nano()}
}
