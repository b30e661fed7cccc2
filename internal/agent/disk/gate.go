package disk

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/api/resource"
)

// ErrNodeBudget is returned when an image build would take the node past what its builds may
// hold together: bytes in flight (of the node, or of the tenant that asked), or the free space
// the state file system keeps. It says nothing about the image: it may fit later.
var ErrNodeBudget = errors.New("disk: the node's image builds are at their limit")

// BuildLimits bound the image builds of a node together. An image is bounded on its own by
// BaseStore.MaxBytes and MaxEntries; without these, ten tenants' decompression bombs built at
// once fill the state file system (each build holds its extracted tree and its disk) within the
// pull timeout, and every VM's sparse writable disk meets ENOSPC. Zero fields are unbounded.
type BuildLimits struct {
	// Concurrent is how many images the node builds at once; PerTenantConcurrent how many of
	// them one tenant (a namespace) asked for. A build waits for its turn within its context.
	Concurrent, PerTenantConcurrent int
	// InFlight is the bytes the node's builds hold at once on the state file system (the
	// extracted files, then the disk made of them); PerTenantInFlight those of one tenant's.
	InFlight, PerTenantInFlight int64
	// MinFree is the free space of the state file system that no build writes into: the
	// VMs' sparse disks grow there.
	MinFree int64
}

// gate admits builds under BuildLimits and counts what they hold.
type gate struct {
	limits  BuildLimits
	dir     string                      // on the state file system, for its free space
	statfs  func(string) (int64, error) // free bytes of the file system at a path
	mu      sync.Mutex
	changed chan struct{} // closed and replaced when a build ends
	running int
	held    int64
	tenants map[string]*tenantBuilds
	// unseen is what was charged since the file system's free space was last read: it is
	// read again once that passes statEvery, not at every write.
	unseen int64
	free   int64
	// reserved is what builds reserved for writes that come later (the disk mkfs makes of a
	// build's files), which a fresh reading of the free space does not show yet: it counts
	// until the build ends.
	reserved int64
}

// statEvery is how much builds write between two reads of the free space: what MinFree may be
// overrun by, at most, per build at once.
const statEvery = 8 << 20

type tenantBuilds struct {
	running int
	held    int64
}

// admission is one build's place in the gate: what it holds, released once.
type admission struct {
	g        *gate
	tenant   string
	held     int64
	reserved int64
	once     sync.Once
}

func freeBytes(path string) (int64, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil {
		return 0, fmt.Errorf("reading the free space of %s: %w", path, err)
	}
	return int64(fs.Bavail) * fs.Bsize, nil
}

func (g *gate) tenant(t string) *tenantBuilds {
	if g.tenants == nil {
		g.tenants = map[string]*tenantBuilds{}
	}
	tb := g.tenants[t]
	if tb == nil {
		tb = &tenantBuilds{}
		g.tenants[t] = tb
	}
	return tb
}

// admit waits until a build of tenant may start, or ctx ends.
func (g *gate) admit(ctx context.Context, tenant string) (*admission, error) {
	for {
		g.mu.Lock()
		if g.changed == nil {
			g.changed = make(chan struct{})
		}
		tb := g.tenant(tenant)
		if (g.limits.Concurrent <= 0 || g.running < g.limits.Concurrent) &&
			(g.limits.PerTenantConcurrent <= 0 || tb.running < g.limits.PerTenantConcurrent) {
			g.running++
			tb.running++
			g.mu.Unlock()
			return &admission{g: g, tenant: tenant}, nil
		}
		wait := g.changed
		g.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for a turn among the node's image builds (%d at once, %d per namespace): %w",
				g.limits.Concurrent, g.limits.PerTenantConcurrent, context.Cause(ctx))
		case <-wait:
		}
	}
}

// charge counts n more bytes held by the build, refusing them (and counting nothing) past the
// node's or the tenant's bytes in flight, or where the file system's free space would fall
// below MinFree.
func (a *admission) charge(n int64) error { return a.take(n, false) }

// reserve is charge for bytes written later, by another process (mkfs): they are kept off the
// free space until the build ends.
func (a *admission) reserve(n int64) error { return a.take(n, true) }

func (a *admission) take(n int64, later bool) error {
	g := a.g
	g.mu.Lock()
	defer g.mu.Unlock()
	tb := g.tenant(a.tenant)
	lim := g.limits
	switch {
	case lim.InFlight > 0 && g.held+n > lim.InFlight:
		return fmt.Errorf("%w: its builds would hold more than %s at once", ErrNodeBudget, bytesString(lim.InFlight))
	case lim.PerTenantInFlight > 0 && tb.held+n > lim.PerTenantInFlight:
		return fmt.Errorf("%w: the namespace's builds would hold more than %s at once", ErrNodeBudget, bytesString(lim.PerTenantInFlight))
	}
	if lim.MinFree > 0 {
		if g.unseen == 0 || g.unseen+n > statEvery {
			statfs := g.statfs
			if statfs == nil {
				statfs = freeBytes
			}
			free, err := statfs(g.dir)
			if err != nil {
				return err
			}
			g.free, g.unseen = free, 0
		}
		if g.free-g.reserved-g.unseen-n < lim.MinFree {
			g.unseen = 0 // read it again next time: a removal may have made room
			return fmt.Errorf("%w: the state file system has %s free and keeps %s for VMs' disks", ErrNodeBudget, bytesString(g.free), bytesString(lim.MinFree))
		}
		g.unseen += max(n, 1)
	}
	g.held += n
	tb.held += n
	a.held += n
	if later {
		g.reserved += n
		a.reserved += n
	}
	return nil
}

// done releases the build's turn and what it held (its build directory is gone by then).
func (a *admission) done() {
	a.once.Do(func() {
		g := a.g
		g.mu.Lock()
		defer g.mu.Unlock()
		tb := g.tenant(a.tenant)
		g.running--
		tb.running--
		g.held -= a.held
		tb.held -= a.held
		g.reserved -= a.reserved
		if tb.running == 0 && tb.held == 0 {
			delete(g.tenants, a.tenant)
		}
		close(g.changed)
		g.changed = make(chan struct{})
	})
}

// inFlight returns the builds running and the bytes they hold.
func (g *gate) inFlight() (builds int, bytes int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.running, g.held
}

// chargingWriter charges every write to its admission before it writes: a file being
// extracted is counted as it grows, not only once it is whole.
type chargingWriter struct {
	w io.Writer
	a *admission
}

func (c chargingWriter) Write(p []byte) (int, error) {
	if err := c.a.charge(int64(len(p))); err != nil {
		return 0, err
	}
	return c.w.Write(p)
}

func bytesString(n int64) string { return resource.NewQuantity(n, resource.BinarySI).String() }
