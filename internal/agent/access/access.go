// Package access is the node agent's endpoint for the API's VM subresources: exec, port-forward,
// the serial console and its log, of the VMs of its node. The Kubernetes API server authenticates and
// authorizes each user and audits each request; IMP's subresource server then reaches this
// endpoint over mutually authenticated TLS, and this endpoint serves that client and no other.
// Streams speak what kubectl speaks (SPDY and WebSocket remotecommand and portforward, served
// by the CRI streaming library the kubelet's runtimes use).
package access

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/cri-streaming/pkg/streaming/portforward"
	"k8s.io/cri-streaming/pkg/streaming/remotecommand"
	"k8s.io/streaming/pkg/httpstream/wsstream"
	utilexec "k8s.io/utils/exec"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestsession"
)

// VMs are the agent's VMs as this endpoint reaches them.
type VMs interface {
	// Session is the session channel of the running VM key with uid.
	Session(key types.NamespacedName, uid types.UID) (*guestsession.Client, error)
	// ConsoleLog opens the console log of the VM key with uid, running or finished.
	ConsoleLog(key types.NamespacedName, uid types.UID) (*os.File, error)
	// ConsoleInput attaches to the serial console's input of the running VM key with uid;
	// ended is closed when its run ends. Closing the input detaches.
	ConsoleInput(key types.NamespacedName, uid types.UID) (in io.WriteCloser, ended <-chan struct{}, err error)
}

// Figurer is what VMs may also be: the figures of the VM key with uid, running on the node
// (package vmstats). Without it, GET .../stats is not served.
type Figurer interface {
	Figures(key types.NamespacedName, uid types.UID) (impv1.VMFigures, error)
}

// UserHeader names the API user a request is for, as the subresource server saw it
// authenticated; it is logged, never trusted for a decision.
const UserHeader = "Imp-User"

// Stream timeouts: a stream idle this long ends; a client must open its streams this soon.
const (
	IdleTimeout           = 30 * time.Minute
	StreamCreationTimeout = 30 * time.Second
)

// Handler serves the endpoint's requests for vms; log records each.
func Handler(vms VMs, log logr.Logger) http.Handler {
	mux := http.NewServeMux()
	const vm = "/vms/{namespace}/{name}/{uid}/"
	h := handler{vms: vms, log: log}
	mux.HandleFunc(vm+"exec", h.exec)
	mux.HandleFunc(vm+"portforward", h.portForward)
	mux.HandleFunc("GET "+vm+"log", h.consoleLog)
	mux.HandleFunc(vm+"console", h.console)
	mux.HandleFunc("GET "+vm+"stats", h.stats)
	return mux
}

