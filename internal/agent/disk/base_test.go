package disk

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/syscode-labs/imp/internal/testregistry"
)

func layer(t *testing.T, entries ...entry) v1.Layer {
	return testregistry.Layer(t, tarOf(t, entries...))
}

// debugfsCat reads a file from an ext4 image without mounting it.
func debugfsCat(t *testing.T, disk, p string) (string, error) {
	t.Helper()
	out, err := exec.Command("debugfs", "-R", "cat "+p, disk).CombinedOutput()
	s := string(out)
	if i := strings.Index(s, "\n"); strings.HasPrefix(s, "debugfs ") && i >= 0 {
		s = s[i+1:] // the version banner
	}
	if err != nil || strings.Contains(s, "File not found") {
		return "", fmt.Errorf("debugfs cat %s: %v: %s", p, err, s)
	}
	return s, nil
}

func requireTools(t *testing.T) {
	for _, tool := range []string{"mkfs.ext4", "debugfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found (Debian package e2fsprogs; hack/install-prerequisites.sh installs it)", tool)
		}
	}
}

func TestBaseDiskFromRegistry(t *testing.T) {
	requireTools(t)
	host := testregistry.Start(t, "", "")
	d := testregistry.Push(t, host, "app", authn.DefaultKeychain,
		layer(t, dir("etc", 0o755), file("etc/msg", "hello from layer one\n"), file("etc/old", "deleted by layer two"), modeFile("bin/su", 0o4755)),
		layer(t, file("etc/.wh.old", ""), file("etc/msg2", "layer two\n")),
	)
	store := &BaseStore{Dir: t.TempDir(), MaxBytes: 1 << 30, RemoteOptions: []remote.Option{}}
	ctx := context.Background()

	// Four VMs of the image at once: one build, one disk.
	var wg sync.WaitGroup
	paths := make([]string, 4)
	errs := make([]error, 4)
	for i := range paths {
		wg.Add(1)
		go func() { defer wg.Done(); paths[i], _, errs[i] = store.Ensure(ctx, "team", d, anonymous) }()
	}
	wg.Wait()
	for i := range paths {
		if errs[i] != nil || paths[i] != store.Path(d) {
			t.Fatalf("Ensure %d = %q, %v", i, paths[i], errs[i])
		}
	}
	disk := paths[0]
	if got, err := debugfsCat(t, disk, "/etc/msg"); err != nil || got != "hello from layer one\n" {
		t.Errorf("/etc/msg = %q, %v", got, err)
	}
	if got, err := debugfsCat(t, disk, "/etc/msg2"); err != nil || got != "layer two\n" {
		t.Errorf("/etc/msg2 = %q, %v", got, err)
	}
	if _, err := debugfsCat(t, disk, "/etc/old"); err == nil {
		t.Error("a file whited out by the second layer is on the disk")
	}
	stat, _ := exec.Command("debugfs", "-R", "stat /bin/su", disk).CombinedOutput()
	if !strings.Contains(string(stat), "Mode:  04755") {
		t.Errorf("setuid bit not kept on the disk:\n%s", stat)
	}
	fi, err := os.Stat(disk)
	if err != nil || fi.Mode().Perm() != 0o444 {
		t.Errorf("disk mode %v, %v; want read-only", fi.Mode(), err)
	}
	left, _ := filepath.Glob(filepath.Join(store.Dir, ".build-*"))
	if len(left) != 0 {
		t.Errorf("build directories left: %v", left)
	}

	// Present: not rebuilt.
	before := fi.ModTime()
	_, release, err := store.Ensure(ctx, "team", d, anonymous)
	if err != nil {
		t.Fatal(err)
	}
	release()
	if fi, _ := os.Stat(disk); !fi.ModTime().Equal(before) {
		t.Error("an existing base disk was rebuilt")
	}

	// GC keeps what is leased or used, and removes the rest. The four concurrent Ensures above
	// leaked their leases on purpose: a fresh store stands for an agent restarted since.
	store = &BaseStore{Dir: store.Dir}
	_, release, _ = store.Ensure(ctx, "team", d, anonymous)
	if removed, err := store.GC(nothing); err != nil || len(removed) != 0 {
		t.Errorf("GC removed %v, %v while the disk was leased", removed, err)
	}
	release()
	if removed, err := store.GC(func() map[string]bool { return map[string]bool{d.DigestStr(): true} }); err != nil || len(removed) != 0 {
		t.Errorf("GC removed %v, %v; the disk is in use", removed, err)
	}
	if removed, err := store.GC(nothing); err != nil || len(removed) != 1 {
		t.Errorf("GC removed %v, %v; want the unused disk", removed, err)
	}
}

