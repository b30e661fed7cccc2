// Package transfer moves what a migration moves between the agents of its two nodes: an HTTPS
// endpoint on the source node that serves a migration's files, over mutually authenticated TLS
// 1.3, to the agent of the node the migration names as its target and to no one else; each file
// checksummed end to end (SHA-256 in a trailer, checked before the file is kept), served within
// a limit of concurrent transfers and a bandwidth bound per node, with its progress reported.
// See docs/migration.md.
package transfer

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/pki"
)

// SumTrailer is the trailer that carries a file's SHA-256, hex, computed as it was sent.
const SumTrailer = "Imp-Sha256"

// chunk is how much is read, limited and hashed at a time.
const chunk = 256 << 10

// ErrNotAllowed is Authorize's answer for a node that may not fetch a migration's files.
var ErrNotAllowed = errors.New("not the target of this migration")

// File is a file a migration moves: its name in Dir, a place a VMM may write to (a jail, a VM's
// directory), which is opened without following any link out of Dir or at Name, and only as a
// regular file of one link (vmm.OpenIn).
type File struct{ Dir, Name string }

// Server serves the files of this node's migrations to their targets.
type Server struct {
	// Authorize returns the files (by the name the client asks for) of migration that node's
	// agent may fetch, or ErrNotAllowed (or another error) if it may fetch none: the agent
	// allows only the target node of a migration whose source is this node, while it copies.
	Authorize func(ctx context.Context, node string, migration types.UID) (map[string]File, error)
	// Concurrent is how many files are served at once (default 2), one at a time per node;
	// at most Waiting more requests wait for their turn (default 8), others are refused (503).
	Concurrent, Waiting int
	// Stall is how long a client may leave a chunk unread before its transfer is ended
	// (default 30s): a target that stops reading does not hold a turn.
	Stall time.Duration
	// BytesPerSecond bounds what all transfers send together (0: unbounded).
	BytesPerSecond int64
	// Progress, when set, is told each chunk sent of a migration's files.
	Progress func(migration types.UID, sent int64)
	Log      logr.Logger

	slots   chan struct{}
	limiter *rate.Limiter
	mu      sync.Mutex
	waiting int
	serving map[string]bool // nodes served now
}

// Handler serves GET /migrations/{uid}/files/{name}: the file name of migration uid, to the
// node the client's certificate names (ServerTLS).
func (s *Server) Handler() http.Handler {
	n := s.Concurrent
	if n <= 0 {
		n = 2
	}
	s.slots = make(chan struct{}, n)
	if s.Waiting <= 0 {
		s.Waiting = 8
	}
	if s.Stall <= 0 {
		s.Stall = 30 * time.Second
	}
	s.serving = map[string]bool{}
	if s.BytesPerSecond > 0 {
		s.limiter = rate.NewLimiter(rate.Limit(s.BytesPerSecond), chunk)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /migrations/{uid}/files/{name}", s.serve)
	return mux
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request) {
	node, err := PeerNode(r.TLS)
	if err != nil {
		http.Error(w, err.Error(), http.StatusForbidden)
		return
	}
	uid, name := types.UID(r.PathValue("uid")), r.PathValue("name")
	if !validUID.MatchString(string(uid)) {
		http.Error(w, "not a migration's UID", http.StatusBadRequest)
		return
	}
	files, err := s.Authorize(r.Context(), node, uid)
	if err != nil {
		s.Log.Info("refused a transfer", "node", node, "migration", uid, "file", name, "reason", err.Error())
		code := http.StatusInternalServerError
		if errors.Is(err, ErrNotAllowed) {
			code = http.StatusForbidden
		}
		http.Error(w, "refused", code)
		return
	}
	file, ok := files[name]
	if !ok {
		http.Error(w, "no such file in this migration", http.StatusNotFound)
		return
	}
	f, err := vmm.OpenIn(file.Dir, file.Name, os.O_RDONLY)
	if err != nil {
		http.Error(w, "cannot open the file", http.StatusInternalServerError)
		s.Log.Error(err, "opening a migration's file", "migration", uid, "file", name)
		return
	}
	defer f.Close()
	release, ok := s.turn(r.Context(), node)
	if !ok {
		http.Error(w, "too many transfers waiting", http.StatusServiceUnavailable)
		return
	}
	defer release()
	rc := http.NewResponseController(w)
	w.Header().Set("Trailer", SumTrailer)
	w.Header().Set("Content-Type", "application/octet-stream")
	h := sha256.New()
	buf := make([]byte, chunk)
	var sent int64
	for {
		n, rerr := f.Read(buf)
		if n > 0 {
			if s.limiter != nil {
				if err := s.limiter.WaitN(r.Context(), n); err != nil {
					return
				}
			}
			h.Write(buf[:n])
			_ = rc.SetWriteDeadline(time.Now().Add(s.Stall))
			if _, err := w.Write(buf[:n]); err != nil {
				return
			}
			sent += int64(n)
			if s.Progress != nil {
				s.Progress(uid, sent)
			}
		}
		if rerr == io.EOF {
			break
		} else if rerr != nil {
			s.Log.Error(rerr, "reading a migration's file", "migration", uid, "file", name)
			return // no trailer: the client refuses what it got
		}
	}
	w.Header().Set(SumTrailer, hex.EncodeToString(h.Sum(nil)))
}

// validUID is what a migration's UID looks like (a Kubernetes UID: a UUID).
var validUID = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// turn waits for a turn to serve node: a free slot, and none of node's transfers under way
// (one at a time per node, so that one target cannot hold every slot). It refuses when Waiting
// requests wait already, and gives up when ctx ends; release ends the turn.
func (s *Server) turn(ctx context.Context, node string) (release func(), ok bool) {
	s.mu.Lock()
	if s.waiting >= s.Waiting {
		s.mu.Unlock()
		return nil, false
	}
	s.waiting++
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.waiting--
		s.mu.Unlock()
	}()
	for {
		select {
		case s.slots <- struct{}{}:
		case <-ctx.Done():
			return nil, false
		}
		s.mu.Lock()
		if !s.serving[node] {
			s.serving[node] = true
			s.mu.Unlock()
			return func() {
				s.mu.Lock()
				delete(s.serving, node)
				s.mu.Unlock()
				<-s.slots
			}, true
		}
		s.mu.Unlock()
		<-s.slots // node has one under way: let another node's in, and try again
		select {
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
			return nil, false
		}
	}
}

