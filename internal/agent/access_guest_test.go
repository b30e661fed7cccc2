package agent_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"
	utilexec "k8s.io/utils/exec"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/access"
	"github.com/syscode-labs/imp/internal/guestsession/guesttest"
)

// sizeQueue hands a terminal's size once.
type sizeQueue struct {
	sizes chan remotecommand.TerminalSize
}

func (q sizeQueue) Next() *remotecommand.TerminalSize {
	s, ok := <-q.sizes
	if !ok {
		return nil
	}
	return &s
}

// checkAccess runs commands in the running guest v, reaches its loopback TCP server (it has no
// network), reads its console log and types into its console, through the agent's access endpoint as kubectl's client
// libraries speak to it. The endpoint's TLS is the access package's test; here it is plain.
func checkAccess(t *testing.T, w *world, v *impv1.ImpVM) {
	t.Helper()
	srv := httptest.NewServer(access.Handler(w.agent.Runs, logr.Discard()))
	defer srv.Close()
	cfg := &rest.Config{Host: srv.URL}
	at := func(op string, q url.Values) *url.URL {
		u, _ := url.Parse(srv.URL + "/vms/" + v.Namespace + "/" + v.Name + "/" + string(v.UID) + "/" + op + "?" + q.Encode())
		return u
	}
	exec := func(cmd []string, tty bool, stdin string) (string, string, error) {
		q := url.Values{"command": cmd, "stdout": {"true"}}
		if !tty {
			q.Set("stderr", "true")
		} else {
			q.Set("tty", "true")
		}
		if stdin != "" {
			q.Set("stdin", "true")
		}
		ex, err := remotecommand.NewWebSocketExecutor(cfg, "GET", at("exec", q).String())
		if err != nil {
			t.Fatal(err)
		}
		var out, errOut bytes.Buffer
		o := remotecommand.StreamOptions{Stdout: &out, Tty: tty}
		if !tty {
			o.Stderr = &errOut
		} else {
			sizes := make(chan remotecommand.TerminalSize, 1)
			sizes <- remotecommand.TerminalSize{Width: 132, Height: 43}
			close(sizes)
			o.TerminalSizeQueue = sizeQueue{sizes}
		}
		if stdin != "" {
			o.Stdin = strings.NewReader(stdin)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err = ex.StreamWithContext(ctx, o)
		return out.String(), errOut.String(), err
	}

	out, errOut, err := exec([]string{"/bin/hello", "tool-exit", "3", "from", "the", "guest"}, false, "")
	var exit utilexec.ExitError
	if !errors.As(err, &exit) || exit.ExitStatus() != 3 || out != "from the guest\n" || errOut != "to stderr\n" {
		t.Errorf("exec in the guest: stdout %q, stderr %q, error %v; want the words, to stderr, and exit code 3", out, errOut, err)
	}
	if out, _, err := exec([]string{"/bin/hello", "tool-cat"}, false, "typed into the guest\n"); err != nil || out != "typed into the guest\n" {
		t.Errorf("exec with stdin: %q, %v", out, err)
	}
	if out, _, err := exec([]string{"/bin/hello", "tool-tty"}, true, ""); err != nil || !strings.Contains(out, "tty 132x43") {
		t.Errorf("exec with a terminal: %q, %v; want the terminal's size 132x43", out, err)
	}
	if _, _, err := exec([]string{"/no/such/command"}, false, ""); err == nil {
		t.Error("exec of a missing command succeeded")
	}

	// Port-forward to the guest's loopback: the VM has no network at all.
	c, _ := guesttest.PortForward(t, cfg, at("portforward", nil), 7001)
	msg := bytes.Repeat([]byte("through the session channel "), 4096)
	go func() { _, _ = c.Write(msg) }()
	got := make([]byte, len(msg))
	_ = c.SetReadDeadline(time.Now().Add(time.Minute))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Errorf("echo through port-forward to the guest's 127.0.0.1:7001: %v", err)
	}

	// The console's log.
	resp, err := http.Get(at("log", url.Values{"limitBytes": {"100000"}}).String())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), "hello from imp") {
		t.Errorf("console log through the endpoint: %s %q", resp.Status, b)
	}

	// The serial console, the workload's terminal (the VM has stdin and tty): the boot's log,
	// then a line typed, echoed by the guest's terminal and answered by the workload.
	ex, err := remotecommand.NewWebSocketExecutor(cfg, "GET", at("console", url.Values{"stdin": {"true"}, "stdout": {"true"}, "tty": {"true"}}).String())
	if err != nil {
		t.Fatal(err)
	}
	typed, in := io.Pipe()
	screen := &guesttest.Screen{}
	attached := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		attached <- ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdin: typed, Stdout: screen, Tty: true})
	}()
	screen.WaitFor(t, "hello from imp", 3*time.Minute)
	if _, err := in.Write([]byte("ping\r")); err != nil {
		t.Fatal(err)
	}
	screen.WaitFor(t, "ping\r\n", 3*time.Minute)
	screen.WaitFor(t, `hello: console said "ping"`, 3*time.Minute)
	in.Close()
	if err := <-attached; err != nil {
		t.Errorf("the console attachment ended with %v", err)
	}

	// Another VM's name with this one's UID reaches nothing.
	if _, err := w.agent.Runs.Session(types.NamespacedName{Namespace: v.Namespace, Name: "other"}, v.UID); err == nil {
		t.Error("a session for a VM named other with this VM's UID")
	}
	if _, _, err := w.agent.Runs.ConsoleInput(types.NamespacedName{Namespace: v.Namespace, Name: "other"}, v.UID); err == nil {
		t.Error("a console for a VM named other with this VM's UID")
	}
}