// TestBaseDiskRefusesUnsafeImages pushes the three layers issue 4 names to a real registry
// and checks each image is refused, nothing outside the build changes and nothing is left.
func TestBaseDiskRefusesUnsafeImages(t *testing.T) {
	requireTools(t)
	host := testregistry.Start(t, "", "")
	outside := t.TempDir()
	secret := filepath.Join(outside, "secret")
	if err := os.WriteFile(secret, []byte("host data"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name   string
		layers [][]entry
	}{
		{"dot-dot path", [][]entry{{file("ok", "fine")}, {file("../../../../../../"+strings.TrimPrefix(outside, "/")+"/pwned", "x")}}},
		{"write through an absolute symlink", [][]entry{{file("ok", "fine"), symlink("evil", outside)}, {file("evil/pwned", "through the lower layer's symlink")}}},
		{"hard link to a host path", [][]entry{{hardlink("passwd", secret)}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var ls []v1.Layer
			for _, l := range tt.layers {
				ls = append(ls, layer(t, l...))
			}
			d := testregistry.Push(t, host, "evil", authn.DefaultKeychain, ls...)
			store := &BaseStore{Dir: t.TempDir(), MaxBytes: 1 << 30}
			_, _, err := store.Ensure(context.Background(), "team", d, anonymous)
			if !errors.Is(err, ErrUnsafeLayer) {
				t.Fatalf("error = %v, want ErrUnsafeLayer", err)
			}
			t.Logf("refused: %v", err)
			entries, _ := os.ReadDir(outside)
			if data, _ := os.ReadFile(secret); len(entries) != 1 || string(data) != "host data" {
				t.Errorf("outside the root changed: %v", entries)
			}
			if fi, _ := os.Stat(secret); fi.Sys().(*syscall.Stat_t).Nlink != 1 {
				t.Error("the host file got a hard link")
			}
			if entries, _ := os.ReadDir(store.Dir); len(entries) != 0 {
				t.Errorf("a refused image left %v", entries)
			}
		})
	}
}

func TestPullSecrets(t *testing.T) {
	requireTools(t)
	host := testregistry.Start(t, "puller", "s3cret")
	secret := func(user, pass string) []byte {
		auth := base64.StdEncoding.EncodeToString([]byte(user + ":" + pass))
		return []byte(fmt.Sprintf(`{"auths":{"http://%s/v2/":{"auth":%q}}}`, host, auth))
	}
	good, err := NewPullSecretKeychain(secret("puller", "s3cret"))
	if err != nil {
		t.Fatal(err)
	}
	d := testregistry.Push(t, host, "private", good, layer(t, file("f", "private\n")))
	ctx := context.Background()

	tag, err := name.ParseReference(host + "/private:v1")
	if err != nil {
		t.Fatal(err)
	}
	// One store: the registry session the anonymous attempt made is not the one of the
	// credentials, and a refused attempt leaves nothing the next one could use.
	store := &BaseStore{Dir: t.TempDir(), MaxBytes: 1 << 30}
	if _, err := store.Resolve(ctx, tag, anonymous); err == nil {
		t.Error("resolved a private image anonymously")
	}
	resolved, err := store.Resolve(ctx, tag, good)
	if err != nil || resolved.DigestStr() != d.DigestStr() {
		t.Fatalf("Resolve = %v, %v; want %s", resolved, err, d.DigestStr())
	}
	if _, err := store.Resolve(ctx, tag, anonymous); err == nil {
		t.Error("resolved a private image anonymously after the credentials did")
	}
	bad, _ := NewPullSecretKeychain(secret("puller", "wrong"))
	if _, _, err := store.Ensure(ctx, "team", d, bad); err == nil {
		t.Error("pulled with a wrong password")
	}
	if _, _, err := store.Ensure(ctx, "team", d, good); err != nil {
		t.Errorf("pulling with the pull secret: %v", err)
	}
}

func TestRegistryHost(t *testing.T) {
	for in, want := range map[string]string{
		"https://index.docker.io/v1/": name.DefaultRegistry,
		"ghcr.io":                     "ghcr.io",
		"http://127.0.0.1:5000/v2/":   "127.0.0.1:5000",
		"registry.example.com:443":    "registry.example.com:443",
	} {
		if got := registryHost(in); got != want {
			t.Errorf("registryHost(%q) = %q, want %q", in, got, want)
		}
	}
}

// anonymous is a keychain with no credentials.
var anonymous = PullSecretKeychain{}

// nothing is a GC callback for a node where no VM records a base disk.
func nothing() map[string]bool { return nil }

// TestGCSparesBuildsInProgress: collecting base disks while one is being built removes a
// build a crash left behind, never the one in progress, nor the disk it produces while its
// lease is held.
func TestGCSparesBuildsInProgress(t *testing.T) {
	requireTools(t)
	host := testregistry.Start(t, "", "")
	d := testregistry.Push(t, host, "slow", nil, layer(t, file("f", "data\n")))
	dir := t.TempDir()
	// mkfs waits until GC has run at least once while the build is in progress.
	building, gcRan := filepath.Join(dir, "building"), filepath.Join(dir, "gc-ran")
	slowMkfs := filepath.Join(dir, "mkfs")
	script := "#!/bin/sh\ntouch " + building + "\nwhile [ ! -e " + gcRan + " ]; do sleep 0.01; done\nexec mkfs.ext4 \"$@\"\n"
	if err := os.WriteFile(slowMkfs, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	store := &BaseStore{Dir: filepath.Join(dir, "images"), MaxBytes: 1 << 30, Mkfs: slowMkfs}
	if err := os.MkdirAll(filepath.Join(store.Dir, ".build-crashed"), 0o700); err != nil {
		t.Fatal(err)
	}
	done, stopped := make(chan struct{}), make(chan struct{})
	var removed []string
	go func() {
		defer close(stopped)
		for {
			select {
			case <-done:
				return
			default:
			}
			r, _ := store.GC(nothing)
			removed = append(removed, r...)
			if _, err := os.Stat(building); err == nil {
				_ = os.WriteFile(gcRan, nil, 0o600)
			}
			time.Sleep(time.Millisecond)
		}
	}()
	path, release, err := store.Ensure(context.Background(), "team", d, anonymous)
	// GC keeps running after the build: the lease still protects the disk.
	time.Sleep(20 * time.Millisecond)
	_, statErr := os.Stat(path)
	close(done)
	<-stopped
	release()
	if err != nil {
		t.Fatalf("a base disk build failed while GC ran: %v", err)
	}
	if statErr != nil {
		t.Errorf("the leased base disk was removed: %v", statErr)
	}
	if len(removed) != 1 || removed[0] != ".build-crashed" {
		t.Errorf("GC removed %v, want only the crashed build", removed)
	}
}

// TestGCDuringManyStarts: GC runs without pause while 25 "VM starts" each ensure a disk,
// record its digest and release the lease, as the agent does, then go; no start ever finds its
// disk gone between Ensure and its record, and each start waits for GC to collect the unused
// disk first, so that each builds it afresh under a running GC.
func TestGCDuringManyStarts(t *testing.T) {
	requireTools(t)
	host := testregistry.Start(t, "", "")
	d := testregistry.Push(t, host, "busy", nil, layer(t, file("f", "data\n")))
	store := &BaseStore{Dir: t.TempDir(), MaxBytes: 1 << 30}
	var recorded atomic.Bool // a VM records the digest
	inUse := func() map[string]bool { return map[string]bool{d.DigestStr(): recorded.Load()} }
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case <-done:
				return
			default:
			}
			_, _ = store.GC(inUse)
		}
	}()
	defer func() { close(done); <-stopped }()
	for i := range 25 {
		path, release, err := store.Ensure(context.Background(), "team", d, anonymous)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(path); err != nil {
			t.Fatalf("start %d: the disk Ensure returned is gone before the VM recorded it: %v", i, err)
		}
		recorded.Store(true)
		release()
		if _, err := os.Stat(path); err != nil {
			t.Fatalf("start %d: the recorded disk was collected: %v", i, err)
		}
		recorded.Store(false) // the VM goes
		deadline := time.Now().Add(30 * time.Second)
		for _, err := os.Stat(path); err == nil; _, err = os.Stat(path) {
			if time.Now().After(deadline) {
				t.Fatalf("start %d: GC did not collect the unused disk", i)
			}
			time.Sleep(time.Millisecond)
		}
	}
}

