package kubectlimp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/spf13/cobra"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/client-go/transport/spdy"
	"k8s.io/kubectl/pkg/util/term"
	utilexec "k8s.io/utils/exec"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// The API group of the ImpVM subresources (internal/subresources).
const (
	subresourcesPath = "/apis/subresources.imp.dev/v1alpha1"
	// accessAPIService is the APIService by which the API server serves subresourcesPath.
	accessAPIService = "v1alpha1.subresources.imp.dev"
)

// ExitError is a command's exit code in a VM, which kubectl imp exec exits with.
type ExitError struct{ Code int }

func (e *ExitError) Error() string {
	return fmt.Sprintf("command terminated with exit code %d", e.Code)
}

// accessOptions are the flags of exec, console, port-forward and logs.
type accessOptions struct {
	stdin, tty, raw, follow bool
	addresses               []string
}

// subresourceURL is the URL of the VM's subresource sub with query q.
func (o *options) subresourceURL(cfg *rest.Config, ns, name, sub string, q url.Values) (*url.URL, error) {
	u, _, err := rest.DefaultServerUrlFor(cfg)
	if err != nil {
		return nil, err
	}
	u.Path = strings.TrimSuffix(u.Path, "/") + subresourcesPath + "/namespaces/" + url.PathEscape(ns) + "/impvms/" + url.PathEscape(name) + "/" + sub
	u.RawQuery = q.Encode()
	return u, nil
}

// noticeWake says on stderr when the VM name is suspended because it was idle: the session
// about to be opened wakes it first (spec.idle), which takes a moment.
func (o *options) noticeWake(ctx context.Context, cfg *rest.Config, ns, name string) {
	u, _, err := rest.DefaultServerUrlFor(cfg)
	if err != nil {
		return
	}
	u.Path = strings.TrimSuffix(u.Path, "/") + "/apis/" + impv1.GroupVersion.String() + "/namespaces/" + url.PathEscape(ns) + "/impvms/" + url.PathEscape(name)
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return
	}
	resp, err := hc.Do(req)
	if err != nil {
		return
	}
	defer resp.Body.Close()
	var vm impv1.ImpVM
	if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(&vm) != nil {
		return
	}
	if sp := vm.Status.Suspension; sp != nil && sp.Reason == impv1.SuspendReasonIdle {
		fmt.Fprintf(o.errOut, "ImpVM %s is suspended because it was idle: waking it.\r\n", name)
	}
}

func (o *options) accessCommands(a *accessOptions) []*cobra.Command {
	exec := &cobra.Command{
		Use:   "exec NAME [-i] [-t] -- COMMAND [ARG...]",
		Short: "Run a command in a VM's guest (as its workload's user, in its root)",
		Args:  cobra.MinimumNArgs(2),
		RunE: o.cmd(func(ctx context.Context, cfg *rest.Config, ns string, args []string) error {
			return o.exec(ctx, cfg, ns, args, a)
		}),
	}
	exec.Flags().BoolVarP(&a.stdin, "stdin", "i", false, "pass stdin to the command")
	exec.Flags().BoolVarP(&a.tty, "tty", "t", false, "give the command a terminal (with -i: this terminal, raw)")
	exec.Flags().BoolVar(&a.raw, "raw", false, "print the guest's output as it is: escape sequences included (default: shown, not interpreted, unless -t)")
	console := &cobra.Command{
		Use:   "console NAME",
		Short: "Attach this terminal to a VM's serial console (Ctrl-] detaches)",
		Long: `Attach this terminal to a VM's serial console: the end of its log, then what the guest
writes; what is typed reaches the console, and the workload when the ImpVM has stdin (and tty
for a terminal with line editing). Ctrl-] detaches; the VM keeps running.`,
		Args: cobra.ExactArgs(1),
		RunE: o.cmd(func(ctx context.Context, cfg *rest.Config, ns string, args []string) error {
			fmt.Fprintf(o.errOut, "Attached to the console of ImpVM %s; Ctrl-] detaches.\r\n", args[0])
			return o.exec(ctx, cfg, ns, []string{args[0]}, &accessOptions{stdin: true, tty: true, raw: true}, "console")
		}),
	}
	pf := &cobra.Command{
		Use:   "port-forward NAME [LOCAL:]REMOTE...",
		Short: "Forward local TCP ports to ports of a VM's guest (no network needed)",
		Args:  cobra.MinimumNArgs(2),
		RunE: o.cmd(func(ctx context.Context, cfg *rest.Config, ns string, args []string) error {
			return o.portForward(ctx, cfg, ns, args, a)
		}),
	}
	pf.Flags().StringSliceVar(&a.addresses, "address", []string{"localhost"}, "local addresses to listen on")
	return []*cobra.Command{exec, console, pf}
}