// PeerNode is the node whose agent the verified client certificate of a connection is: its one
// DNS name pki.AgentDNSName(node).
func PeerNode(cs *tls.ConnectionState) (string, error) {
	if cs == nil || len(cs.VerifiedChains) == 0 {
		return "", errors.New("no verified client certificate")
	}
	leaf := cs.VerifiedChains[0][0]
	if leaf.Subject.CommonName != pki.AgentName || len(leaf.DNSNames) != 1 {
		return "", errors.New("not a node agent's certificate")
	}
	node, ok := strings.CutPrefix(leaf.DNSNames[0], pki.AgentName+".")
	if !ok || node == "" {
		return "", errors.New("not a node agent's certificate")
	}
	return node, nil
}

// Identity is an agent's certificate for its node and the CA its peers' certificates chain to,
// as they are now (a certificate rotates).
type Identity func() (*tls.Certificate, *x509.CertPool, error)

// ServerTLS serves with id's certificate to clients whose certificates chain to id's CA (node
// agents: PeerNode says which), TLS 1.3 only.
func ServerTLS(id Identity) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			cert, pool, err := id()
			if err != nil {
				return nil, err
			}
			return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{*cert}, ClientCAs: pool,
				ClientAuth: tls.RequireAndVerifyClientCert,
				VerifyConnection: func(cs tls.ConnectionState) error {
					_, err := PeerNode(&cs)
					return err
				}}, nil
		},
	}
}

// ClientTLS presents id's certificate to the agent of node source, whose certificate must be
// its own (pki.AgentDNSName(source)) and chain to id's CA.
func ClientTLS(id Identity, source string) (*tls.Config, error) {
	_, pool, err := id()
	if err != nil {
		return nil, err
	}
	return &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: pool, ServerName: pki.AgentDNSName(source),
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			cert, _, err := id()
			return cert, err
		}}, nil
}

// Fetch gets the file name of migration from base (the source agent's endpoint, https://host:port)
// into the file name in dir, at most max bytes of it: written to a file of its own beside it
// (never through a link out of dir), its SHA-256 checked against the source's, synced, then
// renamed. A file whose sum does not match, that ends early or is larger than max, is refused
// and nothing of it is left. It returns the bytes received.
func Fetch(ctx context.Context, c *http.Client, base string, migration types.UID, name string, dir, into string, max int64) (int64, error) {
	fail := func(err error) error { return fmt.Errorf("fetching %s of migration %s: %w", name, migration, err) }
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/migrations/"+url.PathEscape(string(migration))+"/files/"+url.PathEscape(name), nil)
	if err != nil {
		return 0, fail(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, fail(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return 0, fail(fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(b))))
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return 0, fail(err)
	}
	defer root.Close()
	var f *os.File
	var tmp string
	for i := 0; f == nil; i++ {
		tmp = fmt.Sprintf(".%s.incoming-%d-%d", into, os.Getpid(), i)
		f, err = root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
		if err != nil && !errors.Is(err, fs.ErrExist) {
			return 0, fail(err)
		}
	}
	keep := false
	defer func() {
		if !keep {
			_ = root.Remove(tmp)
		}
	}()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(f, h), io.LimitReader(resp.Body, max+1))
	if err == nil && n > max {
		err = fmt.Errorf("more than the %d bytes expected", max)
	}
	if err == nil {
		err = f.Sync() // kept only once it is on the disk
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return n, fail(err)
	}
	want, got := resp.Trailer.Get(SumTrailer), hex.EncodeToString(h.Sum(nil))
	if want != got {
		return n, fail(fmt.Errorf("its SHA-256 is %s, the source sent %q: refused", got, want))
	}
	if err := root.Rename(tmp, into); err != nil {
		return n, fail(err)
	}
	keep = true
	if d, err := root.Open("."); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return n, nil
}
