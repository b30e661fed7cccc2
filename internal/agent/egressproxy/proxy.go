// Package egressproxy limits a network's HTTP and TLS egress to named domains. Its network's
// namespace redirects every TCP connection a VM makes to port 80 or 443 outside the network
// to the proxy, listening on the gateway (hostnet's domain egress rules). The proxy reads the
// name the client asks for — the HTTP request's Host, the TLS ClientHello's server name —
// before it sends anything on, lets the connection out only when the name is allowed, resolves
// the name itself with the node's resolver (never the guest's answer, nor the address the guest
// dialled), refuses when any address it resolves to, or the one the guest dialled, is internal
// (the node's, link-local, the cluster's denied ranges, what the network's egress rules do not
// let out), dials the first address it checked from the node, and splices. A refused
// connection is reset, counted, and reported with the name asked for.
package egressproxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/crypto/cryptobyte"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/validation"
)

// Port is where the proxy listens on a network's gateway.
const Port = 15001

// Bounds of what the proxy reads and waits for before it decides.
const (
	maxHello    = 16 << 10 // a ClientHello or a request's head
	helloWait   = 10 * time.Second
	resolveWait = 5 * time.Second
	dialWait    = 10 * time.Second
)

// Why a connection was refused (the metric's result label and the report's reason).
const (
	Allowed            = "allowed"
	RefusedDomain      = "domain"      // the name is not an allowed domain
	RefusedNoName      = "no-name"     // neither a Host nor a server name, or not a domain name
	RefusedInternal    = "internal"    // the name resolves to an internal address
	RefusedDestination = "destination" // the guest dialled an internal address
	RefusedUnresolved  = "unresolved"
	RefusedUnreachable = "unreachable"
	RefusedUpgrade     = "upgrade" // plain HTTP asking to become another protocol
	RefusedLimit       = "limit"   // over the proxy's or the VM's bound of connections
)

// Bounds of connections: at once through a proxy, and of one VM; a spliced connection with
// nothing in either direction for idleTimeout ends.
const (
	maxConns     = 1024
	maxPerClient = 64
	idleTimeout  = 10 * time.Minute
)

// Domains are the allowed names: exact ("api.github.com") or with one leading wildcard label
// ("*.pypi.org": files.pypi.org and a.b.pypi.org, not pypi.org).
type Domains []string

// Allows says whether name is one of d's.
func (d Domains) Allows(name string) bool {
	for _, p := range d {
		if suffix, ok := strings.CutPrefix(p, "*."); ok {
			if strings.HasSuffix(name, "."+suffix) {
				return true
			}
		} else if name == p {
			return true
		}
	}
	return false
}

// Decision is what became of one connection.
type Decision struct {
	Client netip.AddrPort // the VM
	Dialed netip.AddrPort // where the VM sent it
	Name   string         // the name it asked for, as read (bounded)
	Result string         // Allowed or a refusal
	Err    error
}

// Proxy serves the connections its listener accepts (in one network's namespace).
type Proxy struct {
	Listener net.Listener
	// OriginalDst is where the client dialled before the redirect.
	OriginalDst func(net.Conn) (netip.AddrPort, error)
	// Resolve resolves a name with the node's resolver.
	Resolve func(ctx context.Context, name string) ([]netip.Addr, error)
	// Internal says why an address may not be reached on a TCP port, or "".
	Internal func(netip.Addr, uint16) string
	// Dial connects from the node.
	Dial func(ctx context.Context, to netip.AddrPort) (net.Conn, error)
	// Decided is told of every connection (metrics, Events).
	Decided func(Decision)

	domains atomic.Pointer[Domains]
	wg      sync.WaitGroup

	mu       sync.Mutex
	conns    int
	byClient map[netip.Addr]int
}

// SetDomains replaces the allowed names; connections already let out stay.
func (p *Proxy) SetDomains(d Domains) { p.domains.Store(&d) }

