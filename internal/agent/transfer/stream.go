package transfer

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// StreamProtocol is the Upgrade a migration's stream asks for.
const StreamProtocol = "imp-migration/1"

// Streams is the receiving side of a migration's streams: the source node's agent opens one
// for each of the VMM's connections (its memory and devices; its disk's mirror), and the
// bytes go both ways over the same mutually authenticated TLS connection.
type Streams struct {
	// Authorize returns what takes stream name of migration from node's agent, or
	// ErrNotAllowed: the agent allows only the source node of a migration whose target is this
	// node, while it copies. serve is given the connection and returns when done with it.
	Authorize func(ctx context.Context, node string, migration types.UID, name string) (serve func(net.Conn), err error)
	// Concurrent is how many streams are open at once (default 4); more are refused (503).
	Concurrent int

	slots chan struct{}
}

// Handler serves POST /migrations/{uid}/streams/{name} with Upgrade StreamProtocol: once
// authorized, the connection is the stream's.
func (s *Streams) Handler() http.Handler {
	n := s.Concurrent
	if n <= 0 {
		n = 4
	}
	s.slots = make(chan struct{}, n)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /migrations/{uid}/streams/{name}", s.serve)
	return mux
}

func (s *Streams) serve(w http.ResponseWriter, r *http.Request) {
	node, err := PeerNode(r.TLS)
	if err != nil {
		http.Error(w, err.Error(), http.StatusForbidden)
		return
	}
	if !strings.EqualFold(r.Header.Get("Upgrade"), StreamProtocol) {
		http.Error(w, "a stream asks for Upgrade: "+StreamProtocol, http.StatusUpgradeRequired)
		return
	}
	uid, name := types.UID(r.PathValue("uid")), r.PathValue("name")
	if !validUID.MatchString(string(uid)) {
		http.Error(w, "not a migration's UID", http.StatusBadRequest)
		return
	}
	handle, err := s.Authorize(r.Context(), node, uid, name)
	if err != nil {
		code := http.StatusInternalServerError
		if errors.Is(err, ErrNotAllowed) {
			code = http.StatusForbidden
		}
		http.Error(w, "refused", code)
		return
	}
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	default:
		http.Error(w, "too many streams", http.StatusServiceUnavailable)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: "+StreamProtocol+"\r\n\r\n"); err != nil {
		return
	}
	handle(&buffered{Conn: conn, r: brw.Reader})
}

// buffered is a connection whose first bytes a reader may hold already.
type buffered struct {
	net.Conn
	r *bufio.Reader
}

func (b *buffered) Read(p []byte) (int, error) { return b.r.Read(p) }

// DialStream opens stream name of migration to the agent at addr (host:port) of the
// migration's target node, over TLS with cfg (ClientTLS for that node).
func DialStream(ctx context.Context, cfg *tls.Config, addr string, migration types.UID, name string) (net.Conn, error) {
	d := tls.Dialer{Config: cfg}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("opening stream %s of migration %s: %w", name, migration, err)
	}
	req, _ := http.NewRequest(http.MethodPost, "https://imp/migrations/"+string(migration)+"/streams/"+name, nil)
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", StreamProtocol)
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	br := bufio.NewReader(c)
	err = req.Write(c)
	var resp *http.Response
	if err == nil {
		resp, err = http.ReadResponse(br, req)
	}
	if err == nil && resp.StatusCode != http.StatusSwitchingProtocols {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		err = fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(b)))
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("opening stream %s of migration %s: %w", name, migration, err)
	}
	_ = c.SetDeadline(time.Time{})
	return &buffered{Conn: c, r: br}, nil
}

// Bridge copies between a and b both ways until either ends, then closes both: a VMM's local
// socket and a migration's stream.
func Bridge(a, b io.ReadWriteCloser) {
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(a, b); done <- struct{}{} }()
	go func() { _, _ = io.Copy(b, a); done <- struct{}{} }()
	<-done
	a.Close()
	b.Close()
	<-done
}
