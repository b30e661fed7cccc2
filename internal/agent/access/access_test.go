package access_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"
	utilexec "k8s.io/utils/exec"

	"github.com/syscode-labs/imp/internal/agent/access"
	"github.com/syscode-labs/imp/internal/guestsession"
	"github.com/syscode-labs/imp/internal/guestsession/guesttest"
	"github.com/syscode-labs/imp/internal/pki"
)

const client = "imp-subresources"

var vmKey = types.NamespacedName{Namespace: "team-a", Name: "vm"}

// world is an access endpoint serving one VM, and the PKI around it.
type world struct {
	srv *httptest.Server
	ca  pki.Pair
	vms *guesttest.VMs
}

func newWorld(t *testing.T) *world {
	t.Helper()
	now := time.Now()
	ca, err := pki.NewCA("imp-access-ca", now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	serving, err := pki.Issue(ca, pki.Request{CommonName: "imp-agent", DNSNames: []string{"imp-agent"}, IPs: []net.IP{net.ParseIP("127.0.0.1")}, Server: true, Lifetime: time.Hour}, now)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for name, data := range map[string][]byte{"tls.crt": serving.Cert, "tls.key": serving.Key, "ca.crt": ca.Cert} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := access.TLSConfig(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "ca.crt"), client)
	if err != nil {
		t.Fatal(err)
	}

	vms := guesttest.NewVMs(t, map[types.NamespacedName]types.UID{vmKey: "uid-1"})
	srv := httptest.NewUnstartedServer(access.Handler(vms, logr.Discard()))
	srv.TLS = cfg
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return &world{srv: srv, ca: ca, vms: vms}
}

// config is a client of the endpoint with a certificate ca signed for name.
func (w *world) config(t *testing.T, ca pki.Pair, name string) *rest.Config {
	t.Helper()
	c, err := pki.Issue(ca, pki.Request{CommonName: name, Client: true, Lifetime: time.Hour}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(w.srv.URL)
	return &rest.Config{Host: "https://" + u.Host, TLSClientConfig: rest.TLSClientConfig{CAData: w.ca.Cert, CertData: c.Cert, KeyData: c.Key}}
}

func (w *world) url(op string, q url.Values) *url.URL {
	u, _ := url.Parse(w.srv.URL + "/vms/team-a/vm/uid-1/" + op + "?" + q.Encode())
	return u
}

func TestExecThroughTheEndpoint(t *testing.T) {
	w := newWorld(t)
	cfg := w.config(t, w.ca, client)
	for _, tc := range []struct {
		name   string
		cmd    []string
		stdin  string
		stdout string
		code   int
	}{
		{"output", []string{"echo", "hello"}, "", "hello\n", 0},
		{"exit code", []string{"sh", "-c", "echo bye; exit 7"}, "", "bye\n", 7},
		{"stdin", []string{"cat"}, "typed\n", "typed\n", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := url.Values{"command": tc.cmd, "stdout": {"true"}, "stderr": {"true"}}
			if tc.stdin != "" {
				q.Set("stdin", "true")
			}
			ex, err := remotecommand.NewSPDYExecutor(cfg, "POST", w.url("exec", q))
			if err != nil {
				t.Fatal(err)
			}
			var out, errOut bytes.Buffer
			so := remotecommand.StreamOptions{Stdout: &out, Stderr: &errOut}
			if tc.stdin != "" {
				so.Stdin = strings.NewReader(tc.stdin)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			err = ex.StreamWithContext(ctx, so)
			var exit utilexec.ExitError
			switch {
			case tc.code != 0:
				if !errors.As(err, &exit) || exit.ExitStatus() != tc.code {
					t.Fatalf("error %v, want exit code %d", err, tc.code)
				}
			case err != nil:
				t.Fatal(err)
			}
			if out.String() != tc.stdout {
				t.Errorf("stdout %q, want %q (stderr %q)", out.String(), tc.stdout, errOut.String())
			}
		})
	}
}

func TestPortForwardThroughTheEndpoint(t *testing.T) {
	w := newWorld(t)
	cfg := w.config(t, w.ca, client)
	c, _ := guesttest.PortForward(t, cfg, w.url("portforward", nil), guesttest.EchoPort)
	msg := bytes.Repeat([]byte("imp"), 100000)
	go func() { _, _ = c.Write(msg) }()
	got := make([]byte, len(msg))
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echoed through the VM's port: %v", err)
	}
}

func TestLogFollow(t *testing.T) {
	w := newWorld(t)
	cfg := w.config(t, w.ca, client)
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, w.url("log", url.Values{"follow": {"true"}}).String(), nil)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	go func() {
		time.Sleep(300 * time.Millisecond)
		f, _ := os.OpenFile(w.vms.Console("uid-1"), os.O_APPEND|os.O_WRONLY, 0)
		_, _ = f.WriteString("later\n")
		f.Close()
	}()
	var got []byte
	buf := make([]byte, 64)
	for !bytes.Contains(got, []byte("later\n")) {
		n, err := resp.Body.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			t.Fatalf("read %q, then %v", got, err)
		}
	}
	if !bytes.HasPrefix(got, []byte("boot\n")) {
		t.Errorf("followed %q, want the log from its beginning", got)
	}
}