// Serve accepts until the listener is closed, each connection on its own goroutine, and
// returns once they have all ended.
func (p *Proxy) Serve(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer func() { cancel(); p.wg.Wait() }()
	go func() { <-ctx.Done(); p.Listener.Close() }()
	backoff := 5 * time.Millisecond
	for {
		c, err := p.Listener.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			// Out of descriptors, say: wait and go on, as net/http's server does; never stop
			// serving the network for good.
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		client := addrPort(c.RemoteAddr()).Addr()
		if !p.take(client) {
			if p.Decided != nil {
				p.Decided(Decision{Client: addrPort(c.RemoteAddr()), Result: RefusedLimit})
			}
			reset(c)
			continue
		}
		p.wg.Go(func() {
			defer p.give(client)
			p.handle(ctx, c)
		})
	}
}

// take counts a connection of client in, unless the proxy or the client is at its bound.
func (p *Proxy) take(client netip.Addr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byClient == nil {
		p.byClient = map[netip.Addr]int{}
	}
	if p.conns >= maxConns || p.byClient[client] >= maxPerClient {
		return false
	}
	p.conns++
	p.byClient[client]++
	return true
}

func (p *Proxy) give(client netip.Addr) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.conns--
	if p.byClient[client]--; p.byClient[client] <= 0 {
		delete(p.byClient, client)
	}
}

func (p *Proxy) handle(ctx context.Context, c net.Conn) {
	d := Decision{Client: addrPort(c.RemoteAddr())}
	up, head, err := p.decide(ctx, c, &d)
	if p.Decided != nil {
		p.Decided(d)
	}
	if err != nil {
		reset(c)
		return
	}
	defer c.Close()
	defer up.Close()
	fromClient := &waiting{c: c, wait: idleTimeout, left: -1}
	from := io.MultiReader(bytes.NewReader(head), fromClient)
	done := make(chan struct{}, 2)
	closeWrite := func(dst net.Conn) {
		if tc, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = tc.CloseWrite()
		}
	}
	go func() {
		if head[0] == 0x16 {
			_, _ = io.Copy(up, from)
		} else if !p.requests(up, from, fromClient, d) {
			reset(c)
			reset(up)
		}
		closeWrite(up)
		done <- struct{}{}
	}()
	go func() {
		_, _ = io.Copy(c, &waiting{c: up, wait: idleTimeout, left: -1})
		closeWrite(c)
		done <- struct{}{}
	}()
	select {
	case <-done:
		<-done
	case <-ctx.Done():
	}
}

// waiting reads c, each read waiting at most wait: a bound on a request's head while one is
// read, an idle timeout otherwise.
type waiting struct {
	c    net.Conn
	wait time.Duration
	// left, when not negative, is what may still be read (a request's head).
	left int
}

func (w *waiting) Read(b []byte) (int, error) {
	if w.left == 0 {
		return 0, fmt.Errorf("a request's head longer than %d bytes", maxHello)
	}
	if w.left > 0 && len(b) > w.left {
		b = b[:w.left]
	}
	_ = w.c.SetReadDeadline(time.Now().Add(w.wait))
	n, err := w.c.Read(b)
	if w.left > 0 {
		w.left -= n
	}
	return n, err
}

// requests forwards the client's HTTP requests to up one by one, each checked to ask for the
// name the connection was let out for: a second request of a kept-alive connection naming
// another host (which a shared front end would route by its Host) ends the connection, and is
// reported; so does a request to upgrade the connection to another protocol (a WebSocket, h2c),
// after which nothing could be checked (WebSockets pass over TLS, wss). Each request's head
// is bounded in size and time; its body is not. It returns false when it refused a request.
func (p *Proxy) requests(up io.Writer, from io.Reader, client *waiting, first Decision) bool {
	br := bufio.NewReaderSize(from, 4096)
	for {
		// The head: at most maxHello more bytes from the client (what the reader holds
		// already aside), within helloWait.
		client.left, client.wait = maxHello, helloWait
		req, err := http.ReadRequest(br)
		client.left, client.wait = -1, idleTimeout
		if err != nil {
			return true // the client is done, or sent what is no request: the end
		}
		host := req.Host
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
		if host = strings.TrimSuffix(strings.ToLower(host), "."); host != first.Name {
			if p.Decided != nil {
				p.Decided(Decision{Client: first.Client, Dialed: first.Dialed, Name: bounded(host), Result: RefusedDomain,
					Err: fmt.Errorf("a later request of a connection let out for %s", first.Name)})
			}
			return false
		}
		if req.Header.Get("Upgrade") != "" {
			if p.Decided != nil {
				p.Decided(Decision{Client: first.Client, Dialed: first.Dialed, Name: first.Name, Result: RefusedUpgrade,
					Err: fmt.Errorf("Upgrade: %s over plain HTTP", bounded(req.Header.Get("Upgrade")))})
			}
			return false
		}
		if _, ok := req.Header["User-Agent"]; !ok {
			req.Header["User-Agent"] = []string{""} // Write adds Go's otherwise
		}
		if err := req.Write(up); err != nil {
			return true
		}
	}
}

