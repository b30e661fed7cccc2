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
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/go-logr/logr"
	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/pki"
)

// SumTrailer is the trailer that carries a file's SHA-256, hex, computed as it was sent.
const SumTrailer = "Imp-Sha256"

// chunk is how much is read, limited and hashed at a time.
const chunk = 256 << 10

// ErrNotAllowed is Authorize's answer for a node that may not fetch a migration's files.
var ErrNotAllowed = errors.New("not the target of this migration")

// Server serves the files of this node's migrations to their targets.
type Server struct {
	// Authorize returns the files (name → path on this node) of migration that node's agent may
	// fetch, or ErrNotAllowed (or another error) if it may fetch none: the agent allows only the
	// target node of a migration whose source is this node.
	Authorize func(ctx context.Context, node string, migration types.UID) (map[string]string, error)
	// Concurrent is how many files are served at once (default 2); further requests wait.
	Concurrent int
	// BytesPerSecond bounds what all transfers send together (0: unbounded).
	BytesPerSecond int64
	// Progress, when set, is told each chunk sent of a migration's files.
	Progress func(migration types.UID, sent int64)
	Log      logr.Logger

	slots   chan struct{}
	limiter *rate.Limiter
}

// Handler serves GET /migrations/{uid}/files/{name}: the file name of migration uid, to the
// node the client's certificate names (ServerTLS).
func (s *Server) Handler() http.Handler {
	n := s.Concurrent
	if n <= 0 {
		n = 2
	}
	s.slots = make(chan struct{}, n)
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
	path, ok := files[name]
	if !ok {
		http.Error(w, "no such file in this migration", http.StatusNotFound)
		return
	}
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	case <-r.Context().Done():
		return
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		http.Error(w, "cannot open the file", http.StatusInternalServerError)
		s.Log.Error(err, "opening a migration's file", "migration", uid, "file", name)
		return
	}
	defer f.Close()
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
// into path: written beside it, its SHA-256 checked against the source's, then renamed. A file
// whose sum does not match, or that ends early, is refused and nothing of it is left. It returns
// the bytes received.
func Fetch(ctx context.Context, c *http.Client, base string, migration types.UID, name, path string) (int64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("%s/migrations/%s/files/%s", base, migration, name), nil)
	if err != nil {
		return 0, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, fmt.Errorf("fetching %s of migration %s: %w", name, migration, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return 0, fmt.Errorf("fetching %s of migration %s: %s: %s", name, migration, resp.Status, strings.TrimSpace(string(b)))
	}
	tmp := path + ".incoming"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return 0, err
	}
	keep := false
	defer func() {
		if !keep {
			_ = os.Remove(tmp)
		}
	}()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(f, h), resp.Body)
	if err == nil {
		err = f.Sync() // kept only once it is on the disk
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return n, fmt.Errorf("fetching %s of migration %s: %w", name, migration, err)
	}
	want, got := resp.Trailer.Get(SumTrailer), hex.EncodeToString(h.Sum(nil))
	if want != got {
		return n, fmt.Errorf("fetching %s of migration %s: its SHA-256 is %s, the source sent %q: refused", name, migration, got, want)
	}
	if err := os.Rename(tmp, path); err != nil {
		return n, err
	}
	keep = true
	if d, err := os.Open(filepath.Dir(path)); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return n, nil
}
