package probe

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"unicode"
)

// maxOutput bounds what of a failed attempt's output or body is kept for its message.
const maxOutput = 256

// Checks is the Checker of the four handlers. HTTP, TCP and gRPC it does itself; a command it
// hands to Exec, which runs argv as the workload runs (its user, environment, directory) and
// returns its exit code and the start of its output.
type Checks struct {
	Exec func(ctx context.Context, argv []string) (code int, output []byte, err error)
	// Dialer connects for TCP, HTTP and gRPC (default: a net.Dialer).
	Dialer func(ctx context.Context, network, addr string) (net.Conn, error)
}

var _ Checker = (*Checks)(nil)

// Check runs one attempt of s.
func (c *Checks) Check(ctx context.Context, s *Spec) error {
	switch {
	case len(s.Exec) > 0:
		return c.exec(ctx, s.Exec)
	case s.HTTP != nil:
		return c.http(ctx, s.HTTP)
	case s.TCP != nil:
		conn, err := c.dial(ctx, "tcp", hostPort(s.TCP.Host, s.TCP.Port))
		if err != nil {
			return err
		}
		return conn.Close()
	case s.GRPC != nil:
		return c.grpc(ctx, s.GRPC)
	}
	return errors.New("a probe without a handler")
}

func (c *Checks) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	if c.Dialer != nil {
		return c.Dialer(ctx, network, addr)
	}
	var d net.Dialer
	return d.DialContext(ctx, network, addr)
}

func hostPort(host string, port int) string {
	if host == "" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, strconv.Itoa(port))
}

func (c *Checks) exec(ctx context.Context, argv []string) error {
	if c.Exec == nil {
		return errors.New("exec probes are not supported here")
	}
	code, out, err := c.Exec(ctx, argv)
	if err != nil {
		return fmt.Errorf("running %q: %w", argv[0], err)
	}
	if code != 0 {
		return fmt.Errorf("command %q exited with %d: %s", argv[0], code, clip(out))
	}
	return nil
}

// clip is the start of b as one line of valid text.
func clip(b []byte) string {
	if len(b) > maxOutput {
		b = b[:maxOutput]
	}
	s := strings.Map(func(r rune) rune {
		if !unicode.IsPrint(r) {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(string(b), "?"))
	return strings.Join(strings.Fields(s), " ")
}

// transport is the probes' HTTP transport: no keep-alive (each attempt a new connection, as the
// kubelet's), HTTPS unverified, no proxy.
func (c *Checks) transport() *http.Transport {
	return &http.Transport{
		DialContext:       c.dial,
		TLSClientConfig:   &tls.Config{InsecureSkipVerify: true}, //nolint:gosec // as the kubelet's HTTPS probes
		DisableKeepAlives: true,
		Proxy:             nil,
	}
}

func (c *Checks) http(ctx context.Context, h *HTTP) error {
	scheme := strings.ToLower(h.Scheme)
	if scheme == "" {
		scheme = "http"
	}
	path := h.Path
	if !strings.HasPrefix(path, "/") {
		path = "/" + path
	}
	u := &url.URL{Scheme: scheme, Host: hostPort(h.Host, h.Port)}
	ref, err := url.Parse(path)
	if err != nil {
		return fmt.Errorf("path %q: %w", h.Path, err)
	}
	u = u.ResolveReference(ref)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return err
	}
	req.Header.Set("User-Agent", "imp-probe/1.0")
	req.Header.Set("Accept", "*/*")
	for _, hd := range h.Headers {
		if strings.EqualFold(hd.Name, "Host") {
			req.Host = hd.Value
			continue
		}
		req.Header.Add(hd.Name, hd.Value)
	}
	client := &http.Client{
		Transport: c.transport(),
		// Redirects are followed to the same host only, as the kubelet does.
		CheckRedirect: func(r *http.Request, via []*http.Request) error {
			if len(via) >= 10 || r.URL.Hostname() != via[0].URL.Hostname() {
				return http.ErrUseLastResponse
			}
			return nil
		},
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", u.Redacted(), unwrapURL(err))
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 10<<10))
	if resp.StatusCode < 200 || resp.StatusCode >= 400 {
		return fmt.Errorf("HTTP probe failed with status %d: %s", resp.StatusCode, clip(body))
	}
	return nil
}

func unwrapURL(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// grpc calls grpc.health.v1.Health/Check over HTTP/2 without TLS, as the kubelet's gRPC probe
// does: the request and response are small enough to write by hand (HealthCheckRequest's field
// 1 is the service, HealthCheckResponse's field 1 the status, 1 being SERVING).
func (c *Checks) grpc(ctx context.Context, g *GRPC) error {
	msg := []byte{}
	if g.Service != "" {
		msg = append(msg, 0x0a)
		msg = binary.AppendUvarint(msg, uint64(len(g.Service)))
		msg = append(msg, g.Service...)
	}
	body := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(body[1:], uint32(len(msg)))
	body = append(body, msg...)
	addr := hostPort("", g.Port)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/grpc.health.v1.Health/Check", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("TE", "trailers")
	req.Header.Set("User-Agent", "imp-probe/1.0")
	tr := c.transport()
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	tr.Protocols = &p
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return fmt.Errorf("gRPC health check of %s: %w", addr, unwrapURL(err))
	}
	defer resp.Body.Close()
	reply, err := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	if err != nil {
		return fmt.Errorf("gRPC health check of %s: reading the reply: %w", addr, err)
	}
	status := resp.Trailer.Get("Grpc-Status")
	if status == "" {
		status = resp.Header.Get("Grpc-Status") // a trailers-only reply
	}
	if status != "0" {
		return fmt.Errorf("gRPC health check of %s failed: status %s: %s", addr, status, clip([]byte(resp.Trailer.Get("Grpc-Message")+resp.Header.Get("Grpc-Message"))))
	}
	serving, err := servingStatus(reply)
	if err != nil {
		return fmt.Errorf("gRPC health check of %s: %w", addr, err)
	}
	if serving != 1 {
		return fmt.Errorf("gRPC health check of %s: status %d, not SERVING", addr, serving)
	}
	return nil
}

// servingStatus reads HealthCheckResponse.status from one length-prefixed gRPC message.
func servingStatus(b []byte) (uint64, error) {
	if len(b) < 5 || b[0] != 0 {
		return 0, errors.New("a reply that is not one uncompressed message")
	}
	n := binary.BigEndian.Uint32(b[1:])
	if uint64(n) != uint64(len(b)-5) {
		return 0, errors.New("a reply of the wrong length")
	}
	m := b[5:]
	status := uint64(0) // proto3: an absent field is 0, UNKNOWN
	for len(m) > 0 {
		key, k := binary.Uvarint(m)
		if k <= 0 {
			return 0, errors.New("a malformed reply")
		}
		m = m[k:]
		switch key & 7 {
		case 0:
			v, k := binary.Uvarint(m)
			if k <= 0 {
				return 0, errors.New("a malformed reply")
			}
			if key>>3 == 1 {
				status = v
			}
			m = m[k:]
		case 2:
			l, k := binary.Uvarint(m)
			if k <= 0 || l > uint64(len(m)-k) {
				return 0, errors.New("a malformed reply")
			}
			m = m[k+int(l):]
		default:
			return 0, errors.New("a malformed reply")
		}
	}
	return status, nil
}
