package transfer_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/transfer"
	"github.com/syscode-labs/imp/internal/pki"
)

// ids are node agents' identities under one CA, and one under another CA.
type ids struct {
	ca    pki.Pair
	nodes map[string]transfer.Identity
}

func identities(t *testing.T, nodes ...string) ids {
	t.Helper()
	now := time.Now()
	ca, err := pki.NewCA("imp-agents", now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	out := ids{ca: ca, nodes: map[string]transfer.Identity{}}
	for _, n := range nodes {
		out.nodes[n] = identity(t, ca, ca, n, true)
	}
	return out
}

// identity is node's agent certificate signed by ca, trusting roots.
func identity(t *testing.T, ca, roots pki.Pair, node string, client bool) transfer.Identity {
	t.Helper()
	leaf, err := pki.Issue(ca, pki.Request{CommonName: pki.AgentName, DNSNames: []string{pki.AgentDNSName(node)}, Server: true, Client: client, Lifetime: time.Hour}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(append(leaf.Cert, ca.Cert...), leaf.Key)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(roots.Cert)
	return func() (*tls.Certificate, *x509.CertPool, error) { return &cert, pool, nil }
}

// source is node a's transfer endpoint serving migration "m1" (file "state", the content) to
// node b only.
type source struct {
	url    string
	dir    string
	server *transfer.Server
	calls  atomic.Int32
}

const migration = types.UID("5f1c0a44-0d7e-4d3e-9a8e-2f6b1c9d0e11")

func serve(t *testing.T, id transfer.Identity, content []byte, tune func(*transfer.Server)) *source {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "state"), content, 0o600); err != nil {
		t.Fatal(err)
	}
	src := &source{dir: dir}
	src.server = &transfer.Server{Log: testr.New(t), Authorize: func(_ context.Context, node string, m types.UID) (map[string]transfer.File, error) {
		src.calls.Add(1)
		if node != "b" || m != migration {
			return nil, transfer.ErrNotAllowed
		}
		return map[string]transfer.File{"state": {Dir: dir, Name: "state"}, "fifo": {Dir: dir, Name: "fifo"},
			"link": {Dir: dir, Name: "link"}, "hardlink": {Dir: dir, Name: "hardlink"}, "via": {Dir: dir, Name: "sub/state"}}, nil
	}}
	if tune != nil {
		tune(src.server)
	}
	ts := httptest.NewUnstartedServer(src.server.Handler())
	ts.TLS = transfer.ServerTLS(id)
	ts.StartTLS()
	t.Cleanup(ts.Close)
	src.url = ts.URL
	return src
}

func client(t *testing.T, id transfer.Identity, sourceNode string) *http.Client {
	t.Helper()
	cfg, err := transfer.ClientTLS(id, sourceNode)
	if err != nil {
		t.Fatal(err)
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}}
}