// decide reads the name c asks for and connects to it when it may: the upstream connection and
// the bytes read so far, which go first. d is filled in either way.
func (p *Proxy) decide(ctx context.Context, c net.Conn, d *Decision) (net.Conn, []byte, error) {
	refuse := func(result string, err error) (net.Conn, []byte, error) {
		d.Result, d.Err = result, err
		if err == nil {
			err = errors.New(result)
		}
		return nil, nil, err
	}
	dst, err := p.OriginalDst(c)
	if err != nil {
		return refuse(RefusedNoName, fmt.Errorf("the original destination: %w", err))
	}
	d.Dialed = dst
	_ = c.SetReadDeadline(time.Now().Add(helloWait))
	head, name, err := readName(c)
	_ = c.SetReadDeadline(time.Time{})
	d.Name = name
	if err != nil {
		return refuse(RefusedNoName, err)
	}
	if doms := p.domains.Load(); doms == nil || !doms.Allows(name) {
		return refuse(RefusedDomain, nil)
	}
	if why := p.Internal(dst.Addr(), dst.Port()); why != "" {
		return refuse(RefusedDestination, fmt.Errorf("dialled %s: %s", dst.Addr(), why))
	}
	rctx, cancel := context.WithTimeout(ctx, resolveWait)
	addrs, err := p.Resolve(rctx, name)
	cancel()
	var v4 []netip.Addr
	for _, a := range addrs {
		if a = a.Unmap(); a.Is4() {
			v4 = append(v4, a)
		}
	}
	if err != nil || len(v4) == 0 {
		return refuse(RefusedUnresolved, err)
	}
	// Any internal address among the answers refuses the name: an answer that mixes one in
	// is a rebinding attempt, whichever address a retry would pick.
	for _, a := range v4 {
		if why := p.Internal(a, dst.Port()); why != "" {
			return refuse(RefusedInternal, fmt.Errorf("%s resolves to %s: %s", name, a, why))
		}
	}
	var last error
	for _, a := range v4 {
		dctx, cancel := context.WithTimeout(ctx, dialWait)
		up, err := p.Dial(dctx, netip.AddrPortFrom(a, dst.Port()))
		cancel()
		if err == nil {
			d.Result = Allowed
			return up, head, nil
		}
		last = err
	}
	return refuse(RefusedUnreachable, last)
}

// readName reads from c until it holds a TLS ClientHello's server name or an HTTP request's
// Host, and returns what it read and the name (lower case, no port, no trailing dot).
func readName(c net.Conn) ([]byte, string, error) {
	buf := make([]byte, 0, 2048)
	chunk := make([]byte, 2048)
	for {
		n, err := c.Read(chunk)
		buf = append(buf, chunk[:n]...)
		if len(buf) > 0 {
			name, complete, perr := parseName(buf)
			if perr != nil {
				return buf, name, perr
			}
			if complete {
				name = strings.TrimSuffix(strings.ToLower(name), ".")
				if _, err := netip.ParseAddr(name); err == nil || len(validation.IsDNS1123Subdomain(name)) > 0 {
					return buf, bounded(name), fmt.Errorf("%q is not a domain name", bounded(name))
				}
				return buf, name, nil
			}
		}
		if len(buf) >= maxHello {
			return buf, "", fmt.Errorf("no name in the first %d bytes", maxHello)
		}
		if err != nil {
			return buf, "", fmt.Errorf("reading the request: %w", err)
		}
	}
}