// cmd runs f with the REST config and namespace of the flags, for as long as it takes.
func (o *options) cmd(f func(ctx context.Context, cfg *rest.Config, ns string, args []string) error) func(*cobra.Command, []string) error {
	return func(c *cobra.Command, args []string) error {
		cfg, err := o.flags.ToRESTConfig()
		if err != nil {
			return err
		}
		ns, _, err := o.flags.ToRawKubeConfigLoader().Namespace()
		if err != nil {
			return err
		}
		return f(c.Context(), cfg, ns, args)
	}
}

// exec runs args[1:] in VM args[0] (or attaches to its console, sub "console").
func (o *options) exec(ctx context.Context, cfg *rest.Config, ns string, args []string, a *accessOptions, sub ...string) error {
	resource := "exec"
	q := url.Values{"stdout": {"true"}}
	if len(sub) > 0 {
		resource = sub[0]
	} else {
		q["command"] = args[1:]
	}
	if a.stdin {
		q.Set("stdin", "true")
	}
	if a.tty {
		q.Set("tty", "true")
	} else {
		q.Set("stderr", "true")
	}
	u, err := o.subresourceURL(cfg, ns, args[0], resource, q)
	if err != nil {
		return err
	}
	o.noticeWake(ctx, cfg, ns, args[0])
	ex, err := remotecommand.NewWebSocketExecutor(cfg, "GET", u.String())
	if err != nil {
		return err
	}
	t := term.TTY{In: o.in, Out: o.out, Raw: a.tty && a.stdin}
	so := remotecommand.StreamOptions{Tty: a.tty}
	if a.stdin {
		so.Stdin = o.in
		if resource == "console" {
			so.Stdin = &detachable{r: o.in}
		}
	}
	// The guest's bytes reach this terminal as they are only in a terminal session (-t) or
	// when asked (--raw): otherwise its escape sequences are shown, not obeyed.
	if a.tty || a.raw {
		so.Stdout, so.Stderr = o.out, o.errOut
	} else {
		so.Stdout, so.Stderr = &inert{w: o.out}, &inert{w: o.errOut}
	}
	if a.tty {
		so.TerminalSizeQueue = sizes{t.MonitorSize(t.GetSize())}
		so.Stderr = nil
	}
	err = t.Safe(func() error { return ex.StreamWithContext(ctx, so) })
	var exit utilexec.ExitError
	if errors.As(err, &exit) {
		return &ExitError{Code: exit.ExitStatus()}
	}
	if err != nil {
		return fmt.Errorf("%s in ImpVM %s: %w", resource, args[0], err)
	}
	return nil
}

// detachKey ends a console attachment: Ctrl-], as telnet's and virtctl's.
const detachKey = 0x1d

// detachable is a console's input, which ends where detachKey is typed.
type detachable struct {
	r        io.Reader
	detached bool
}

func (d *detachable) Read(p []byte) (int, error) {
	if d.detached {
		return 0, io.EOF
	}
	n, err := d.r.Read(p)
	if i := bytes.IndexByte(p[:n], detachKey); i >= 0 {
		d.detached = true
		return i, nil
	}
	return n, err
}

// sizes hands this terminal's sizes to the executor.
type sizes struct{ q term.TerminalSizeQueue }

func (s sizes) Next() *remotecommand.TerminalSize {
	sz := s.q.Next()
	if sz == nil {
		return nil
	}
	return &remotecommand.TerminalSize{Width: sz.Width, Height: sz.Height}
}