func random(t *testing.T, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestAFileMovesChecked(t *testing.T) {
	id := identities(t, "a", "b")
	content := random(t, 3<<20+17)
	var progress atomic.Int64
	src := serve(t, id.nodes["a"], content, func(s *transfer.Server) {
		s.Progress = func(m types.UID, sent int64) { progress.Store(sent) }
	})
	into := filepath.Join(t.TempDir(), "state")
	n, err := transfer.Fetch(context.Background(), client(t, id.nodes["b"], "a"), src.url, migration, "state", filepath.Dir(into), filepath.Base(into), 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(into)
	if n != int64(len(content)) || !bytes.Equal(got, content) {
		t.Fatalf("received %d bytes, %d kept, equal %v; want %d", n, len(got), bytes.Equal(got, content), len(content))
	}
	if progress.Load() != int64(len(content)) {
		t.Errorf("progress says %d bytes sent", progress.Load())
	}
	if _, err := transfer.Fetch(context.Background(), client(t, id.nodes["b"], "a"), src.url, migration, "../../etc/passwd", filepath.Dir(into), "state2", 1<<30); err == nil {
		t.Error("a name outside the migration's files was served")
	}
}

// TestOnlyTheTargetFetches: the source's files go to the agent of the migration's target node,
// and to no other client: another node's agent, a client without a certificate, one whose
// certificate another CA signed for the target's name, one whose certificate is not for
// client use, and the target asking for another migration are all refused; and the target
// refuses a server that is not the source node's agent.
func TestOnlyTheTargetFetches(t *testing.T) {
	id := identities(t, "a", "b", "c")
	src := serve(t, id.nodes["a"], []byte("memory"), nil)
	into := filepath.Join(t.TempDir(), "state")
	fetch := func(c *http.Client, m types.UID) error {
		_, err := transfer.Fetch(context.Background(), c, src.url, m, "state", filepath.Dir(into), filepath.Base(into), 1<<30)
		return err
	}
	other, err := pki.NewCA("imp-agents", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(id.ca.Cert)
	cases := map[string]*http.Client{
		"another node's agent":                 client(t, id.nodes["c"], "a"),
		"no certificate":                       {Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: pki.AgentDNSName("a")}}},
		"the target's name from another CA":    client(t, identity(t, other, id.ca, "b", true), "a"),
		"the target's name not for client use": client(t, identity(t, id.ca, id.ca, "b", false), "a"),
		"a certificate of the CA that is no agent's": client(t, func() transfer.Identity {
			leaf, _ := pki.Issue(id.ca, pki.Request{CommonName: "imp-operator", DNSNames: []string{pki.AgentDNSName("b")}, Client: true, Lifetime: time.Hour}, time.Now())
			cert, _ := tls.X509KeyPair(leaf.Cert, leaf.Key)
			return func() (*tls.Certificate, *x509.CertPool, error) { return &cert, roots, nil }
		}(), "a"),
	}
	for name, c := range cases {
		if err := fetch(c, migration); err == nil {
			t.Errorf("%s fetched the migration's file", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
	if err := fetch(client(t, id.nodes["b"], "a"), "5f1c0a44-0d7e-4d3e-9a8e-2f6b1c9d0e12"); err == nil || !strings.Contains(err.Error(), "403") {
		t.Errorf("the target fetched another migration's file: %v", err)
	}
	if err := fetch(client(t, id.nodes["b"], "c"), migration); err == nil {
		t.Error("the target took node a's agent for node c's")
	}
	if _, err := os.Stat(into); err == nil {
		t.Error("a refused fetch left a file")
	}
	if err := fetch(client(t, id.nodes["b"], "a"), migration); err != nil {
		t.Errorf("the target: %v", err)
	}
}

// TestATamperedTransferIsRefused: bytes changed on the way (a proxy flips one after the
// handshake) fail the connection; a source whose sum does not match what it sent (or that
// sends none, ending early) is refused; nothing is kept either way.
func TestATamperedTransferIsRefused(t *testing.T) {
	id := identities(t, "a", "b")
	content := random(t, 1<<20)
	src := serve(t, id.nodes["a"], content, nil)
	into := filepath.Join(t.TempDir(), "state")

	// A proxy that flips the 20,000th byte the source sends.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", strings.TrimPrefix(src.url, "https://"))
			if err != nil {
				c.Close()
				continue
			}
			go func() { _, _ = io.Copy(up, c); up.Close() }()
			go func() {
				buf := make([]byte, 4096)
				seen := 0
				for {
					n, err := up.Read(buf)
					if n > 0 {
						if seen <= 20000 && seen+n > 20000 {
							buf[20000-seen] ^= 0x40
						}
						seen += n
						if _, werr := c.Write(buf[:n]); werr != nil {
							break
						}
					}
					if err != nil {
						break
					}
				}
				c.Close()
			}()
		}
	}()
	if _, err := transfer.Fetch(context.Background(), client(t, id.nodes["b"], "a"), "https://"+l.Addr().String(), migration, "state", filepath.Dir(into), filepath.Base(into), 1<<30); err == nil {
		t.Error("a transfer with a flipped byte was kept")
	} else {
		t.Logf("a flipped byte: %v", err)
	}

	// Sources that lie about the sum, or send none.
	for name, sum := range map[string]string{"a wrong sum": strings.Repeat("0", 64), "no sum": ""} {
		liar := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Trailer", transfer.SumTrailer)
			_, _ = w.Write(content)
			if sum != "" {
				w.Header().Set(transfer.SumTrailer, sum)
			}
		}))
		liar.TLS = transfer.ServerTLS(id.nodes["a"])
		liar.StartTLS()
		_, err := transfer.Fetch(context.Background(), client(t, id.nodes["b"], "a"), liar.URL, migration, "state", filepath.Dir(into), filepath.Base(into), 1<<30)
		liar.Close()
		if err == nil {
			t.Errorf("%s: kept", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
	entries, _ := os.ReadDir(filepath.Dir(into))
	if len(entries) != 0 {
		t.Errorf("refused transfers left %d files", len(entries))
	}
}

// allowAll has the server of src serve migration's files to any of nodes.
func allowAll(src *source, nodes ...string) {
	src.server.Authorize = func(_ context.Context, node string, m types.UID) (map[string]transfer.File, error) {
		for _, n := range nodes {
			if n == node && m == migration {
				return map[string]transfer.File{"state": {Dir: src.dir, Name: "state"}}, nil
			}
		}
		return nil, transfer.ErrNotAllowed
	}
}

// TestTransfersAreBounded: the bandwidth bound holds over all transfers of a node, no more
// than Concurrent files are served at once (one here: three nodes' fetches at once are sent
// one after another, never interleaved; with a limit of three the test fails), and one node's
// are served one at a time whatever the limit.
func TestTransfersAreBounded(t *testing.T) {
	id := identities(t, "a", "b", "c", "d")
	const size, rate = 1 << 20, 4 << 20 // 1 MiB each at 4 MiB/s
	var mu sync.Mutex
	var sent []int64
	run := func(concurrent int, nodes ...string) time.Duration {
		sent = nil
		src := serve(t, id.nodes["a"], random(t, size), func(s *transfer.Server) {
			s.BytesPerSecond, s.Concurrent = rate, concurrent
			s.Progress = func(_ types.UID, n int64) {
				mu.Lock()
				sent = append(sent, n)
				mu.Unlock()
			}
		})
		allowAll(src, "b", "c", "d")
		var wg sync.WaitGroup
		began := time.Now()
		dir := t.TempDir()
		errs := make(chan error, len(nodes))
		for i, node := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := transfer.Fetch(context.Background(), client(t, id.nodes[node], "a"), src.url, migration, "state", dir, string(rune('a'+i)), 1<<30)
				errs <- err
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		return time.Since(began)
	}
	// sequential says whether the files were sent whole one after another.
	sequential := func(files int) bool {
		n, last := 0, int64(0)
		for _, v := range sent {
			if v <= last {
				return false
			}
			last = v
			if v == size {
				n, last = n+1, 0
			}
		}
		return n == files
	}
	took := run(1, "b", "c", "d")
	if !sequential(3) {
		t.Errorf("three nodes' transfers interleaved at a limit of one: progress %v", sent)
	}
	// 3 MiB at 4 MiB/s, less the burst the limiter starts with (256 KiB).
	if least := time.Duration(float64(3*size-256<<10) / rate * float64(time.Second)); took < least {
		t.Errorf("3 MiB moved in %v at a bound of 4 MiB/s; it takes at least %v", took, least)
	}
	run(3, "b", "b")
	if !sequential(2) {
		t.Errorf("one node's two transfers interleaved: progress %v", sent)
	}
}

// TestHostileFilesAreRefused: what a compromised VMM can leave where a migration's files are —
// a FIFO (whose open would block a turn for ever), a symbolic link to a host file, a second
// link of a host file, a directory that is a link out of the VM's — is refused, at once, and
// holds no turn: the migration's own file is served after them.
func TestHostileFilesAreRefused(t *testing.T) {
	id := identities(t, "a", "b")
	src := serve(t, id.nodes["a"], []byte("memory"), func(s *transfer.Server) { s.Concurrent = 1 })
	host := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(host, []byte("the host's"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(filepath.Join(src.dir, "fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(host, filepath.Join(src.dir, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(host, filepath.Join(src.dir, "hardlink")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Dir(host), filepath.Join(src.dir, "sub")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(host, filepath.Join(filepath.Dir(host), "state")); err != nil {
		t.Fatal(err)
	}
	into := t.TempDir()
	c := client(t, id.nodes["b"], "a")
	for _, name := range []string{"fifo", "link", "hardlink", "via"} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := transfer.Fetch(ctx, c, src.url, migration, name, into, name, 1<<20)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "500") {
			t.Errorf("%s: %v; want refused", name, err)
		}
	}
	if _, err := transfer.Fetch(context.Background(), c, src.url, migration, "state", into, "state", 1<<20); err != nil {
		t.Errorf("the migration's file after the hostile ones: %v", err)
	}
	if entries, _ := os.ReadDir(into); len(entries) != 1 {
		t.Errorf("%d files received; want the one", len(entries))
	}
}

// TestAStalledTargetLetsGo: a target that asks for a file and reads none of it holds its turn
// for Stall, no longer: another node's transfer is served after it; and a file larger than
// its receiver expects is refused and not kept.
func TestAStalledTargetLetsGo(t *testing.T) {
	id := identities(t, "a", "b", "c")
	src := serve(t, id.nodes["a"], random(t, 16<<20), func(s *transfer.Server) { s.Concurrent, s.Stall = 1, 300*time.Millisecond })
	allowAll(src, "b", "c")
	cfg, err := transfer.ClientTLS(id.nodes["b"], "a")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := tls.Dial("tcp", strings.TrimPrefix(src.url, "https://"), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("GET /migrations/" + string(migration) + "/files/state HTTP/1.1\r\nHost: a\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // its turn taken; it reads nothing
	into := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := transfer.Fetch(ctx, client(t, id.nodes["c"], "a"), src.url, migration, "state", into, "state", 1<<30); err != nil {
		t.Fatalf("another node's transfer after a stalled one: %v", err)
	}
	if _, err := transfer.Fetch(ctx, client(t, id.nodes["c"], "a"), src.url, migration, "state", into, "small", 1<<20); err == nil || !strings.Contains(err.Error(), "more than") {
		t.Errorf("a file of 16 MiB where 1 MiB was expected: %v", err)
	}
	if _, err := os.Stat(filepath.Join(into, "small")); err == nil {
		t.Error("a file larger than expected was kept")
	}
	if entries, _ := os.ReadDir(into); len(entries) != 1 {
		t.Errorf("%d files in the receiving directory; want the one kept", len(entries))
	}
}