// TestAuthorizeAnotherTenantsDisk: a private image's base disk on the node, pulled with one
// tenant's credentials, is refused to credentials the registry refuses, and to none; the
// credentials that pulled it, and others the registry accepts, are asked about once, after
// which neither the access check nor the image config costs a request. A tenant that never
// had access cannot use the cache of one that did.
func TestAuthorizeAnotherTenantsDisk(t *testing.T) {
	requireTools(t)
	host, requests := countedRegistry(t, "puller", "s3cret")
	secret := func(user, pass string) PullSecretKeychain {
		auth := base64.StdEncoding.EncodeToString([]byte(user + ":" + pass))
		kc, err := NewPullSecretKeychain([]byte(fmt.Sprintf(`{"auths":{"http://%s/v2/":{"auth":%q}}}`, host, auth)))
		if err != nil {
			t.Fatal(err)
		}
		return kc
	}
	good := secret("puller", "s3cret")
	d := testregistry.Push(t, host, "private", good, layer(t, file("f", "private\n")))
	ctx := context.Background()
	store := &BaseStore{Dir: t.TempDir(), MaxBytes: 1 << 30}
	if _, _, err := store.Ensure(ctx, "team", d, good); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		kc       PullSecretKeychain
		allowed  bool
		requests int64 // asking twice
	}{
		{"the credentials that pulled it", good, true, 0},
		{"no credentials", anonymous, false, 4},
		{"wrong credentials", secret("puller", "wrong"), false, 4},
		{"other accepted credentials", secret("puller", "s3cret"), true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := requests.Load()
			for i := 0; i < 2; i++ {
				err := store.Authorize(ctx, d, tc.kc)
				if (err == nil) != tc.allowed {
					t.Fatalf("Authorize: %v, allowed %v", err, tc.allowed)
				}
				if tc.allowed {
					if cfg, err := store.Config(ctx, d, tc.kc); err != nil || cfg == nil {
						t.Fatalf("Config: %v", err)
					}
				}
			}
			if got := requests.Load() - n; got > tc.requests {
				t.Errorf("%d registry requests, want at most %d", got, tc.requests)
			}
		})
	}
}

