package guestsession

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"sync"
	"time"
)

// Client is the agent's end of one VM's session channel. Everything it reads comes from the
// guest and is bounded: response headers, frames, and, through HTTP/2's flow control, what is
// buffered per stream and per connection. A guest that answers nothing holds a request until
// its context ends, and no more than that request.
type Client struct {
	token string
	tr    *http.Transport
	hc    *http.Client
}

// NewClient talks to a guest whose token is token over the connections dial makes. Under QEMU
// there can be one at a time (a virtio-serial port), so the client keeps at most one.
func NewClient(token string, dial func(ctx context.Context) (net.Conn, error)) *Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{
		Protocols:              &p,
		DialContext:            func(ctx context.Context, _, _ string) (net.Conn, error) { return dial(ctx) },
		MaxConnsPerHost:        1,
		MaxResponseHeaderBytes: 16 << 10,
		ResponseHeaderTimeout:  10 * time.Second,
		IdleConnTimeout:        90 * time.Second,
		HTTP2: &http.HTTP2Config{
			StrictMaxConcurrentRequests:   true,
			MaxReceiveBufferPerConnection: 1 << 20,
			MaxReceiveBufferPerStream:     256 << 10,
			SendPingTimeout:               15 * time.Second,
			PingTimeout:                   10 * time.Second,
			WriteByteTimeout:              10 * time.Second,
		},
	}
	return &Client{token: token, tr: tr, hc: &http.Client{Transport: tr}}
}

// Close ends the client's connection.
func (c *Client) Close() { c.tr.CloseIdleConnections() }

// ExecOptions is a command to run in the guest and its streams.
type ExecOptions struct {
	Command []string
	TTY     bool
	// Stdin, when set, is copied to the command's standard input, whose end follows its own.
	Stdin io.Reader
	// Stdout and Stderr receive the command's (with TTY, Stdout receives both); nil discards.
	Stdout, Stderr io.Writer
	// Size is the terminal's size when the command starts (TTY); Resize delivers its changes.
	Size   *Size
	Resize <-chan Size
}

// ExitError is a command's non-zero exit.
type ExitError struct{ Code int }

func (e *ExitError) Error() string { return fmt.Sprintf("command exited with code %d", e.Code) }

// Exec runs a command in the guest: nil when it exits 0, *ExitError when it exits otherwise,
// another error when it could not run or the guest failed to say how it ended.
func (c *Client) Exec(ctx context.Context, o ExecOptions) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	q := url.Values{"cmd": o.Command}
	if o.TTY {
		q.Set("tty", "1")
		if o.Size != nil {
			q.Set("cols", strconv.Itoa(int(o.Size.Width)))
			q.Set("rows", strconv.Itoa(int(o.Size.Height)))
		}
	}
	body, bw := io.Pipe()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://guest"+ExecPath+"?"+q.Encode(), body)
	if err != nil {
		return err
	}
	req.Header.Set(TokenHeader, c.token)
	// The transport reads the request body until it ends: end it with ctx, or a response
	// read would wait on the transport's body read.
	context.AfterFunc(ctx, func() { bw.CloseWithError(ctx.Err()) })

	// The host's frames, one writer at a time.
	var mu sync.Mutex
	send := func(typ byte, p []byte) error {
		mu.Lock()
		defer mu.Unlock()
		return WriteFrame(bw, typ, p)
	}
	if o.Stdin != nil {
		go func() {
			buf := make([]byte, MaxFrame)
			for {
				n, err := o.Stdin.Read(buf)
				if n > 0 && send(Stdin, buf[:n]) != nil {
					return
				}
				if err != nil {
					break
				}
			}
			_ = send(StdinEOF, nil)
		}()
	}
	if o.Resize != nil {
		go func() {
			for {
				select {
				case <-ctx.Done():
					return
				case sz, ok := <-o.Resize:
					if !ok {
						return
					}
					if send(Resize, encodeSize(sz)) != nil {
						return
					}
				}
			}
		}()
	}
	defer bw.Close()

	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("asking the guest to run %q: %w", o.Command, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("the guest refused to run %q: %s", o.Command, statusText(resp))
	}
	stdout, stderr := o.Stdout, o.Stderr
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	fr := NewFrameReader(resp.Body)
	for {
		typ, p, err := fr.Read()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return errors.New("the guest ended the command's stream without its exit code")
			}
			return fmt.Errorf("reading the command's output from the guest: %w", err)
		}
		switch typ {
		case Stdout:
			if _, err := stdout.Write(p); err != nil {
				return fmt.Errorf("writing the command's output: %w", err)
			}
		case Stderr:
			if _, err := stderr.Write(p); err != nil {
				return fmt.Errorf("writing the command's error output: %w", err)
			}
		case Exit:
			if len(p) != 4 {
				return fmt.Errorf("the guest sent an exit frame of %d bytes", len(p))
			}
			if code := int(int32(binary.BigEndian.Uint32(p))); code != 0 {
				return &ExitError{Code: code}
			}
			return nil
		case Error:
			return fmt.Errorf("the guest could not run %q: %s", o.Command, quote(p))
		default:
			return fmt.Errorf("the guest sent a frame of unknown type %d", typ)
		}
	}
}

// PortForward connects conn to TCP port in the guest until either side ends.
func (c *Client) PortForward(ctx context.Context, port uint16, conn io.ReadWriter) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	body, bw := io.Pipe()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://guest"+PortForwardPath+"?port="+strconv.Itoa(int(port)), body)
	if err != nil {
		return err
	}
	req.Header.Set(TokenHeader, c.token)
	context.AfterFunc(ctx, func() { bw.CloseWithError(ctx.Err()) })
	go func() {
		_, err := io.Copy(bw, conn)
		bw.CloseWithError(err)
	}()
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("asking the guest for port %d: %w", port, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("the guest refused port %d: %s", port, statusText(resp))
	}
	if _, err := io.Copy(conn, resp.Body); err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("port %d of the guest: %w", port, err)
	}
	return nil
}

// statusText is a refusal's status and the first bytes of its body, made printable.
func statusText(resp *http.Response) string {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	return resp.Status + ": " + quote(b)
}

// quote is a guest's text made safe for a terminal and a log: Go-quoted, at most 512 bytes.
func quote(p []byte) string {
	if len(p) > 512 {
		p = p[:512]
	}
	return strconv.QuoteToGraphic(string(p))
}

// FileConn makes a connection of a file descriptor (a virtio-serial port, a vsock
// connection) that HTTP/2 can run over.
func FileConn(f *os.File) net.Conn { return fileConn{f} }

type fileConn struct{ *os.File }

func (fileConn) LocalAddr() net.Addr  { return addr{} }
func (fileConn) RemoteAddr() net.Addr { return addr{} }
