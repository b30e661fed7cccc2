package disk

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"golang.org/x/sync/singleflight"
	"golang.org/x/sys/unix"
	"k8s.io/utils/clock"
)

// DefaultMaxEntries bounds an image's entries unless BaseStore.MaxEntries says otherwise: far
// above what real images hold (tens of thousands), far below a node's inodes.
const DefaultMaxEntries = 500_000

// BaseStore keeps one read-only ext4 base disk per image digest in Dir, named
// "sha256-<hex>.ext4". A disk appears only complete: it is built in a temporary directory of Dir
// and renamed into place.
//
// Ensure hands out a lease on the disk it returns; GC never removes a disk under a lease, nor
// one its caller says is in use. A VM start holds the lease from before the disk exists until
// it has recorded the digest it uses, so there is no moment at which GC could take the disk.
type BaseStore struct {
	Dir string
	// MaxBytes bounds the file bytes of one image.
	MaxBytes int64
	// MaxEntries bounds the entries (files, directories, links) of one image
	// (DefaultMaxEntries when 0).
	MaxEntries int64
	// Mkfs is the mkfs.ext4 to run (default: from PATH).
	Mkfs string
	// RemoteOptions are added to every registry request (transport, platform, ...).
	RemoteOptions []remote.Option
	// ResolveTTL, when not 0, keeps what a tag resolved to, per credentials, this long: a VM
	// started within it costs no registry request, and sees a tag moved meanwhile only after.
	ResolveTTL time.Duration
	// Clock measures ResolveTTL (default: the real clock).
	Clock clock.PassiveClock
	// Limits bound the store's builds together: at once, bytes in flight, free space kept.
	Limits BuildLimits

	builds   singleflight.Group
	gateOnce sync.Once
	gate     *gate
	mu       sync.Mutex
	active   map[string]bool            // build directories in use, which GC leaves alone
	leases   map[string]int             // digest → leases held (Ensure until its release)
	access   map[string]map[string]bool // digest → repository and credentials proven (Authorize)
	provs    map[string][]string        // digest → its provenance file, as read or written
	pullers  map[string]*remote.Puller  // registry sessions, by registry and credentials
	tags     map[string]resolvedTag     // tag and credentials → digest, within ResolveTTL
}

// resolvedTag is what a tag resolved to, and when.
type resolvedTag struct {
	digest name.Digest
	at     time.Time
}

// maxTags bounds the resolutions kept (tags × credentials).
const maxTags = 1024

// Resolve returns the digest r names (r itself when it is one), asking the registry for a tag:
// one manifest HEAD, after the first request of these credentials to that registry (which
// also authenticates); none within ResolveTTL of a resolution with the same credentials. The digest keeps r's registry, and with it whether the registry is
// reached over plain HTTP.
func (s *BaseStore) Resolve(ctx context.Context, r name.Reference, kc authn.Keychain) (name.Digest, error) {
	if d, ok := r.(name.Digest); ok {
		return d, nil
	}
	var key string
	if s.ResolveTTL > 0 {
		cred, err := credentialKey(r.Context(), kc)
		if err != nil {
			return name.Digest{}, fmt.Errorf("resolving %s: %w", r, err)
		}
		key = r.Name() + "\x00" + cred
		s.mu.Lock()
		t, ok := s.tags[key]
		s.mu.Unlock()
		if ok && s.clock().Since(t.at) < s.ResolveTTL {
			return t.digest, nil
		}
	}
	p, err := s.puller(r.Context(), kc)
	if err != nil {
		return name.Digest{}, fmt.Errorf("resolving %s: %w", r, err)
	}
	desc, err := p.Head(ctx, r)
	if err != nil {
		return name.Digest{}, fmt.Errorf("resolving %s: %w", r, err)
	}
	d := r.Context().Digest(desc.Digest.String())
	if key != "" {
		s.mu.Lock()
		if s.tags == nil || len(s.tags) >= maxTags {
			s.tags = map[string]resolvedTag{}
		}
		s.tags[key] = resolvedTag{digest: d, at: s.clock().Now()}
		s.mu.Unlock()
	}
	return d, nil
}

