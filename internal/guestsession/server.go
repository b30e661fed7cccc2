package guestsession

import (
	"context"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/creack/pty"
)

// Server is imp-init's end: it answers the agent's requests on the session channel.
type Server struct {
	// Token is the VM's; requests without it are refused.
	Token string
	// TokenNow, when set, is the token as it stands instead of Token: a VM restored from a
	// snapshot is given its own after the server started.
	TokenNow func() string
	// Command prepares argv to run as the workload does (its user, environment and working
	// directory); the server sets its standard streams and session.
	Command func(argv []string) (*exec.Cmd, error)
	// Start starts cmd and returns a function that waits for its exit code. imp-init, which
	// reaps every process itself, supplies its own; the default is cmd.Start and cmd.Wait.
	Start func(cmd *exec.Cmd) (wait func() int, err error)
	// Dial connects to a TCP port of the guest (default: 127.0.0.1).
	Dial func(ctx context.Context, port int) (net.Conn, error)
	// Keys writes the OS's users' SSH keys and returns the users it does not have yet (an
	// OS's guest side; nil elsewhere: KeysPath is refused).
	Keys func(AuthorizedKeys) (pending []string, err error)
}

// http2Server serves h on prior-knowledge HTTP/2 only, with small flow-control windows: the
// agent's end reads what it can, and a stalled peer holds at most a window per stream.
func http2Server(h http.Handler) *http.Server {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Server{
		Handler:   h,
		Protocols: &p,
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams:          32,
			MaxReceiveBufferPerConnection: 1 << 20,
			MaxReceiveBufferPerStream:     256 << 10,
			SendPingTimeout:               30 * time.Second,
			PingTimeout:                   15 * time.Second,
		},
		MaxHeaderBytes:    64 << 10,
		ReadHeaderTimeout: 10 * time.Second,
	}
}

// Serve answers requests on one connection until it ends.
func (s *Server) Serve(c net.Conn) error {
	l := &oneConn{c: c, closed: make(chan struct{})}
	err := http2Server(s).Serve(l)
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// ServeHTTP checks the token and dispatches.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	token := s.Token
	if s.TokenNow != nil {
		token = s.TokenNow()
	}
	if token == "" || subtle.ConstantTimeCompare([]byte(r.Header.Get(TokenHeader)), []byte(token)) != 1 {
		http.Error(w, "wrong token", http.StatusUnauthorized)
		return
	}
	if r.Method != http.MethodPost {
		http.Error(w, "POST only", http.StatusMethodNotAllowed)
		return
	}
	switch r.URL.Path {
	case ExecPath:
		s.exec(w, r)
	case PortForwardPath:
		s.portForward(w, r)
	case KeysPath:
		s.keys(w, r)
	default:
		http.NotFound(w, r)
	}
}

// frameWriter writes frames to a response, one at a time, flushing each.
type frameWriter struct {
	mu sync.Mutex
	w  io.Writer
	rc *http.ResponseController
}

func (f *frameWriter) write(typ byte, p []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := WriteFrame(f.w, typ, p); err != nil {
		return err
	}
	return f.rc.Flush()
}

