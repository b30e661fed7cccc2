package disk

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/testregistry"
)

// smallFS mounts a tmpfs of size bytes at a new directory: the state file system of a node
// that bombs could fill.
func smallFS(t *testing.T, size int64) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("needs root, to mount a small file system")
	}
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d,mode=0700", size)); err != nil {
		t.Fatalf("mounting a tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// TestBombsDoNotFillTheNode performs the attack of issue 27 (item 5): tenants in three
// namespaces start six VMs at once, each with an image that compresses to almost nothing and
// extracts to more than the node's free space. The state file system's free space is sampled
// throughout: it never falls below what the node keeps for VMs' disks, no more builds run than
// the limits allow (in all, and per namespace), each bomb fails with ErrNodeBudget, and an
// honest image builds afterwards, the bombs' bytes all given back.
func TestBombsDoNotFillTheNode(t *testing.T) {
	requireTools(t)
	const mib = 1 << 20
	fsDir := smallFS(t, 320*mib)
	host := testregistry.Start(t, "", "")
	var bombs []name.Digest
	for i := range 6 {
		bombs = append(bombs, testregistry.Push(t, host, fmt.Sprintf("bomb%d", i), anonymous, testregistry.Bomb(t, fmt.Sprint(i), 400*mib)))
	}
	honest := testregistry.Push(t, host, "honest", anonymous, layer(t, file("etc/msg", "hello\n")))
	for _, tc := range []struct {
		name   string
		limits BuildLimits
	}{
		{"bytes in flight", BuildLimits{Concurrent: 2, PerTenantConcurrent: 1, InFlight: 160 * mib, PerTenantInFlight: 120 * mib, MinFree: 96 * mib}},
		{"free space kept", BuildLimits{Concurrent: 3, PerTenantConcurrent: 1, MinFree: 96 * mib}},
	} {
		t.Run(tc.name, func(t *testing.T) { bombNode(t, fsDir, tc.limits, bombs, honest) })
	}
}

func bombNode(t *testing.T, fsDir string, limits BuildLimits, bombs []name.Digest, honest name.Digest) {
	const mib = 1 << 20
	store := &BaseStore{Dir: filepath.Join(fsDir, "images"), MaxBytes: 8 << 30, Limits: limits}
	t.Cleanup(func() { _ = os.RemoveAll(store.Dir) })

	// Sample the free space and the builds running while the bombs are built.
	stop := make(chan struct{})
	var sampled sync.WaitGroup
	minFree := int64(1 << 62)
	var maxBuilds, maxPerTenant atomic.Int64
	sampled.Add(1)
	go func() {
		defer sampled.Done()
		for {
			if free, err := freeBytes(fsDir); err == nil {
				minFree = min(minFree, free)
			}
			g := store.buildGate()
			g.mu.Lock()
			maxBuilds.Store(max(maxBuilds.Load(), int64(g.running)))
			for _, tb := range g.tenants {
				maxPerTenant.Store(max(maxPerTenant.Load(), int64(tb.running)))
			}
			g.mu.Unlock()
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	errs := make([]error, len(bombs))
	var wg sync.WaitGroup
	for i, b := range bombs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, errs[i] = store.Ensure(ctx, fmt.Sprintf("team-%d", i%3), b, anonymous)
		}()
	}
	wg.Wait()
	close(stop)
	sampled.Wait()

	for i, err := range errs {
		if !errors.Is(err, ErrNodeBudget) {
			t.Errorf("bomb %d: %v; want ErrNodeBudget", i, err)
		}
	}
	// Each build may overrun MinFree by what it writes between two reads of the free space.
	if floor := limits.MinFree - int64(limits.Concurrent)*statEvery; minFree < floor {
		t.Errorf("the state file system fell to %d MiB free; the node keeps %d MiB", minFree/mib, limits.MinFree/mib)
	}
	if n := maxBuilds.Load(); n > int64(limits.Concurrent) {
		t.Errorf("%d builds ran at once; the limit is %d", n, limits.Concurrent)
	}
	if n := maxPerTenant.Load(); n > int64(limits.PerTenantConcurrent) {
		t.Errorf("%d builds of one namespace ran at once; the limit is %d", n, limits.PerTenantConcurrent)
	}
	t.Logf("free space at least %d MiB; builds at once %d, per namespace %d", minFree/mib, maxBuilds.Load(), maxPerTenant.Load())

	if u, err := store.Usage(); err != nil || u.Builds != 0 || u.BuildBytes != 0 || u.Disks != 0 {
		t.Errorf("after the bombs: %+v, %v; want nothing held", u, err)
	}
	if _, _, err := store.Ensure(ctx, "team-0", honest, anonymous); err != nil {
		t.Fatalf("an honest image after the bombs: %v", err)
	}
	if u, err := store.Usage(); err != nil || u.Disks != 1 || u.DiskBytes <= 0 || u.Builds != 0 || u.BuildBytes != 0 {
		t.Errorf("with one base disk: %+v, %v", u, err)
	}
	left, _ := filepath.Glob(filepath.Join(store.Dir, ".build-*"))
	if len(left) != 0 {
		t.Errorf("build directories left: %v", left)
	}
}

// TestBuildTurns: a build waits for its turn within its context, and a tenant's second build
// waits for its first even while the node has room.
func TestBuildTurns(t *testing.T) {
	g := &gate{limits: BuildLimits{Concurrent: 2, PerTenantConcurrent: 1}}
	ctx := context.Background()
	a1, err := g.admit(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if _, err := g.admit(short, "a"); err == nil {
		t.Fatal("a namespace's second build started beside its first")
	}
	b1, err := g.admit(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *admission)
	go func() {
		c, _ := g.admit(ctx, "c")
		got <- c
	}()
	select {
	case <-got:
		t.Fatal("a third build started beside two, the node's limit")
	case <-time.After(20 * time.Millisecond):
	}
	a1.done()
	a1.done() // once only
	if c := <-got; c == nil {
		t.Fatal("the waiting build did not start when one ended")
	}
	if n, _ := g.inFlight(); n != 2 {
		t.Errorf("%d builds running; want 2", n)
	}
	b1.done()
}

// TestChargeBounds: bytes past the node's or the tenant's in-flight bound, or into the free
// space kept, are refused and counted nowhere; what a build held is given back at its end.
func TestChargeBounds(t *testing.T) {
	free := int64(1000)
	g := &gate{limits: BuildLimits{InFlight: 100, PerTenantInFlight: 60, MinFree: 850}, statfs: func(string) (int64, error) { return free, nil }}
	ctx := context.Background()
	a, _ := g.admit(ctx, "a")
	b, _ := g.admit(ctx, "b")
	for _, tc := range []struct {
		name string
		adm  *admission
		n    int64
		ok   bool
	}{
		{"within", a, 50, true},
		{"past the tenant's", a, 20, false},
		{"another tenant", b, 40, true},
		{"past the node's", b, 20, false},
		{"up to the node's", b, 10, true},
	} {
		if err := tc.adm.charge(tc.n); (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrNodeBudget)) {
			t.Errorf("%s: charge(%d) = %v", tc.name, tc.n, err)
		}
	}
	if _, held := g.inFlight(); held != 100 {
		t.Errorf("held %d; want 100", held)
	}
	a.done()
	b.done()
	if _, held := g.inFlight(); held != 0 {
		t.Errorf("held %d after the builds; want 0", held)
	}
	c, _ := g.admit(ctx, "c")
	defer c.done()
	free = 900
	if err := c.charge(60); !errors.Is(err, ErrNodeBudget) {
		t.Errorf("charge into the free space kept: %v", err)
	}
	if err := c.charge(40); err != nil {
		t.Errorf("charge above the free space kept: %v", err)
	}
}

// TestDeepNamesAreCounted (review of issue 27, item 5): the directories an entry's name makes
// count as entries and are charged, so one entry a/a/.../f cannot make more directories than
// the budget allows; a name deeper than maxDepth or longer than PATH_MAX is refused.
func TestDeepNamesAreCounted(t *testing.T) {
	deep := func(n int) string { return strings.Repeat("a/", n) + "f" }
	for _, tc := range []struct {
		name    string
		entry   string
		entries int64
		ok      bool
	}{
		{"within", deep(50), 100, true},
		{"its directories past the entries", deep(150), 100, false},
		{"deeper than allowed", deep(maxDepth + 1), 1 << 20, false},
		{"longer than PATH_MAX", strings.Repeat("b", maxPath) + "/f", 1 << 20, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			g := &gate{}
			adm, _ := g.admit(context.Background(), "team")
			defer adm.done()
			b := Budget{Bytes: 1 << 20, Entries: tc.entries, build: adm}
			_, err := ApplyLayer(bytes.NewReader(tarOf(t, file(tc.entry, "x"))), root, &b)
			if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrTooLarge)) {
				t.Fatalf("ApplyLayer: %v", err)
			}
			if tc.ok {
				if want := tc.entries - 51; b.Entries != want {
					t.Errorf("entries left %d; want %d (the file and its 50 directories)", b.Entries, want)
				}
				if _, held := g.inFlight(); held < 51*entryBytes {
					t.Errorf("charged %d; want the directories too", held)
				}
			}
		})
	}
}

// TestReservationsOutliveAReading: bytes reserved for a disk mkfs writes later stay off the
// free space when a later charge reads it again, until the build ends.
func TestReservationsOutliveAReading(t *testing.T) {
	free := int64(1000)
	g := &gate{limits: BuildLimits{MinFree: 500}, statfs: func(string) (int64, error) { return free, nil }}
	a, _ := g.admit(context.Background(), "a")
	b, _ := g.admit(context.Background(), "b")
	if err := a.reserve(400); err != nil {
		t.Fatal(err)
	}
	g.unseen = statEvery // the next charge reads the free space again, unchanged: mkfs has not written
	if err := b.charge(200); !errors.Is(err, ErrNodeBudget) {
		t.Errorf("a charge into space reserved for a disk: %v", err)
	}
	a.done()
	if err := b.charge(200); err != nil {
		t.Errorf("after the reserving build ended: %v", err)
	}
	b.done()
}