func (s *BaseStore) clock() clock.PassiveClock {
	if s.Clock == nil {
		return clock.RealClock{}
	}
	return s.Clock
}

// Path is where the base disk of digest d lives (or will).
func (s *BaseStore) Path(d name.Digest) string {
	return filepath.Join(s.Dir, strings.Replace(d.DigestStr(), ":", "-", 1)+".ext4")
}

// Ensure returns the base disk of image d, pulling and building it for tenant (a namespace,
// whose builds Limits bound together) when it is not there yet, and a lease on it: GC leaves the
// disk alone until release is called (once; later calls do nothing). Concurrent calls for one
// digest share one build, counted against the tenant of the first.
func (s *BaseStore) Ensure(ctx context.Context, tenant string, d name.Digest, kc authn.Keychain) (path string, release func(), err error) {
	release = s.lease(d.DigestStr())
	target := s.Path(d)
	if _, err := os.Stat(target); err == nil {
		return target, release, nil
	}
	_, err, _ = s.builds.Do(target, func() (any, error) {
		if _, err := os.Stat(target); err == nil {
			return nil, nil
		}
		adm, err := s.buildGate().admit(ctx, tenant)
		if err != nil {
			return nil, fmt.Errorf("building the base disk of %s: %w", d, err)
		}
		defer adm.done()
		if err := s.build(ctx, d, kc, target, adm); err != nil {
			return nil, err
		}
		// Built from d's repository with these credentials: its first provenance, and their
		// access proven.
		if key, err := accessKey(d.Context(), kc); err == nil {
			s.verify(d.DigestStr(), key)
		}
		return nil, nil
	})
	if err != nil {
		release()
		return "", func() {}, err
	}
	return target, release, nil
}

// lease counts a lease on digest until the returned function is called.
func (s *BaseStore) lease(digest string) func() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.leases == nil {
		s.leases = map[string]int{}
	}
	s.leases[digest]++
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.leases[digest]--; s.leases[digest] <= 0 {
				delete(s.leases, digest)
			}
		})
	}
}

func (s *BaseStore) buildGate() *gate {
	s.gateOnce.Do(func() { s.gate = &gate{limits: s.Limits, dir: s.Dir} })
	return s.gate
}

// Usage is what the store holds on the node: its base disks (count and allocated bytes), and
// the builds running with the bytes they hold.
type Usage struct {
	Disks      int
	DiskBytes  int64
	Builds     int
	BuildBytes int64
}

// Usage returns what the store holds on the node now.
func (s *BaseStore) Usage() (Usage, error) {
	var u Usage
	u.Builds, u.BuildBytes = s.buildGate().inFlight()
	paths, err := filepath.Glob(filepath.Join(s.Dir, "sha256-*.ext4"))
	if err != nil {
		return u, err
	}
	for _, p := range paths {
		if n, err := Allocated(p); err == nil {
			u.Disks++
			u.DiskBytes += n
		}
	}
	return u, nil
}

// Allocated returns the bytes the file at p takes on its file system (a sparse file's written
// blocks).
func Allocated(p string) (int64, error) {
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		return 0, fmt.Errorf("reading the size of %s: %w", p, err)
	}
	return st.Blocks * 512, nil
}