// pump sends what r yields as frames of typ until r ends.
func (f *frameWriter) pump(typ byte, r io.Reader) {
	buf := make([]byte, MaxFrame)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if f.write(typ, buf[:n]) != nil {
				// The host is gone: keep draining, so the command never blocks on a full pipe.
				_, _ = io.Copy(io.Discard, r)
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// output is one of a command's output streams, as a frame type.
type output struct {
	typ byte
	r   *os.File
}

// stdio is a command's standard streams as plain descriptors (a pty, or pipes), so that
// starting it needs no goroutine of os/exec's and Start's caller may reap it however it
// reaps: the ends the server keeps, and the command's, closed once it started.
type stdio struct {
	stdin   *os.File
	outputs []output
	child   []*os.File
	pty     *os.File // the terminal's master, with tty
}

func newStdio(tty bool) (*stdio, error) {
	if tty {
		ptmx, tt, err := pty.Open()
		if err != nil {
			return nil, err
		}
		return &stdio{stdin: ptmx, outputs: []output{{Stdout, ptmx}}, child: []*os.File{tt, tt, tt}, pty: ptmx}, nil
	}
	sio := &stdio{}
	for i := range 3 {
		r, w, err := os.Pipe()
		if err != nil {
			sio.close()
			return nil, err
		}
		if i == 0 {
			sio.stdin, sio.child = w, append(sio.child, r)
		} else {
			sio.outputs, sio.child = append(sio.outputs, output{[]byte{Stdout, Stderr}[i-1], r}), append(sio.child, w)
		}
	}
	return sio, nil
}

// closeChild closes the command's ends, once it has them.
func (s *stdio) closeChild() {
	for _, f := range s.child {
		f.Close() // a pty's one slave thrice: the later ones fail harmlessly
	}
}

func (s *stdio) close() {
	s.closeChild()
	if s.stdin != nil {
		s.stdin.Close()
	}
	for _, o := range s.outputs {
		o.r.Close()
	}
}

func (s *Server) exec(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	argv := q["cmd"]
	tty := q.Get("tty") == "1"
	if len(argv) == 0 {
		http.Error(w, "no command", http.StatusBadRequest)
		return
	}
	w.WriteHeader(http.StatusOK)
	fw := &frameWriter{w: w, rc: http.NewResponseController(w)}
	cmd, err := s.Command(argv)
	if err != nil {
		_ = fw.write(Error, []byte(err.Error()))
		return
	}
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setsid = true
	sio, err := newStdio(tty)
	if err != nil {
		_ = fw.write(Error, []byte(fmt.Sprintf("preparing the command's streams: %v", err)))
		return
	}
	defer sio.close()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = sio.child[0], sio.child[1], sio.child[2]
	if tty {
		cmd.SysProcAttr.Setctty, cmd.SysProcAttr.Ctty = true, 0
		// Its size before it starts: a command that asks at once gets it.
		cols, cerr := strconv.ParseUint(q.Get("cols"), 10, 16)
		rows, rerr := strconv.ParseUint(q.Get("rows"), 10, 16)
		if cerr == nil && rerr == nil {
			_ = pty.Setsize(sio.pty, &pty.Winsize{Cols: uint16(cols), Rows: uint16(rows)})
		}
	}
	start := s.Start
	if start == nil {
		start = startAndWait
	}
	wait, err := start(cmd)
	sio.closeChild()
	if err != nil {
		_ = fw.write(Error, []byte(err.Error()))
		return
	}

	// The host going (its request ends, or its frames break off) kills the command's session,
	// while the command runs: never after, when its pid may be another process's.
	var mu sync.Mutex
	ended := false
	kill := func() {
		mu.Lock()
		defer mu.Unlock()
		if !ended {
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		}
	}
	stop := context.AfterFunc(r.Context(), kill)
	defer stop()

	// The host's frames: stdin, its end, terminal sizes.
	go func() {
		fr := NewFrameReader(r.Body)
		for {
			typ, p, err := fr.Read()
			if err != nil {
				if !errors.Is(err, io.EOF) {
					kill()
				}
				return
			}
			switch typ {
			case Stdin:
				_, _ = sio.stdin.Write(p)
			case StdinEOF:
				if tty {
					_, _ = sio.stdin.Write([]byte{4}) // ^D, as a terminal's user would type it
				} else {
					sio.stdin.Close()
				}
			case Resize:
				if sz, ok := decodeSize(p); ok && tty {
					_ = pty.Setsize(sio.pty, &pty.Winsize{Cols: sz.Width, Rows: sz.Height})
				}
			}
		}
	}()

	var pumps sync.WaitGroup
	for _, o := range sio.outputs {
		pumps.Add(1)
		go func() {
			defer pumps.Done()
			fw.pump(o.typ, o.r)
		}()
	}
	code := wait()
	mu.Lock()
	ended = true
	mu.Unlock()
	if tty {
		// A pty's master reads EIO once the last holder of its slave is gone, which a
		// background process of the command may never be: give the output a moment, then end.
		done := make(chan struct{})
		go func() { pumps.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(500 * time.Millisecond):
			sio.pty.Close()
		}
	}
	pumps.Wait()
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], uint32(int32(code)))
	_ = fw.write(Exit, b[:])
}

// startAndWait is Server.Start's default.
func startAndWait(cmd *exec.Cmd) (func() int, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return func() int {
		_ = cmd.Wait()
		return ExitCode(cmd.ProcessState.Sys().(syscall.WaitStatus))
	}, nil
}

// ExitCode is a shell's view of a process's end: its code, or 128 plus the signal that
// killed it.
func ExitCode(ws syscall.WaitStatus) int {
	if ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ws.ExitStatus()
}

func (s *Server) portForward(w http.ResponseWriter, r *http.Request) {
	port, err := strconv.Atoi(r.URL.Query().Get("port"))
	if err != nil || port < 1 || port > 65535 {
		http.Error(w, "port: want 1 to 65535", http.StatusBadRequest)
		return
	}
	dial := s.Dial
	if dial == nil {
		dial = func(ctx context.Context, port int) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	conn, err := dial(ctx, port)
	cancel()
	if err != nil {
		http.Error(w, fmt.Sprintf("connecting to port %d in the guest: %v", port, err), http.StatusBadGateway)
		return
	}
	defer conn.Close()
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	go func() {
		_, _ = io.Copy(conn, r.Body)
		if c, ok := conn.(interface{ CloseWrite() error }); ok {
			_ = c.CloseWrite()
		}
	}()
	buf := make([]byte, MaxFrame)
	for {
		n, err := conn.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return
			}
			if rc.Flush() != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// oneConn is a listener of one connection: Accept returns it once, then waits for it to be
// closed and reports the listener closed, which ends Serve.
type oneConn struct {
	mu     sync.Mutex
	c      net.Conn
	closed chan struct{}
}

func (l *oneConn) Accept() (net.Conn, error) {
	l.mu.Lock()
	c := l.c
	l.c = nil
	l.mu.Unlock()
	if c != nil {
		return &notifyClose{Conn: c, closed: l.closed}, nil
	}
	<-l.closed
	return nil, net.ErrClosed
}

func (l *oneConn) Close() error { return nil }

func (l *oneConn) Addr() net.Addr { return addr{} }

type notifyClose struct {
	net.Conn
	once   sync.Once
	closed chan struct{}
}

func (c *notifyClose) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { close(c.closed) })
	return err
}

type addr struct{}

func (addr) Network() string { return "guest" }
func (addr) String() string  { return "guest" }
