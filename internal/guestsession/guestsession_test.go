package guestsession_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/guestsession"
)

// pair connects a client to a guest served by h over a socket pair, as the agent and imp-init
// are over a virtio-serial port.
func pair(t *testing.T, token string, serve func(net.Conn)) *guestsession.Client {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	host, err := net.FileConn(os.NewFile(uintptr(fds[0]), "host"))
	if err != nil {
		t.Fatal(err)
	}
	guest, err := net.FileConn(os.NewFile(uintptr(fds[1]), "guest"))
	if err != nil {
		t.Fatal(err)
	}
	go serve(guest)
	dialed := false
	c := guestsession.NewClient(token, func(context.Context) (net.Conn, error) {
		if dialed {
			return nil, errors.New("dialed twice")
		}
		dialed = true
		return host, nil
	})
	t.Cleanup(func() { c.Close(); host.Close(); guest.Close() })
	return c
}

func server() *guestsession.Server {
	return &guestsession.Server{Token: "s3cret", Command: func(argv []string) (*exec.Cmd, error) {
		if argv[0] == "no-such-command" {
			return nil, errors.New("no-such-command: not found in the image's PATH")
		}
		return exec.Command(argv[0], argv[1:]...), nil
	}}
}

func TestExec(t *testing.T) {
	s := server()
	c := pair(t, "s3cret", func(g net.Conn) { _ = s.Serve(g) })
	for _, tc := range []struct {
		name           string
		cmd            []string
		stdin          string
		tty            bool
		stdout, stderr string
		code           int
		err            string
	}{
		{name: "output and code", cmd: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}, stdout: "out\n", stderr: "err\n", code: 3},
		{name: "success", cmd: []string{"true"}},
		{name: "stdin to its end", cmd: []string{"sh", "-c", "tr a-z A-Z; echo done"}, stdin: "hello\nworld\n", stdout: "HELLO\nWORLD\ndone\n"},
		{name: "killed", cmd: []string{"sh", "-c", "kill -9 $$"}, code: 137},
		{name: "a terminal", cmd: []string{"sh", "-c", "test -t 0 && test -t 1 && echo tty"}, tty: true, stdout: "tty\r\n"},
		{name: "not found", cmd: []string{"no-such-command"}, err: "not found in the image's PATH"},
		{name: "big output", cmd: []string{"sh", "-c", "head -c 3000000 /dev/zero"}, stdout: strings.Repeat("\x00", 3000000)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			var out, errOut bytes.Buffer
			o := guestsession.ExecOptions{Command: tc.cmd, TTY: tc.tty, Stdout: &out, Stderr: &errOut}
			if tc.stdin != "" {
				o.Stdin = strings.NewReader(tc.stdin)
			}
			err := c.Exec(ctx, o)
			var exit *guestsession.ExitError
			switch {
			case tc.err != "":
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("error %v, want one saying %q", err, tc.err)
				}
			case tc.code != 0:
				if !errors.As(err, &exit) || exit.Code != tc.code {
					t.Fatalf("error %v, want exit code %d", err, tc.code)
				}
			case err != nil:
				t.Fatal(err)
			}
			if out.String() != tc.stdout || errOut.String() != tc.stderr {
				t.Errorf("stdout %.80q stderr %q, want %.80q and %q", out.String(), errOut.String(), tc.stdout, tc.stderr)
			}
		})
	}
}