// portForward forwards local ports to the VM's until interrupted.
func (o *options) portForward(ctx context.Context, cfg *rest.Config, ns string, args []string, a *accessOptions) error {
	u, err := o.subresourceURL(cfg, ns, args[0], "portforward", nil)
	if err != nil {
		return err
	}
	o.noticeWake(ctx, cfg, ns, args[0])
	rt, upgrader, err := spdy.RoundTripperFor(cfg)
	if err != nil {
		return err
	}
	stop, ready := make(chan struct{}), make(chan struct{})
	go func() {
		<-ctx.Done()
		close(stop)
	}()
	fw, err := portforward.NewOnAddresses(spdy.NewDialer(upgrader, &http.Client{Transport: rt}, http.MethodPost, u),
		a.addresses, args[1:], stop, ready, o.out, o.errOut)
	if err != nil {
		return err
	}
	return fw.ForwardPorts()
}

// logs prints the VM's console log through the API server, following it with -f.
func (o *options) logsThroughAPI(ctx context.Context, cfg *rest.Config, ns, name string, a *accessOptions) error {
	q := url.Values{"limitBytes": {fmt.Sprint(o.bytes)}}
	if a.follow {
		q.Set("follow", "true")
	}
	u, err := o.subresourceURL(cfg, ns, name, "log", q)
	if err != nil {
		return err
	}
	if a.follow {
		o.noticeWake(ctx, cfg, ns, name)
	}
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return err
	}
	if !a.follow {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Minute)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("reading the console of ImpVM %s: %w", name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("reading the console of ImpVM %s: %s", name, refusal(resp.StatusCode, b))
	}
	var w io.Writer = &inert{w: o.out}
	if a.raw {
		w = o.out
	}
	_, err = io.Copy(w, resp.Body)
	if err != nil && ctx.Err() != nil {
		return nil // interrupted while following
	}
	return err
}

// refusal says why the API server refused a subresource: a Status's message, or, for a 404
// that is no Status (the API server has no such group), that IMP's access is not served.
func refusal(code int, body []byte) string {
	var st metav1.Status
	if json.Unmarshal(body, &st) == nil && st.Kind == "Status" {
		return fmt.Sprintf("%d %s", code, st.Message)
	}
	if code == http.StatusNotFound {
		return "the API server does not serve " + strings.TrimPrefix(subresourcesPath, "/apis/") +
			" (IMP's access: the chart's access.enabled, and its APIService available; docs/access.md)"
	}
	if code == http.StatusServiceUnavailable {
		return fmt.Sprintf("%d %s: the API server has not seen IMP's access served yet "+
			"(the operator starting or moved; kubectl get apiservice %s; docs/access.md)",
			code, strings.TrimSpace(string(body)), accessAPIService)
	}
	return fmt.Sprintf("%d %s", code, strings.TrimSpace(string(body)))
}

// inert writes a guest's bytes so that a terminal shows its control characters instead of
// obeying them: ESC and the other C0 controls but newline, tab and CR LF become ^X, DEL ^?, and the
// C1 controls (UTF-8 C2 80 to C2 9F, and those bytes alone) <XX>.
type inert struct{ w io.Writer }

func (n *inert) Write(p []byte) (int, error) {
	out := make([]byte, 0, len(p)+16)
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch {
		case c == '\n' || c == '\t' || (c == '\r' && i+1 < len(p) && p[i+1] == '\n'):
			out = append(out, c) // a serial console ends its lines with CR LF
		case c < 0x20:
			out = append(out, '^', c+'@')
		case c == 0x7f:
			out = append(out, '^', '?')
		case c == 0xc2 && i+1 < len(p) && p[i+1] >= 0x80 && p[i+1] <= 0x9f:
			out = fmt.Appendf(out, "<%02x>", p[i+1])
			i++
		case c >= 0x80 && c <= 0x9f && (i == 0 || p[i-1] < 0xc0):
			// A C1 control byte that no UTF-8 sequence leads into.
			if i > 0 && p[i-1] >= 0x80 {
				out = append(out, c) // a continuation byte of a longer sequence
				continue
			}
			out = fmt.Appendf(out, "<%02x>", c)
		default:
			out = append(out, c)
		}
	}
	if _, err := n.w.Write(out); err != nil {
		return 0, err
	}
	return len(p), nil
}