func (s *BaseStore) build(ctx context.Context, d name.Digest, kc authn.Keychain, target string, adm *admission) error {
	img, err := remote.Image(d, append(s.RemoteOptions, remote.WithContext(ctx), remote.WithAuthFromKeychain(kc))...)
	if err != nil {
		return fmt.Errorf("pulling %s: %w", d, err)
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return fmt.Errorf("creating %s: %w", s.Dir, err)
	}
	// Registered under the lock GC takes, so GC never sees it unregistered.
	s.mu.Lock()
	work, err := os.MkdirTemp(s.Dir, ".build-")
	if err == nil {
		if s.active == nil {
			s.active = map[string]bool{}
		}
		s.active[filepath.Base(work)] = true
	}
	s.mu.Unlock()
	if err != nil {
		return fmt.Errorf("creating a build directory: %w", err)
	}
	defer func() {
		_ = os.RemoveAll(work)
		s.mu.Lock()
		delete(s.active, filepath.Base(work))
		s.mu.Unlock()
	}()
	root := filepath.Join(work, "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		return err
	}

	layers, err := img.Layers()
	if err != nil {
		return fmt.Errorf("listing the layers of %s: %w", d, err)
	}
	var rep ExtractReport // summed over layers: sizes the disk, overestimating what replaced files
	budget := Budget{Bytes: s.MaxBytes, Entries: s.MaxEntries, build: adm}
	if budget.Entries == 0 {
		budget.Entries = DefaultMaxEntries
	}
	for i, l := range layers {
		r, err := l.Uncompressed() // verifies the layer's digest as it is read
		if err != nil {
			return fmt.Errorf("reading layer %d of %s: %w", i, d, err)
		}
		lr, err := ApplyLayer(r, root, &budget)
		if cerr := r.Close(); err == nil && cerr != nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("applying layer %d of %s: %w", i, d, err)
		}
		rep.Files += lr.Files
		rep.Dirs += lr.Dirs
		rep.Symlinks += lr.Symlinks
		rep.Hardlinks += lr.Hardlinks
		rep.Bytes += lr.Bytes
	}

	entries := rep.Files + rep.Dirs + rep.Symlinks + rep.Hardlinks
	size := sizeFor(rep.Bytes, entries)
	tmp := filepath.Join(work, "disk.ext4")
	// The disk is made beside the files it copies: both are held until the build ends.
	if err := adm.reserve(size); err != nil {
		return fmt.Errorf("building the ext4 disk of %s (%s): %w", d, bytesString(size), err)
	}
	mkfs := s.Mkfs
	if mkfs == "" {
		mkfs = "mkfs.ext4"
	}
	// No journal: the disk is read-only once built. Inodes for every entry and some slack.
	cmd := exec.CommandContext(ctx, mkfs, "-q", "-F", "-t", "ext4", "-O", "^has_journal", "-L", "imp-base",
		"-N", fmt.Sprint(entries+1024), "-d", root, tmp, fmt.Sprintf("%dM", size>>20))
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building the ext4 disk of %s: %w: %s", d, err, out)
	}
	if err := syncFile(tmp); err != nil {
		return err
	}
	if err := os.Chmod(tmp, 0o444); err != nil {
		return err
	}
	// Its config and provenance beside it, kept only for an image the node accepted.
	if _, err := s.keepConfig(d, img); err != nil {
		return err
	}
	if err := s.addProvenance(d); err != nil {
		return err
	}
	if err := os.Rename(tmp, target); err != nil {
		return fmt.Errorf("installing the base disk of %s: %w", d, err)
	}
	return syncFile(s.Dir)
}

// sizeFor is the ext4 size for files of bytes in entries entries: the data, a block per entry,
// 20% for metadata, at least 32 MiB, in whole MiB.
func sizeFor(bytes int64, entries int) int64 {
	n := (bytes + int64(entries)*4096) * 6 / 5
	n = max(n+16<<20, 32<<20)
	return (n + 1<<20 - 1) &^ (1<<20 - 1)
}

func syncFile(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", p, err)
	}
	return nil
}