// stats serves the VM's figures as JSON.
func (h handler) stats(w http.ResponseWriter, r *http.Request) {
	key, uid, _, ok := h.target(w, r, "stats")
	if !ok {
		return
	}
	f, ok := h.vms.(Figurer)
	if !ok {
		http.Error(w, "this agent serves no figures", http.StatusNotFound)
		return
	}
	fig, err := f.Figures(key, uid)
	if err != nil {
		http.Error(w, err.Error(), http.StatusNotFound)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(fig)
}

type handler struct {
	vms VMs
	log logr.Logger
}

// target is the request's VM, and a logger that names it and the user; ok is false, and a
// refusal written, when the UID is not one: it names a directory of the node.
func (h handler) target(w http.ResponseWriter, r *http.Request, op string) (types.NamespacedName, types.UID, logr.Logger, bool) {
	key := types.NamespacedName{Namespace: r.PathValue("namespace"), Name: r.PathValue("name")}
	uid := types.UID(r.PathValue("uid"))
	log := h.log.WithValues("vm", key, "op", op, "user", r.Header.Get(UserHeader))
	if !uidPattern.MatchString(string(uid)) {
		http.Error(w, "not a UID", http.StatusBadRequest)
		return key, uid, log, false
	}
	log.Info("access")
	return key, uid, log, true
}

// uidPattern is what an object's UID looks like (a UUID), and no path of the node can.
var uidPattern = regexp.MustCompile(`^[0-9A-Za-z-]{1,64}$`)

// session is the VM's session channel, or an error written to w.
func (h handler) session(w http.ResponseWriter, key types.NamespacedName, uid types.UID) *guestsession.Client {
	s, err := h.vms.Session(key, uid)
	if err != nil {
		http.Error(w, err.Error(), http.StatusNotFound)
		return nil
	}
	return s
}

// podExecParams are the names the API uses for exec's and attach's streams (PodExecOptions,
// PodAttachOptions); the CRI streaming library reads its own.
var podExecParams = map[string]string{"stdin": remotecommand.ExecStdinParam, "stdout": remotecommand.ExecStdoutParam,
	"stderr": remotecommand.ExecStderrParam, "tty": remotecommand.ExecTTYParam}

// streamOptions are the streams r asks for, in the API's names or the CRI's.
func streamOptions(r *http.Request) (*remotecommand.Options, error) {
	q := r.URL.Query()
	for api, cri := range podExecParams {
		if v := q.Get(api); v == "true" || v == "1" {
			q.Set(cri, "1")
		}
	}
	r.URL.RawQuery = q.Encode()
	r.Form = nil
	return remotecommand.NewOptions(r)
}

func (h handler) exec(w http.ResponseWriter, r *http.Request) {
	key, uid, log, ok := h.target(w, r, "exec")
	if !ok {
		return
	}
	s := h.session(w, key, uid)
	if s == nil {
		return
	}
	cmd := r.URL.Query()["command"]
	if len(cmd) == 0 {
		http.Error(w, "no command", http.StatusBadRequest)
		return
	}
	opts, err := streamOptions(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	e := executor{s: s, log: log}
	if wsstream.IsWebSocketRequest(r) {
		serveWebSocket(w, r, log, opts, func(ctx context.Context, in io.Reader, out, errOut io.WriteCloser, resize <-chan remotecommand.TerminalSize) error {
			return e.ExecInContainer(ctx, "", "", "", cmd, in, out, errOut, opts.TTY, resize, 0)
		})
		return
	}
	remotecommand.ServeExec(w, r, e, key.Name, string(uid), "", cmd, opts,
		IdleTimeout, StreamCreationTimeout, remotecommand.SupportedStreamingProtocols)
}

// initialSizeWait bounds the wait for a terminal's first size before its command starts.
const initialSizeWait = time.Second

// executor runs commands in a VM through its session channel.
type executor struct {
	s   *guestsession.Client
	log logr.Logger
}

func (e executor) ExecInContainer(ctx context.Context, _, _, _ string, cmd []string, in io.Reader, out, errOut io.WriteCloser,
	tty bool, resize <-chan remotecommand.TerminalSize, _ time.Duration) error {
	o := guestsession.ExecOptions{Command: cmd, TTY: tty, Stdin: in, Stdout: out, Stderr: errOut}
	if tty && resize != nil {
		// kubectl sends the terminal's size as the stream opens: the command starts with it.
		select {
		case sz, ok := <-resize:
			if ok {
				o.Size = &guestsession.Size{Width: sz.Width, Height: sz.Height}
			}
		case <-time.After(initialSizeWait):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if resize != nil {
		sizes := make(chan guestsession.Size, 1)
		go func() {
			defer close(sizes)
			for sz := range resize {
				select {
				case sizes <- guestsession.Size{Width: sz.Width, Height: sz.Height}:
				case <-ctx.Done():
					return
				}
			}
		}()
		o.Resize = sizes
	}
	err := e.s.Exec(ctx, o)
	var exit *guestsession.ExitError
	if errors.As(err, &exit) {
		return utilexec.CodeExitError{Err: err, Code: exit.Code}
	}
	if err != nil {
		e.log.Info("exec failed", "error", err.Error())
	}
	return err
}

func (h handler) portForward(w http.ResponseWriter, r *http.Request) {
	key, uid, log, ok := h.target(w, r, "portforward")
	if !ok {
		return
	}
	s := h.session(w, key, uid)
	if s == nil {
		return
	}
	opts, err := portforward.NewV4Options(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	portforward.ServePortForward(w, r, forwarder{s: s, log: log}, key.Name, string(uid), opts,
		IdleTimeout, StreamCreationTimeout, portforward.SupportedProtocols)
}

// forwarder reaches a VM's ports through its session channel.
type forwarder struct {
	s   *guestsession.Client
	log logr.Logger
}

func (f forwarder) PortForward(ctx context.Context, _, _ string, port int32, stream io.ReadWriteCloser) error {
	defer stream.Close()
	if port < 1 || port > 65535 {
		return fmt.Errorf("port %d: want 1 to 65535", port)
	}
	err := f.s.PortForward(ctx, uint16(port), stream)
	if err != nil {
		f.log.Info("port-forward failed", "port", port, "error", err.Error())
	}
	return err
}

// consoleLog streams the console's log: all of it, or its last limitBytes; with follow, what
// the guest writes next, until the client goes.
func (h handler) consoleLog(w http.ResponseWriter, r *http.Request) {
	key, uid, _, ok := h.target(w, r, "log")
	if !ok {
		return
	}
	f, ok := h.openLog(w, r, key, uid, -1)
	if !ok {
		return
	}
	defer f.Close()
	q := r.URL.Query()
	follow := q.Get("follow") == "true" || q.Get("follow") == "1"
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	rc := http.NewResponseController(w)
	_ = copyLog(r.Context(), f, w, follow, func() { _ = rc.Flush() })
}

// openLog opens the VM's console log at its last limitBytes (the request's, else def; all of
// it when negative), or writes why not.
func (h handler) openLog(w http.ResponseWriter, r *http.Request, key types.NamespacedName, uid types.UID, def int64) (*os.File, bool) {
	n := def
	if s := r.URL.Query().Get("limitBytes"); s != "" {
		var err error
		if n, err = strconv.ParseInt(s, 10, 64); err != nil || n < 0 {
			http.Error(w, "limitBytes: want a number of bytes", http.StatusBadRequest)
			return nil, false
		}
	}
	f, err := h.vms.ConsoleLog(key, uid)
	if err != nil {
		http.Error(w, err.Error(), http.StatusNotFound)
		return nil, false
	}
	if fi, err := f.Stat(); err == nil && n >= 0 && fi.Size() > n {
		_, _ = f.Seek(-n, io.SeekEnd)
	}
	return f, true
}

// copyLog copies the log f to w; with follow, what the guest writes next too, until ctx
// ends. flush, between reads that found nothing new, sends what w holds.
func copyLog(ctx context.Context, f *os.File, w io.Writer, follow bool, flush func()) error {
	buf := make([]byte, 32<<10)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		n, err := f.Read(buf)
		if n > 0 {
			if _, err := w.Write(buf[:n]); err != nil {
				return err
			}
			continue
		}
		if err != nil && !errors.Is(err, io.EOF) {
			return err
		}
		if !follow {
			return nil
		}
		flush()
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		// The agent caps the log by cutting it: start again from its new beginning.
		if off, err := f.Seek(0, io.SeekCurrent); err == nil {
			if fi, err := f.Stat(); err == nil && fi.Size() < off {
				_, _ = f.Seek(0, io.SeekStart)
			}
		}
	}
}

// consoleTail is how much of the console's log an attachment shows first, unless the request
// says (limitBytes): enough for a boot's messages.
const consoleTail = 16 << 10

// console attaches to the VM's serial console, as kubectl attach does to a container: stdin
// (if asked for) reaches the console's input, and stdout gets the end of the console's log
// (consoleTail), then what the guest writes, until stdin ends, the client goes or the run
// ends. The output is the log's, so every attachment sees all of it, whoever types.
func (h handler) console(w http.ResponseWriter, r *http.Request) {
	key, uid, log, ok := h.target(w, r, "console")
	if !ok {
		return
	}
	in, ended, err := h.vms.ConsoleInput(key, uid)
	if err != nil {
		http.Error(w, err.Error(), http.StatusNotFound)
		return
	}
	defer in.Close()
	f, ok := h.openLog(w, r, key, uid, consoleTail)
	if !ok {
		return
	}
	defer f.Close()
	opts, err := streamOptions(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	a := attacher{in: in, log: f, ended: ended, logger: log}
	if wsstream.IsWebSocketRequest(r) {
		serveWebSocket(w, r, log, opts, a.run)
		return
	}
	remotecommand.ServeAttach(w, r, a, key.Name, string(uid), "", opts, IdleTimeout, StreamCreationTimeout,
		remotecommand.SupportedStreamingProtocols)
}

// attacher is one attachment to a VM's serial console.
type attacher struct {
	in     io.Writer
	log    *os.File
	ended  <-chan struct{}
	logger logr.Logger
}

func (a attacher) AttachContainer(ctx context.Context, _, _, _ string, in io.Reader, out, errOut io.WriteCloser, _ bool, resize <-chan remotecommand.TerminalSize) error {
	return a.run(ctx, in, out, errOut, resize)
}

// run copies stdin to the console and the console's log to stdout until stdin ends, ctx ends
// or the run ends. A serial console has no size: resizes are read and dropped.
func (a attacher) run(ctx context.Context, stdin io.Reader, out, _ io.WriteCloser, resize <-chan remotecommand.TerminalSize) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if resize != nil {
		go func() {
			for range resize {
			}
		}()
	}
	if stdin != nil {
		go func() {
			defer cancel()
			if _, err := io.Copy(a.in, stdin); err != nil {
				a.logger.Info("console input ended", "error", err.Error())
			}
		}()
	}
	go func() {
		select {
		case <-a.ended:
			cancel()
		case <-ctx.Done():
		}
	}()
	if out == nil {
		<-ctx.Done()
		return nil
	}
	err := copyLog(ctx, a.log, out, true, func() {})
	select {
	case <-a.ended:
		_ = copyLog(ctx, a.log, out, false, func() {}) // the last words
		_, _ = io.WriteString(out, "\r\n[imp: the VM's run ended]\r\n")
	default:
	}
	return err
}

// Server serves Handler over TLS on Addr for as long as its context lives (a manager's
// Runnable), with the certificate CSR obtains for its node (and renews), or else the files of
// CertDir (tls.crt, tls.key, and the client CA ca.crt, read again when they change). It waits
// for its certificate, which the operator may sign after the agent started.
type Server struct {
	Addr, CertDir, ClientName string
	CSR                       *CSR
	Handler                   http.Handler
	Log                       logr.Logger

	serving atomic.Value // the source of what it serves, once it has a certificate
}

// Identity is the node's certificate the endpoint serves and the CA its certificate chains to:
// the agent's identity towards other nodes' agents (a migration's transfer). An error until the
// endpoint has its certificate.
func (s *Server) Identity() (*tls.Certificate, *x509.CertPool, error) {
	src, _ := s.serving.Load().(source)
	if src == nil {
		return nil, nil, errors.New("the agent has no certificate for its node yet")
	}
	l, err := src.current()
	if err != nil {
		return nil, nil, err
	}
	return &l.cert, l.pool, nil
}

// certRetry is how long the endpoint waits before asking for its certificate again.
const certRetry = 10 * time.Second

// Start serves until ctx ends.
func (s *Server) Start(ctx context.Context) error {
	var cfg *tls.Config
	for {
		var err error
		if s.CSR != nil {
			// A certificate kept from before the restart is served at once, and a new one asked
			// for straight away: the operator may have replaced the access CA meanwhile
			// (docs/access.md), and the kept one only bridges the wait for it.
			l, renew := s.CSR.kept(), time.Now()
			if l == nil {
				l, renew, err = s.CSR.issue(ctx)
			}
			if err == nil {
				h := &holder{loaded: l}
				cfg = tlsConfig(h, s.ClientName)
				s.serving.Store(source(h))
				go s.renew(ctx, h, renew)
				break
			}
		} else {
			f := &files{cert: filepath.Join(s.CertDir, "tls.crt"), key: filepath.Join(s.CertDir, "tls.key"), ca: filepath.Join(s.CertDir, "ca.crt")}
			if _, err = f.current(); err == nil {
				cfg = tlsConfig(f, s.ClientName)
				s.serving.Store(source(f))
				break
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		s.Log.Info("the access endpoint waits for its certificate", "error", err.Error())
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(certRetry):
		}
	}
	l, err := net.Listen("tcp", s.Addr)
	if err != nil {
		return fmt.Errorf("listening on %s for the access endpoint: %w", s.Addr, err)
	}
	srv := &http.Server{Handler: s.Handler, TLSConfig: cfg, ReadHeaderTimeout: 10 * time.Second, MaxHeaderBytes: 64 << 10}
	go func() {
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shut)
		_ = srv.Close() // streams do not end on Shutdown
	}()
	s.Log.Info("serving the access endpoint", "address", s.Addr)
	if err := srv.ServeTLS(l, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// renew asks for a new certificate from at on, until one is signed, and again two thirds
// through its life, until ctx ends; h serves the old one meanwhile.
func (s *Server) renew(ctx context.Context, h *holder, at time.Time) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Until(at)):
		}
		l, next, err := s.CSR.issue(ctx)
		if err != nil {
			if ctx.Err() == nil {
				s.Log.Error(err, "renewing the access endpoint's certificate; serving the one issued before")
			}
			at = time.Now().Add(time.Minute)
			continue
		}
		h.set(l)
		at = next
		s.Log.Info("renewed the access endpoint's certificate", "renew", next)
	}
}

// NeedLeaderElection: every agent serves its own node.
func (s *Server) NeedLeaderElection() bool { return false }