// A terminal's size reaches the command.
func TestExecResize(t *testing.T) {
	s := server()
	c := pair(t, "s3cret", func(g net.Conn) { _ = s.Serve(g) })
	resize := make(chan guestsession.Size, 1)
	resize <- guestsession.Size{Width: 123, Height: 45}
	pr, pw := io.Pipe()
	var out bytes.Buffer
	go func() {
		time.Sleep(500 * time.Millisecond) // after the resize
		_, _ = pw.Write([]byte("stty size\nexit 0\n"))
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := c.Exec(ctx, guestsession.ExecOptions{Command: []string{"sh"}, TTY: true, Stdin: pr, Stdout: &out, Resize: resize}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "45 123") {
		t.Errorf("the terminal said %q, want its size 45 123", out.String())
	}
}

// A command that asks for its terminal's size as it starts gets the size it started with.
func TestExecInitialSize(t *testing.T) {
	s := server()
	c := pair(t, "s3cret", func(g net.Conn) { _ = s.Serve(g) })
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := c.Exec(ctx, guestsession.ExecOptions{Command: []string{"stty", "size"}, TTY: true, Stdout: &out, Size: &guestsession.Size{Width: 100, Height: 40}}); err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(out.String()) != "40 100" {
		t.Errorf("the terminal said %q, want its size 40 100", out.String())
	}
}

// Many commands at once share the connection.
func TestExecConcurrent(t *testing.T) {
	s := server()
	c := pair(t, "s3cret", func(g net.Conn) { _ = s.Serve(g) })
	errs := make(chan error, 20)
	for i := range 20 {
		go func() {
			var out bytes.Buffer
			err := c.Exec(context.Background(), guestsession.ExecOptions{Command: []string{"echo", strconv.Itoa(i)}, Stdout: &out})
			if err == nil && out.String() != strconv.Itoa(i)+"\n" {
				err = errors.New("command " + strconv.Itoa(i) + " printed " + out.String())
			}
			errs <- err
		}()
	}
	for range 20 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// The guest runs nothing for a caller without the VM's token.
func TestWrongToken(t *testing.T) {
	s := server()
	var ran atomic.Bool
	s.Command = func(argv []string) (*exec.Cmd, error) { ran.Store(true); return exec.Command("true"), nil }
	c := pair(t, "guess", func(g net.Conn) { _ = s.Serve(g) })
	err := c.Exec(context.Background(), guestsession.ExecOptions{Command: []string{"true"}})
	if err == nil || !strings.Contains(err.Error(), "401") || ran.Load() {
		t.Fatalf("exec with the wrong token: %v (ran: %v), want 401 and nothing run", err, ran.Load())
	}
	s.Token = ""
	c = pair(t, "", func(g net.Conn) { _ = s.Serve(g) })
	if err := c.Exec(context.Background(), guestsession.ExecOptions{Command: []string{"true"}}); err == nil || ran.Load() {
		t.Fatalf("exec on a guest without a token: %v (ran: %v), want a refusal", err, ran.Load())
	}
}

func TestPortForward(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	s := server()
	c := pair(t, "s3cret", func(g net.Conn) { _ = s.Serve(g) })
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	local, remote := net.Pipe()
	done := make(chan error, 1)
	go func() { done <- c.PortForward(context.Background(), port, remote) }()
	msg := bytes.Repeat([]byte("0123456789"), 100000)
	go func() { _, _ = local.Write(msg) }()
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(local, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echoed %d bytes through the guest: %v", len(got), err)
	}
	local.Close()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the forward did not end with its connection")
	}

	// A port nothing listens on is refused with the guest's reason.
	l2, _ := net.Listen("tcp", "127.0.0.1:0")
	closed := uint16(l2.Addr().(*net.TCPAddr).Port)
	l2.Close()
	a, _ := net.Pipe()
	if err := c.PortForward(context.Background(), closed, a); err == nil || !strings.Contains(err.Error(), "502") {
		t.Fatalf("forwarding to a closed port: %v, want 502", err)
	}
}

// hostile serves HTTP/2 as a guest would that took imp-init's end of the channel.
func hostile(h http.HandlerFunc) func(net.Conn) {
	return func(g net.Conn) {
		var p http.Protocols
		p.SetUnencryptedHTTP2(true)
		srv := &http.Server{Handler: h, Protocols: &p}
		l := &single{c: g, done: make(chan struct{})}
		_ = srv.Serve(l)
	}
}

type single struct {
	c    net.Conn
	done chan struct{}
	n    atomic.Int32
}

func (l *single) Accept() (net.Conn, error) {
	if l.n.Add(1) == 1 {
		return l.c, nil
	}
	<-l.done
	return nil, net.ErrClosed
}
func (l *single) Close() error   { return nil }
func (l *single) Addr() net.Addr { return &net.UnixAddr{} }

// What a guest sends cannot make the agent's end allocate without bound, wait forever, or
// print what the guest wants on a terminal.
func TestHostileGuest(t *testing.T) {
	frame := func(typ byte, n uint32) []byte {
		return []byte{typ, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
	}
	t.Run("a frame longer than the maximum", func(t *testing.T) {
		c := pair(t, "s3cret", hostile(func(w http.ResponseWriter, r *http.Request) {
			_, _ = w.Write(frame(guestsession.Stdout, 1<<31))
			_, _ = w.Write(make([]byte, 1<<20))
		}))
		err := c.Exec(context.Background(), guestsession.ExecOptions{Command: []string{"x"}})
		if err == nil || !strings.Contains(err.Error(), "longer than the maximum") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("an unknown frame", func(t *testing.T) {
		c := pair(t, "s3cret", hostile(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(frame(99, 0)) }))
		if err := c.Exec(context.Background(), guestsession.ExecOptions{Command: []string{"x"}}); err == nil || !strings.Contains(err.Error(), "unknown type") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("no exit code", func(t *testing.T) {
		c := pair(t, "s3cret", hostile(func(w http.ResponseWriter, r *http.Request) {}))
		if err := c.Exec(context.Background(), guestsession.ExecOptions{Command: []string{"x"}}); err == nil || !strings.Contains(err.Error(), "without its exit code") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("an error with escapes", func(t *testing.T) {
		c := pair(t, "s3cret", hostile(func(w http.ResponseWriter, r *http.Request) {
			msg := "\x1b]0;owned\x07\x1b[2Jgone\r\nfake prompt$ "
			_, _ = w.Write(append(frame(guestsession.Error, uint32(len(msg))), msg...))
		}))
		err := c.Exec(context.Background(), guestsession.ExecOptions{Command: []string{"x"}})
		if err == nil || strings.ContainsAny(err.Error(), "\x1b\x07\r\n") {
			t.Fatalf("got %q", err)
		}
	})
	t.Run("huge headers", func(t *testing.T) {
		c := pair(t, "s3cret", hostile(func(w http.ResponseWriter, r *http.Request) {
			for i := range 100 {
				w.Header().Set("X-Junk-"+strconv.Itoa(i), strings.Repeat("j", 4000))
			}
			w.WriteHeader(http.StatusOK)
		}))
		if err := c.Exec(context.Background(), guestsession.ExecOptions{Command: []string{"x"}}); err == nil {
			t.Fatal("400 kB of response headers were accepted")
		}
	})
	t.Run("silence", func(t *testing.T) {
		c := pair(t, "s3cret", hostile(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
			http.NewResponseController(w).Flush()
			<-r.Context().Done()
		}))
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		start := time.Now()
		if err := c.Exec(ctx, guestsession.ExecOptions{Command: []string{"x"}}); err == nil {
			t.Fatal("a silent guest's exec succeeded")
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("a silent guest held the exec %v after its context ended", d)
		}
	})
	// A guest that floods output the agent's caller does not read gets to write about one
	// flow-control window and then waits: the agent buffers no more than that.
	t.Run("a flood nobody reads", func(t *testing.T) {
		var written atomic.Int64
		c := pair(t, "s3cret", hostile(func(w http.ResponseWriter, r *http.Request) {
			chunk := append(frame(guestsession.Stdout, guestsession.MaxFrame), make([]byte, guestsession.MaxFrame)...)
			for r.Context().Err() == nil {
				if _, err := w.Write(chunk); err != nil {
					return
				}
				written.Add(int64(len(chunk)))
			}
		}))
		stuck := make(chan struct{})
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			_ = c.Exec(ctx, guestsession.ExecOptions{Command: []string{"x"}, Stdout: writerFunc(func(p []byte) (int, error) { <-stuck; return len(p), nil })})
		}()
		time.Sleep(2 * time.Second)
		n := written.Load()
		close(stuck)
		cancel()
		// 256 KiB of stream window, a frame in the caller's hands, the socket's buffers and
		// the server's own write buffer.
		if n > 2<<20 {
			t.Fatalf("the guest wrote %d bytes that nobody read; the agent must hold no more than its window", n)
		}
		t.Logf("the guest got %d bytes out before waiting", n)
	})
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// TestKeys: an OS's guest side is given its users' keys and says who it lacks; a workload's
// guest (no Keys) refuses them, and so does any guest asked without the token.
func TestKeys(t *testing.T) {
	ctx := context.Background()
	s := server()
	if _, err := pair(t, "s3cret", func(g net.Conn) { _ = s.Serve(g) }).Keys(ctx, guestsession.AuthorizedKeys{"alice": {"k"}}); err == nil ||
		!strings.Contains(err.Error(), "404") || !strings.Contains(err.Error(), "does not boot an OS") {
		t.Fatalf("keys to a workload's guest: %v, want a 404 refusal", err)
	}
	var got guestsession.AuthorizedKeys
	s.Keys = func(k guestsession.AuthorizedKeys) ([]string, error) { got = k; return []string{"carol"}, nil }
	if _, err := pair(t, "guess", func(g net.Conn) { _ = s.Serve(g) }).Keys(ctx, guestsession.AuthorizedKeys{"alice": {"k"}}); err == nil ||
		!strings.Contains(err.Error(), "401") || got != nil {
		t.Fatalf("keys with the wrong token: %v (given %v), want 401 and nothing given", err, got)
	}
	pending, err := pair(t, "s3cret", func(g net.Conn) { _ = s.Serve(g) }).Keys(ctx, guestsession.AuthorizedKeys{"alice": {"k"}, "carol": {"c"}})
	if err != nil || len(pending) != 1 || pending[0] != "carol" || len(got["alice"]) != 1 {
		t.Fatalf("keys to an OS: pending %v, %v, given %v", pending, err, got)
	}
}