// bounded keeps a name short and printable for reports.
func bounded(s string) string {
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r > 0x7e {
			return '?'
		}
		return r
	}, s)
	if len(s) > 253 {
		s = s[:253]
	}
	return s
}

// parseName finds the name in what was read so far: complete says there was enough to
// decide (a name, possibly empty, or an error).
func parseName(b []byte) (name string, complete bool, err error) {
	if b[0] == 0x16 { // a TLS handshake record
		return serverName(b)
	}
	end := bytes.Index(b, []byte("\r\n\r\n"))
	if end < 0 {
		return "", false, nil
	}
	req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(b[:end+4])))
	if err != nil {
		return "", true, fmt.Errorf("an HTTP request: %w", err)
	}
	host := req.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	if host == "" {
		return "", true, errors.New("an HTTP request without Host")
	}
	return host, true, nil
}

// serverName reads the server name of the TLS ClientHello at the start of b (its first record
// only: a ClientHello fits one).
func serverName(b []byte) (string, bool, error) {
	if len(b) < 5 {
		return "", false, nil
	}
	rec := cryptobyte.String(b)
	var typ uint8
	var vers uint16
	var body cryptobyte.String
	if !rec.ReadUint8(&typ) || !rec.ReadUint16(&vers) {
		return "", false, nil
	}
	if !rec.ReadUint16LengthPrefixed(&body) {
		return "", false, nil // the record is not all here yet
	}
	var hsType uint8
	var hello cryptobyte.String
	if !body.ReadUint8(&hsType) || hsType != 1 || !body.ReadUint24LengthPrefixed(&hello) {
		return "", true, errors.New("not a TLS ClientHello in one record")
	}
	var random, session, suites, compression, exts cryptobyte.String
	if !hello.Skip(2) || !hello.ReadBytes((*[]byte)(&random), 32) || !hello.ReadUint8LengthPrefixed(&session) ||
		!hello.ReadUint16LengthPrefixed(&suites) || !hello.ReadUint8LengthPrefixed(&compression) || !hello.ReadUint16LengthPrefixed(&exts) {
		return "", true, errors.New("a malformed TLS ClientHello")
	}
	for !exts.Empty() {
		var ext uint16
		var data cryptobyte.String
		if !exts.ReadUint16(&ext) || !exts.ReadUint16LengthPrefixed(&data) {
			return "", true, errors.New("a malformed TLS extension")
		}
		if ext != 0 { // server_name
			continue
		}
		var list cryptobyte.String
		if !data.ReadUint16LengthPrefixed(&list) {
			return "", true, errors.New("a malformed server_name extension")
		}
		for !list.Empty() {
			var kind uint8
			var host cryptobyte.String
			if !list.ReadUint8(&kind) || !list.ReadUint16LengthPrefixed(&host) {
				return "", true, errors.New("a malformed server name")
			}
			if kind == 0 {
				return string(host), true, nil
			}
		}
	}
	return "", true, errors.New("a TLS ClientHello without a server name")
}

// reset closes c with a reset, not a FIN: the client learns at once.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
}

// OriginalDst is where a connection the network's namespace redirected to the proxy was sent
// (conntrack's original destination, SO_ORIGINAL_DST).
func OriginalDst(c net.Conn) (netip.AddrPort, error) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return netip.AddrPort{}, errors.New("not a TCP connection")
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var out netip.AddrPort
	var gerr error
	err = raw.Control(func(fd uintptr) {
		// A sockaddr_in, read through the one getsockopt of x/sys that takes 16 bytes or more.
		m, err := unix.GetsockoptIPv6Mreq(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST)
		if err != nil {
			gerr = err
			return
		}
		b := m.Multiaddr
		out = netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), uint16(b[2])<<8|uint16(b[3]))
	})
	return out, errors.Join(err, gerr)
}

func addrPort(a net.Addr) netip.AddrPort {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.AddrPort()
	}
	return netip.AddrPort{}
}