// Two users attach to one console, over WebSocket and SPDY: each sees the log's end, what the
// guest answers to either's input; each ends when its input ends.
func TestConsoleThroughTheEndpoint(t *testing.T) {
	w := newWorld(t)
	cfg := w.config(t, w.ca, client)
	q := url.Values{"stdin": {"true"}, "stdout": {"true"}, "tty": {"true"}}
	type attachment struct {
		in   *io.PipeWriter
		out  *guesttest.Screen
		done chan error
	}
	attach := func(ex remotecommand.Executor, err error) attachment {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		r, in := io.Pipe()
		a := attachment{in: in, out: &guesttest.Screen{}, done: make(chan error, 1)}
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			a.done <- ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdin: r, Stdout: a.out, Tty: true})
		}()
		return a
	}
	ws := attach(remotecommand.NewWebSocketExecutor(cfg, "GET", w.url("console", q).String()))
	spdy := attach(remotecommand.NewSPDYExecutor(cfg, "POST", w.url("console", q)))
	ws.out.WaitFor(t, "boot\n", 20*time.Second)
	spdy.out.WaitFor(t, "boot\n", 20*time.Second)
	if _, err := ws.in.Write([]byte("ping\r")); err != nil {
		t.Fatal(err)
	}
	if _, err := spdy.in.Write([]byte("pong\r")); err != nil {
		t.Fatal(err)
	}
	for _, a := range []attachment{ws, spdy} {
		a.out.WaitFor(t, `console said "ping"`, 20*time.Second)
		a.out.WaitFor(t, `console said "pong"`, 20*time.Second)
	}
	for name, a := range map[string]attachment{"websocket": ws, "spdy": spdy} {
		a.in.Close()
		select {
		case err := <-a.done:
			if err != nil {
				t.Errorf("%s: the attachment ended with %v", name, err)
			}
		case <-time.After(20 * time.Second):
			t.Errorf("%s: the attachment did not end with its input", name)
		}
	}
}

// The endpoint serves the subresource server's certificate and nothing else.
func TestRefusesOtherClients(t *testing.T) {
	w := newWorld(t)
	other, err := pki.NewCA("someone-else", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		cfg  *rest.Config
	}{
		{"no certificate", &rest.Config{Host: w.config(t, w.ca, client).Host, TLSClientConfig: rest.TLSClientConfig{CAData: w.ca.Cert}}},
		{"another CA's certificate", w.config(t, other, client)},
		{"the CA's certificate for another name", w.config(t, w.ca, "imp-agent")},
		// Another node's agent, whose certificate is a client's too (for migrations).
		{"another node's agent", agentConfig(t, w, "node-b")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hc, err := rest.HTTPClientFor(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := hc.Get(w.url("log", nil).String())
			if err == nil {
				resp.Body.Close()
				t.Fatalf("served %s", resp.Status)
			}
			var certErr *tls.CertificateVerificationError
			if errors.As(err, &certErr) {
				t.Fatalf("the client refused the server, not the other way: %v", err)
			}
		})
	}
	// The right one is served.
	hc, _ := rest.HTTPClientFor(w.config(t, w.ca, client))
	resp, err := hc.Get(w.url("log", nil).String())
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("the subresource server's certificate: %v %v", resp, err)
	}
	resp.Body.Close()
}

// agentConfig is a client with the certificate the operator signs for node's agent.
func agentConfig(t *testing.T, w *world, node string) *rest.Config {
	t.Helper()
	c, err := pki.Issue(w.ca, pki.Request{CommonName: pki.AgentName, DNSNames: []string{pki.AgentDNSName(node)}, Server: true, Client: true,
		Lifetime: time.Hour}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(w.srv.URL)
	return &rest.Config{Host: "https://" + u.Host, TLSClientConfig: rest.TLSClientConfig{CAData: w.ca.Cert, CertData: c.Cert, KeyData: c.Key}}
}

// spy records whether the endpoint asked for any VM.
type spy struct{ asked bool }

func (s *spy) Session(types.NamespacedName, types.UID) (*guestsession.Client, error) {
	s.asked = true
	return nil, errors.New("none")
}

func (s *spy) ConsoleLog(types.NamespacedName, types.UID) (*os.File, error) {
	s.asked = true
	return nil, errors.New("none")
}

func (s *spy) ConsoleInput(types.NamespacedName, types.UID) (io.WriteCloser, <-chan struct{}, error) {
	s.asked = true
	return nil, nil, errors.New("none")
}

// A UID that is a path (the agent finds a VM's state directory by its UID) is refused before
// any VM is looked up, whoever sends it.
func TestRefusesPathsAsUIDs(t *testing.T) {
	vms := &spy{}
	srv := httptest.NewServer(access.Handler(vms, logr.Discard()))
	defer srv.Close()
	for _, uid := range []string{"..", ".", "%2e%2e", "a%2fb", "..%2f..%2fetc"} {
		for _, op := range []string{"log", "exec?command=true&stdout=1", "portforward", "console?stdin=1&stdout=1"} {
			resp, err := http.Get(srv.URL + "/vms/ns/vm/" + uid + "/" + op)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusSwitchingProtocols {
				t.Errorf("uid %q, %s: %s", uid, op, resp.Status)
			}
		}
	}
	if vms.asked {
		t.Error("a VM was looked up for a UID that is a path")
	}
}