// TestResolveTagCostsOneRequest: resolving a tag again with the same credentials costs one
// registry request (the manifest HEAD); the registry's authentication happened once.
func TestResolveTagCostsOneRequest(t *testing.T) {
	host, requests := countedRegistry(t, "puller", "s3cret")
	auth := base64.StdEncoding.EncodeToString([]byte("puller:s3cret"))
	kc, err := NewPullSecretKeychain([]byte(fmt.Sprintf(`{"auths":{"http://%s/v2/":{"auth":%q}}}`, host, auth)))
	if err != nil {
		t.Fatal(err)
	}
	want := testregistry.Push(t, host, "app", kc, layer(t, file("f", "app\n")))
	tag, err := name.ParseReference(host+"/app:v1", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	store := &BaseStore{Dir: t.TempDir(), MaxBytes: 1 << 30}
	ctx := context.Background()
	for i := range 3 {
		n := requests.Load()
		d, err := store.Resolve(ctx, tag, kc)
		if err != nil || d.DigestStr() != want.DigestStr() {
			t.Fatalf("resolve %d: %v, %v; want %s", i, d, err, want.DigestStr())
		}
		if got := requests.Load() - n; i > 0 && got != 1 {
			t.Errorf("resolve %d cost %d registry requests, want 1", i, got)
		}
	}
}

// TestResolveTTL: within the TTL a tag resolved with the same credentials costs no request,
// even if it moved meanwhile; after it, the move is seen. Other credentials get nothing from it.
func TestResolveTTL(t *testing.T) {
	host, requests := countedRegistry(t, "puller", "s3cret")
	auth := base64.StdEncoding.EncodeToString([]byte("puller:s3cret"))
	kc, err := NewPullSecretKeychain([]byte(fmt.Sprintf(`{"auths":{"http://%s/v2/":{"auth":%q}}}`, host, auth)))
	if err != nil {
		t.Fatal(err)
	}
	first := testregistry.Push(t, host, "app", kc, layer(t, file("f", "one\n")))
	tag, err := name.ParseReference(host+"/app:v1", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	clk := clocktesting.NewFakePassiveClock(time.Now())
	store := &BaseStore{Dir: t.TempDir(), MaxBytes: 1 << 30, ResolveTTL: time.Minute, Clock: clk}
	ctx := context.Background()
	resolve := func(want name.Digest, cost int64, at string) {
		t.Helper()
		n := requests.Load()
		d, err := store.Resolve(ctx, tag, kc)
		if err != nil || d.DigestStr() != want.DigestStr() {
			t.Fatalf("%s: %v, %v; want %s", at, d, err, want.DigestStr())
		}
		if got := requests.Load() - n; got != cost {
			t.Errorf("%s: %d registry requests, want %d", at, got, cost)
		}
	}
	resolve(first, 2, "the first resolution (the registry's authentication, then the HEAD)")
	resolve(first, 0, "again within the TTL")
	second := testregistry.Push(t, host, "app", kc, layer(t, file("f", "two\n")))
	clk.SetTime(clk.Now().Add(59 * time.Second))
	resolve(first, 0, "the tag moved, still within the TTL")
	if _, err := store.Resolve(ctx, tag, authn.NewMultiKeychain()); err == nil {
		t.Error("other credentials (none) got the resolution of these")
	}
	clk.SetTime(clk.Now().Add(2 * time.Second))
	resolve(second, 1, "past the TTL")
}

// countedRegistry starts a registry with user and password behind a proxy that counts the
// requests it gets; it returns the proxy's host.
func countedRegistry(t *testing.T, user, password string) (string, *atomic.Int64) {
	backend := testregistry.Start(t, user, password)
	requests := new(atomic.Int64)
	rp := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: "http", Host: backend})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { requests.Add(1); rp.ServeHTTP(w, r) }))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://"), requests
}