// GC removes the base disks of digests neither leased nor in inUse's answer, and builds left
// over by a crash — never a build in progress. inUse is asked under the lock that Ensure's
// leases take, so a disk whose lease was released after its user recorded it is seen as used.
func (s *BaseStore) GC(inUse func() map[string]bool) (removed []string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	entries, err := os.ReadDir(s.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	keep := inUse()
	for _, e := range entries {
		n := e.Name()
		digest := strings.Replace(strings.TrimSuffix(n, ".ext4"), "-", ":", 1)
		switch {
		case strings.HasPrefix(n, ".build-") && !s.active[n]:
		case strings.HasSuffix(n, ".ext4") && !keep[digest] && s.leases[digest] == 0:
			// The image's config, provenance and the credentials known to reach it go with
			// its disk.
			for _, ext := range sidecars {
				_ = os.Remove(filepath.Join(s.Dir, strings.TrimSuffix(n, ".ext4")+ext))
			}
			delete(s.access, digest)
			delete(s.provs, digest)
		case sidecar(n) != "" && s.leases[strings.Replace(sidecar(n), "-", ":", 1)] == 0:
			// A config or provenance whose disk is gone (a crash between the two), unless it
			// went with its disk above.
			if _, err := os.Stat(filepath.Join(s.Dir, sidecar(n)+".ext4")); err == nil {
				continue
			}
			if _, err := os.Lstat(filepath.Join(s.Dir, n)); errors.Is(err, fs.ErrNotExist) {
				continue
			}
		default:
			continue
		}
		if err := os.RemoveAll(filepath.Join(s.Dir, n)); err != nil {
			return removed, err
		}
		removed = append(removed, n)
	}
	return removed, nil
}

// sidecars are the files kept beside a base disk "sha256-<hex>.ext4": its image's config and
// provenance.
var sidecars = []string{".config.json", ".repos"}

// sidecar is the base name ("sha256-<hex>") of a file beside a base disk, "" for another.
func sidecar(file string) string {
	for _, ext := range sidecars {
		if b, ok := strings.CutSuffix(file, ext); ok && strings.HasPrefix(b, "sha256-") {
			return b
		}
	}
	return ""
}

// PullSecretKeychain is an authn.Keychain from the .dockerconfigjson of image pull secrets.
type PullSecretKeychain map[string]authn.AuthConfig

// NewPullSecretKeychain parses the .dockerconfigjson data of pull secrets; later secrets do not
// override a registry an earlier one gave.
func NewPullSecretKeychain(dockerConfigJSON ...[]byte) (PullSecretKeychain, error) {
	kc := PullSecretKeychain{}
	for _, data := range dockerConfigJSON {
		var cfg struct {
			Auths map[string]authn.AuthConfig `json:"auths"`
		}
		if err := json.Unmarshal(data, &cfg); err != nil {
			return nil, fmt.Errorf("parsing a .dockerconfigjson: %w", err)
		}
		for host, a := range cfg.Auths {
			if a.Auth != "" && a.Username == "" {
				raw, err := base64.StdEncoding.DecodeString(a.Auth)
				if err != nil {
					return nil, fmt.Errorf("decoding the auth of %s: %w", host, err)
				}
				a.Username, a.Password, _ = strings.Cut(string(raw), ":")
				a.Auth = ""
			}
			host = registryHost(host)
			if _, ok := kc[host]; !ok {
				kc[host] = a
			}
		}
	}
	return kc, nil
}

// registryHost reduces a docker config key ("https://index.docker.io/v1/", "host:5000") to the
// registry host name.
func registryHost(key string) string {
	key = strings.TrimPrefix(strings.TrimPrefix(key, "https://"), "http://")
	key, _, _ = strings.Cut(key, "/")
	if key == "index.docker.io" {
		return name.DefaultRegistry
	}
	return key
}

// Resolve implements authn.Keychain.
func (kc PullSecretKeychain) Resolve(r authn.Resource) (authn.Authenticator, error) {
	if a, ok := kc[r.RegistryStr()]; ok {
		return authn.FromConfig(a), nil
	}
	return authn.Anonymous, nil
}
