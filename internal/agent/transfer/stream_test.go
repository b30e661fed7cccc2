package transfer_test

import (
	"context"
	"io"
	"net"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/transfer"
)

// TestStreams: the migration's source opens a stream to its target's agent and bytes go both
// ways; another node's agent, and the source asking for another migration, are refused before
// any stream; streams beyond the limit are refused while the others run.
func TestStreams(t *testing.T) {
	id := identities(t, "a", "b", "c")
	release := make(chan struct{})
	streams := &transfer.Streams{Concurrent: 1, Authorize: func(_ context.Context, node string, m types.UID, name string) (func(net.Conn), error) {
		if node != "a" || m != migration || name != "memory" {
			return nil, transfer.ErrNotAllowed
		}
		return func(c net.Conn) {
			buf := make([]byte, 4)
			if _, err := io.ReadFull(c, buf); err == nil {
				_, _ = c.Write(append([]byte("echo "), buf...))
			}
			<-release
		}, nil
	}}
	ts := httptest.NewUnstartedServer(streams.Handler())
	ts.TLS = transfer.ServerTLS(id.nodes["b"])
	ts.StartTLS()
	defer ts.Close()
	addr := strings.TrimPrefix(ts.URL, "https://")
	dial := func(node string, m types.UID) (net.Conn, error) {
		cfg, err := transfer.ClientTLS(id.nodes[node], "b")
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return transfer.DialStream(ctx, cfg, addr, m, "memory")
	}
	c, err := dial("a", migration)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 9)
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "echo ping" {
		t.Fatalf("the stream answered %q, %v", got, err)
	}
	if _, err := dial("a", migration); err == nil || !strings.Contains(err.Error(), "503") {
		t.Errorf("a stream beyond the limit: %v; want 503", err)
	}
	close(release)
	for name, try := range map[string]func() error{
		"another node's agent": func() error { _, err := dial("c", migration); return err },
		"another migration":    func() error { _, err := dial("a", "5f1c0a44-0d7e-4d3e-9a8e-2f6b1c9d0e12"); return err },
	} {
		if err := try(); err == nil || !strings.Contains(err.Error(), "403") {
			t.Errorf("%s: %v; want 403", name, err)
		}
	}
}
