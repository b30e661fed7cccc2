package subresources_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/creack/pty"
	"github.com/go-logr/logr"
	authorizationv1 "k8s.io/api/authorization/v1"
	certv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/access"
	"github.com/syscode-labs/imp/internal/guestsession/guesttest"
	"github.com/syscode-labs/imp/internal/kubectlimp"
	"github.com/syscode-labs/imp/internal/pki"
	"github.com/syscode-labs/imp/internal/subresources"
	"github.com/syscode-labs/imp/internal/subresources/subresourcestest"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var (
	shared   *testcluster.Cluster
	auditLog string
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "imp-subresources-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer os.RemoveAll(dir)
	fp, err := testcluster.WithFrontProxy(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	audit, log, err := testcluster.WithAudit(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	auditLog = log
	os.Exit(testcluster.Main(m, &shared, fp, audit))
}

// world is the whole path: the API server with its front proxy, the subresource server as
// the operator runs it (its identity, its certificates), and one node's agent endpoint whose
// VMs' guests run in this process; a VM in each of two namespaces.
type world struct {
	cl       *testcluster.Cluster
	nsA, nsB string
	vms      *guesttest.VMs
	subPort  int
}

func newWorld(t *testing.T) *world {
	t.Helper()
	cl := testcluster.Require(t, shared)
	ctx := context.Background()
	w := &world{cl: cl, nsA: cl.Namespace(t), nsB: cl.Namespace(t)}
	node := "sub-node-" + w.nsA[len(w.nsA)-5:]
	uids := map[types.NamespacedName]types.UID{}
	for _, ns := range []string{w.nsA, w.nsB} {
		vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "vm"},
			Spec: impv1.ImpVMSpec{Image: "registry.test/app:1", Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}}}
		if err := cl.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
		vm.Status.NodeName, vm.Status.Phase = node, impv1.VMRunning
		if err := cl.Client.Status().Update(ctx, vm); err != nil {
			t.Fatal(err)
		}
		uids[types.NamespacedName{Namespace: ns, Name: "vm"}] = vm.UID
	}
	w.vms = guesttest.NewVMs(t, uids)
	w.subPort = subresourcestest.Serve(t, cl, node, w.vms)
	return w
}

// user is the admin's config impersonating name, bound in namespace nsA to roles.
func (w *world) user(t *testing.T, name string, roles ...string) *rest.Config {
	t.Helper()
	for _, role := range roles {
		rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: w.nsA, Name: name + "-" + role},
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: name}}}
		if err := w.cl.Client.Create(context.Background(), rb); err != nil {
			t.Fatal(err)
		}
		w.awaitBinding(t, name, role)
	}
	cfg := rest.CopyConfig(w.cl.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: name}
	return cfg
}

// awaitBinding waits until the API server's authorizer grants name the first rule of role
// in nsA: a RoleBinding takes effect when the authorizer's cache has it, not when it is created.
func (w *world) awaitBinding(t *testing.T, name, role string) {
	t.Helper()
	ctx := context.Background()
	cr := &rbacv1.ClusterRole{}
	if err := w.cl.Client.Get(ctx, client.ObjectKey{Name: role}, cr); err != nil {
		t.Fatal(err)
	}
	if len(cr.Rules) == 0 || len(cr.Rules[0].Verbs) == 0 || len(cr.Rules[0].Resources) == 0 || len(cr.Rules[0].APIGroups) == 0 {
		t.Fatalf("ClusterRole %s has no rule to check a binding by", role)
	}
	r := cr.Rules[0]
	res, sub, _ := strings.Cut(r.Resources[0], "/")
	attrs := &authorizationv1.ResourceAttributes{Namespace: w.nsA, Verb: r.Verbs[0], Group: r.APIGroups[0], Resource: res, Subresource: sub}
	deadline := time.Now().Add(30 * time.Second)
	for {
		sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{User: name, ResourceAttributes: attrs}}
		if err := w.cl.Client.Create(ctx, sar); err != nil {
			t.Fatal(err)
		}
		if sar.Status.Allowed {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s bound to %s in %s: the authorizer still refuses %+v", name, role, w.nsA, *attrs)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (w *world) path(ns, sub string) string {
	return "/apis/" + subresources.Group + "/" + subresources.Version + "/namespaces/" + ns + "/impvms/vm/" + sub
}

func (w *world) exec(cfg *rest.Config, ns string, stdin string, cmd ...string) (string, error) {
	u, _, _ := rest.DefaultServerUrlFor(cfg)
	u.Path = w.path(ns, "exec")
	q := u.Query()
	q["command"] = cmd
	q.Set("stdout", "true")
	q.Set("stderr", "true")
	if stdin != "" {
		q.Set("stdin", "true")
	}
	u.RawQuery = q.Encode()
	ex, err := remotecommand.NewWebSocketExecutor(cfg, "GET", u.String())
	if err != nil {
		return "", err
	}
	var out, errOut bytes.Buffer
	o := remotecommand.StreamOptions{Stdout: &out, Stderr: &errOut}
	if stdin != "" {
		o.Stdin = strings.NewReader(stdin)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = ex.StreamWithContext(ctx, o)
	return out.String(), err
}

// console attaches to the console of the VM of ns, types a line and detaches once the guest
// answered it; it returns what the attachment showed.
func (w *world) console(cfg *rest.Config, ns, line string) (string, error) {
	u, _, _ := rest.DefaultServerUrlFor(cfg)
	u.Path = w.path(ns, "console")
	u.RawQuery = url.Values{"stdin": {"true"}, "stdout": {"true"}, "tty": {"true"}}.Encode()
	ex, err := remotecommand.NewWebSocketExecutor(cfg, "GET", u.String())
	if err != nil {
		return "", err
	}
	in, typed := io.Pipe()
	screen := &guesttest.Screen{}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go func() {
		_, _ = typed.Write([]byte(line + "\r"))
		for !strings.Contains(screen.String(), fmt.Sprintf("console said %q", line)) && ctx.Err() == nil {
			time.Sleep(20 * time.Millisecond)
		}
		typed.Close() // detach
	}()
	err = ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdin: in, Stdout: screen, Tty: true})
	typed.Close()
	return screen.String(), err
}

func (w *world) log(cfg *rest.Config, ns string) (string, error) {
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return "", err
	}
	resp, err := hc.Get(strings.TrimSuffix(cfg.Host, "/") + w.path(ns, "log"))
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", resp.Status, b)
	}
	return string(b), nil
}

// stats reads the figures of ns's VM as cfg's user, with method.
func (w *world) stats(cfg *rest.Config, ns, method string) (*impv1.VMFigures, error) {
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequest(method, strings.TrimSuffix(cfg.Host, "/")+w.path(ns, "stats"), nil)
	if err != nil {
		return nil, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", resp.Status, b)
	}
	f := &impv1.VMFigures{}
	return f, json.Unmarshal(b, f)
}

func forbidden(err error) bool {
	return err != nil && (strings.Contains(err.Error(), "forbidden") || strings.Contains(err.Error(), "403"))
}

// A user with edit in namespace A execs, forwards ports and reads logs of A's VMs, and is
// refused by the API server on B's; a viewer reads logs only; the audit log names them.
func TestAccessThroughTheAPIServer(t *testing.T) {
	w := newWorld(t)
	// The aggregation controller folds imp-edit and imp-view into edit: bound here as it
	// would have (this control plane runs no controller manager).
	alice := w.user(t, "alice", "imp-edit", "imp-view")
	victor := w.user(t, "victor", "imp-view")

	out, err := w.exec(alice, w.nsA, "", "sh", "-c", "echo hello from the guest; exit 0")
	if err != nil || out != "hello from the guest\n" {
		t.Fatalf("alice's exec in %s: %q, %v", w.nsA, out, err)
	}
	out, err = w.exec(alice, w.nsA, "", "sh", "-c", "exit 4")
	var exit interface{ ExitStatus() int }
	if !errors.As(err, &exit) || exit.ExitStatus() != 4 {
		t.Errorf("alice's exec exiting 4: %q, %v", out, err)
	}
	if out, err := w.exec(alice, w.nsA, "typed\n", "cat"); err != nil || out != "typed\n" {
		t.Errorf("alice's exec with stdin: %q, %v", out, err)
	}
	if _, err := w.exec(alice, w.nsB, "", "true"); !forbidden(err) {
		t.Errorf("alice's exec in %s: %v, want 403 Forbidden", w.nsB, err)
	}
	if _, err := w.exec(victor, w.nsA, "", "true"); !forbidden(err) {
		t.Errorf("victor (view) execs: %v, want 403 Forbidden", err)
	}
	for _, u := range []struct {
		name string
		cfg  *rest.Config
	}{{"alice", alice}, {"victor", victor}} {
		if log, err := w.log(u.cfg, w.nsA); err != nil || log != "boot\n" {
			t.Errorf("%s's log in %s: %q, %v", u.name, w.nsA, log, err)
		}
		if _, err := w.log(u.cfg, w.nsB); !forbidden(err) {
			t.Errorf("%s's log in %s: %v, want 403 Forbidden", u.name, w.nsB, err)
		}
	}

	// The figures (kubectl imp top): read-only, for view too; never written.
	for _, u := range []struct {
		name string
		cfg  *rest.Config
	}{{"alice", alice}, {"victor", victor}} {
		if f, err := w.stats(u.cfg, w.nsA, http.MethodGet); err != nil || f.Guest == nil || f.Guest.MemoryBytes != 128<<20 || f.VMMCPUSeconds != 1.5 {
			t.Errorf("%s's figures in %s: %+v, %v", u.name, w.nsA, f, err)
		}
		if _, err := w.stats(u.cfg, w.nsB, http.MethodGet); !forbidden(err) {
			t.Errorf("%s's figures in %s: %v, want 403 Forbidden", u.name, w.nsB, err)
		}
	}
	if _, err := w.stats(alice, w.nsA, http.MethodPost); err == nil {
		t.Error("alice POSTed to the figures and was served")
	}

	// The console.
	if out, err := w.console(alice, w.nsA, "hi"); err != nil || !strings.Contains(out, `console said "hi"`) {
		t.Errorf("alice's console in %s: %q, %v", w.nsA, out, err)
	}
	if _, err := w.console(alice, w.nsB, "hi"); !forbidden(err) {
		t.Errorf("alice's console in %s: %v, want 403 Forbidden", w.nsB, err)
	}
	if _, err := w.console(victor, w.nsA, "hi"); !forbidden(err) {
		t.Errorf("victor (view) attaches to the console: %v, want 403 Forbidden", err)
	}

	// Port-forward.
	u, _, _ := rest.DefaultServerUrlFor(alice)
	u.Path = w.path(w.nsA, "portforward")
	c, endForward := guesttest.PortForward(t, alice, u, guesttest.EchoPort)
	msg := bytes.Repeat([]byte("port-forward "), 10000)
	go func() { _, _ = c.Write(msg) }()
	got := make([]byte, len(msg))
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Errorf("echo through alice's port-forward: %v", err)
	}
	endForward() // the port-forward's request ends, and only then is it audited

	// The audit log records each access with the user's name.
	want := []string{"alice get impvms/exec A 101", "alice get impvms/exec B 403", "alice create impvms/portforward A 101",
		"victor get impvms/log A 200", "victor get impvms/exec A 403", "victor get impvms/stats A 200",
		"alice get impvms/console A 101", "alice get impvms/console B 403", "victor get impvms/console A 403"}
	seen := map[string]bool{}
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(250 * time.Millisecond) {
		seen = audited(t, w.nsA)
		missing := false
		for _, e := range want {
			missing = missing || !seen[e]
		}
		if !missing || time.Now().After(deadline) {
			break
		}
	}
	for _, e := range want {
		if !seen[e] {
			t.Errorf("the audit log has no %q; it has %v", e, seen)
		}
	}
}

// TestIdleMembersTakeNoAccess: a warm pool's idle member is handed to a claim as its pool made
// it: exec, console and port-forward are refused (409) while it is one; its log may be read.
// A VM that carries the label without the pool as its controller is no member.
func TestIdleMembersTakeNoAccess(t *testing.T) {
	w := newWorld(t)
	alice := w.user(t, "alice", "imp-edit", "imp-view")
	ctx := context.Background()
	setMember := func(labels map[string]string, owners []metav1.OwnerReference) {
		t.Helper()
		vm := &impv1.ImpVM{}
		if err := w.cl.Client.Get(ctx, types.NamespacedName{Namespace: w.nsA, Name: "vm"}, vm); err != nil {
			t.Fatal(err)
		}
		vm.Labels, vm.OwnerReferences = labels, owners
		if err := w.cl.Client.Update(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	owner := metav1.OwnerReference{APIVersion: impv1.GroupVersion.String(), Kind: "ImpWarmPool", Name: "p", UID: "pool-uid", Controller: ptr.To(true)}
	setMember(map[string]string{impv1.WarmPoolLabel: "p"}, []metav1.OwnerReference{owner})
	if _, err := w.exec(alice, w.nsA, "", "true"); err == nil || !strings.Contains(err.Error(), "idle member of ImpWarmPool p") {
		t.Errorf("exec in an idle member: %v, want refused", err)
	}
	if _, err := w.console(alice, w.nsA, "hi"); err == nil || !strings.Contains(err.Error(), "idle member") {
		t.Errorf("the console of an idle member: %v, want refused", err)
	}
	if log, err := w.log(alice, w.nsA); err != nil || log != "boot\n" {
		t.Errorf("an idle member's log: %q, %v", log, err)
	}
	setMember(map[string]string{impv1.WarmPoolLabel: "p"}, nil) // the label alone
	if out, err := w.exec(alice, w.nsA, "", "sh", "-c", "echo not a member"); err != nil || out != "not a member\n" {
		t.Errorf("exec in a VM with the label and no pool as controller: %q, %v", out, err)
	}
}

// audited is the audit log's accesses to the subresources, as "user verb resource/sub A|B code"
// (A: namespace nsA).
func audited(t *testing.T, nsA string) map[string]bool {
	type event struct {
		Verb             string `json:"verb"`
		ImpersonatedUser *struct {
			Username string `json:"username"`
		} `json:"impersonatedUser"`
		ObjectRef *struct {
			Resource, Subresource, Namespace, APIGroup string
		} `json:"objectRef"`
		ResponseStatus *struct {
			Code int `json:"code"`
		} `json:"responseStatus"`
	}
	seen := map[string]bool{}
	f, err := os.Open(auditLog)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var e event
		if json.Unmarshal(sc.Bytes(), &e) != nil || e.ImpersonatedUser == nil || e.ObjectRef == nil || e.ObjectRef.APIGroup != subresources.Group {
			continue
		}
		code := 0
		if e.ResponseStatus != nil {
			code = e.ResponseStatus.Code
		}
		seen[fmt.Sprintf("%s %s %s/%s %s %d", e.ImpersonatedUser.Username, e.Verb, e.ObjectRef.Resource, e.ObjectRef.Subresource,
			map[bool]string{true: "A", false: "B"}[e.ObjectRef.Namespace == nsA], code)] = true
	}
	return seen
}

// The subresource server serves the API server's front proxy and nobody else, whatever the
// headers say.
func TestOnlyTheFrontProxy(t *testing.T) {
	w := newWorld(t)
	other, err := pki.NewCA("not-the-front-proxy", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	stranger, err := pki.Issue(other, pki.Request{CommonName: testcluster.FrontProxyName, Client: true, Lifetime: time.Hour}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(stranger.Cert, stranger.Key)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		certs []tls.Certificate
	}{{"no certificate", nil}, {"another CA's front-proxy-client", []tls.Certificate{cert}}} {
		t.Run(tc.name, func(t *testing.T) {
			hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true, Certificates: tc.certs}}}
			req, _ := http.NewRequest(http.MethodGet, "https://127.0.0.1:"+strconv.Itoa(w.subPort)+w.path(w.nsA, "log"), nil)
			req.Header.Set("X-Remote-User", "system:admin")
			req.Header.Add("X-Remote-Group", "system:masters")
			resp, err := hc.Do(req)
			if err != nil {
				return // refused in the handshake
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusUnauthorized || strings.Contains(string(b), "boot") {
				t.Fatalf("served %s: %s", resp.Status, b)
			}
		})
	}
}

// An agent, or root on its node with the agent's token, reads every Secret of the release
// namespace (its run Secrets): the key that signs the client certificate every agent accepts
// is elsewhere, and refused to it.
func TestAgentsCannotReadTheAccessCA(t *testing.T) {
	w := newWorld(t)
	agent, err := client.New(w.cl.AsNode(t, testcluster.Agent, "sub-node-"+w.nsA[len(w.nsA)-5:]), client.Options{Scheme: w.cl.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	var s corev1.Secret
	err = agent.Get(context.Background(), types.NamespacedName{Namespace: subresourcestest.CANamespace, Name: pki.CASecret}, &s)
	if !apierrors.IsForbidden(err) {
		t.Fatalf("an agent reading the access CA: %v (key %d bytes), want Forbidden", err, len(s.Data["tls.key"]))
	}
}

// kubectl imp, the binary, as a user runs it: exec with its output (control characters shown,
// not obeyed) and exit code, exec -it in a terminal, console typed into and detached from, logs
// -f following the console.
func TestKubectlImp(t *testing.T) {
	w := newWorld(t)
	w.user(t, "alice", "imp-edit", "imp-view")
	root, err := testcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "kubectl-imp")
	if out, err := exec.Command("go", "build", "-o", bin, filepath.Join(root, "cmd", "kubectl-imp")).CombinedOutput(); err != nil {
		t.Fatalf("building kubectl-imp: %v\n%s", err, out)
	}
	kc := w.cl.Kubeconfig(t)
	imp := func(args ...string) *exec.Cmd {
		return exec.Command(bin, append([]string{"--kubeconfig", kc, "--as", "alice", "-n", w.nsA}, args...)...)
	}

	out, err := imp("exec", "vm", "--", "sh", "-c", `echo from the guest; printf '\033]0;owned\007\033[2J'; exit 5`).Output()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 5 || string(out) != "from the guest\n^[]0;owned^G^[[2J" {
		t.Errorf("kubectl imp exec: %q, %v; want the output with its escapes shown, and exit code 5", out, err)
	}

	// -it: a terminal of 40 rows and 100 columns, typed into.
	ptmx, err := pty.StartWithSize(imp("exec", "-it", "vm", "--", "sh"), &pty.Winsize{Rows: 40, Cols: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer ptmx.Close()
	if _, err := ptmx.Write([]byte("stty size; tty; exit 3\n")); err != nil {
		t.Fatal(err)
	}
	var term bytes.Buffer
	_, _ = io.Copy(&term, ptmx) // until the command ends (EIO)
	if !strings.Contains(term.String(), "40 100") || !strings.Contains(term.String(), "/dev/pts/") {
		t.Errorf("kubectl imp exec -it printed %q, want the terminal's size 40 100 and a pts", term.String())
	}

	// console: the log's end, the guest's answer to a line typed, and Ctrl-] detaching.
	cons := imp("console", "vm")
	ptmx, err = pty.StartWithSize(cons, &pty.Winsize{Rows: 40, Cols: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer ptmx.Close()
	screen := &guesttest.Screen{}
	copied := make(chan struct{})
	go func() { _, _ = io.Copy(screen, ptmx); close(copied) }()
	screen.WaitFor(t, "boot", 30*time.Second) // attached: the log's end
	if _, err := ptmx.Write([]byte("ping\r")); err != nil {
		t.Fatal(err)
	}
	screen.WaitFor(t, `console said "ping"`, 30*time.Second)
	if _, err := ptmx.Write([]byte{0x1d}); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cons.Wait() }()
	select {
	case err := <-waited:
		<-copied
		if err != nil || !strings.Contains(screen.String(), "boot") || !strings.Contains(screen.String(), `console said "ping"`) {
			t.Errorf("kubectl imp console: %v, printed %q; want the log's end, the guest's answer, exit code 0", err, screen.String())
		}
	case <-time.After(30 * time.Second):
		_ = cons.Process.Kill()
		t.Errorf("kubectl imp console did not detach on Ctrl-]; printed %q", screen.String())
	}

	// logs -f follows the console.
	logs := imp("logs", "vm", "-f")
	stdout, err := logs.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := logs.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = logs.Process.Kill(); _ = logs.Wait() }()
	got := make(chan string, 1)
	go func() {
		var b []byte
		buf := make([]byte, 256)
		for !bytes.Contains(b, []byte("later\n")) {
			n, err := stdout.Read(buf)
			b = append(b, buf[:n]...)
			if err != nil {
				break
			}
		}
		got <- string(b)
	}()
	time.Sleep(time.Second)
	f, err := os.OpenFile(w.vms.Console(w.vms.UIDs[types.NamespacedName{Namespace: w.nsA, Name: "vm"}]), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = f.WriteString("later\n")
	f.Close()
	select {
	case s := <-got:
		if s != "boot\nconsole said \"ping\"\nlater\n" {
			t.Errorf("kubectl imp logs -f printed %q", s)
		}
	case <-time.After(30 * time.Second):
		t.Error("kubectl imp logs -f did not follow the console")
	}
}

// Certificates are issued again two thirds through their life, under the same CA, and left
// alone before.
func TestCertificatesRenew(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	secret := func(ns, name string) map[string][]byte {
		var s corev1.Secret
		if err := w.cl.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &s); err != nil {
			t.Fatal(err)
		}
		return s.Data
	}
	ca, serving := secret(subresourcestest.CANamespace, pki.CASecret), secret(subresourcestest.CANamespace, pki.ServingSecret)
	at := func(d time.Duration) *pki.Rotator {
		return &pki.Rotator{Client: w.cl.Client, Reader: w.cl.Client, Namespace: testcluster.ChartNamespace, CANamespace: subresourcestest.CANamespace,
			Service: "imp-subresources", APIService: subresourcestest.APIService, Clock: clocktesting.NewFakePassiveClock(time.Now().Add(d)), Log: logr.Discard()}
	}
	// A month on: nothing to do.
	if err := at(30 * 24 * time.Hour).Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(secret(subresourcestest.CANamespace, pki.ServingSecret)["tls.crt"], serving["tls.crt"]) {
		t.Error("the serving certificate was issued again a month into its 90 days")
	}
	// Past 60 days: the leaf again, the CA kept.
	r := at(61 * 24 * time.Hour)
	if err := r.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	renewed := secret(subresourcestest.CANamespace, pki.ServingSecret)
	if bytes.Equal(renewed["tls.crt"], serving["tls.crt"]) {
		t.Error("a certificate 61 days into its 90 was not issued again")
	}
	if !bytes.Equal(secret(subresourcestest.CANamespace, pki.CASecret)["tls.crt"], ca["tls.crt"]) || !bytes.Equal(renewed["ca.crt"], ca["tls.crt"]) {
		t.Error("renewing the leaves changed the CA the agents trust")
	}
	if exp, err := pki.Expiry(renewed["tls.crt"]); err != nil || exp.Before(time.Now().Add(140*24*time.Hour)) {
		t.Errorf("the renewed certificate ends %v (%v), want 90 days after the renewal", exp, err)
	}
}

// An agent gets a certificate for its own node only, the node its token is bound to: not for
// another node, not without a node, and nobody else gets one.
func TestAgentCertificatesAreNodeBound(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	request := func(t *testing.T, cfg *rest.Config, name string) *certv1.CertificateSigningRequest {
		t.Helper()
		c, err := client.New(cfg, client.Options{Scheme: w.cl.Scheme})
		if err != nil {
			t.Fatal(err)
		}
		der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: pki.AgentName}, DNSNames: []string{name}}, key)
		if err != nil {
			t.Fatal(err)
		}
		csr := &certv1.CertificateSigningRequest{ObjectMeta: metav1.ObjectMeta{GenerateName: "test-"},
			Spec: certv1.CertificateSigningRequestSpec{Request: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}),
				SignerName: pki.SignerName, Usages: []certv1.KeyUsage{certv1.UsageDigitalSignature, certv1.UsageServerAuth}}}
		if err := c.Create(ctx, csr); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = w.cl.Client.Delete(context.Background(), csr) })
		// Decided: signed or denied.
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if err := w.cl.Client.Get(ctx, client.ObjectKeyFromObject(csr), csr); err != nil {
				t.Fatal(err)
			}
			if len(csr.Status.Certificate) > 0 || slices.ContainsFunc(csr.Status.Conditions, func(c certv1.CertificateSigningRequestCondition) bool {
				return c.Type == certv1.CertificateDenied
			}) {
				return csr
			}
			if time.Now().After(deadline) {
				t.Fatalf("request %s undecided: %+v", csr.Name, csr.Status)
			}
		}
	}
	denied := func(csr *certv1.CertificateSigningRequest) string {
		for _, c := range csr.Status.Conditions {
			if c.Type == certv1.CertificateDenied {
				return c.Message
			}
		}
		return ""
	}
	for _, tc := range []struct {
		name, node, asks string
		as               *rest.Config
		deny             string // empty: signed
	}{
		{"its own node", "node-x", pki.AgentDNSName("node-x"), w.cl.AsNode(t, testcluster.Agent, "node-x"), ""},
		{"another node", "node-x", pki.AgentDNSName("node-y"), w.cl.AsNode(t, testcluster.Agent, "node-x"), "may ask for \"imp-agent.node-x\" only"},
		{"no node claim", "", pki.AgentDNSName("node-x"), w.cl.As(t, testcluster.Agent), "names no node"},
		{"not the agent", "", pki.AgentDNSName("node-x"), w.cl.Config, "not the agents' identity"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			csr := request(t, tc.as, tc.asks)
			msg := denied(csr)
			switch {
			case tc.deny == "" && msg != "":
				t.Fatalf("denied: %s", msg)
			case tc.deny != "" && !strings.Contains(msg, tc.deny):
				t.Fatalf("want denied with %q; got %q, certificate %d bytes", tc.deny, msg, len(csr.Status.Certificate))
			case tc.deny == "":
				leaf, err := x509.ParseCertificate(mustPEM(t, csr.Status.Certificate))
				if err != nil || !slices.Equal(leaf.DNSNames, []string{tc.asks}) || !leaf.PublicKey.(*ecdsa.PublicKey).Equal(&key.PublicKey) {
					t.Fatalf("signed %v for the wrong name or key: %v", leaf.DNSNames, err)
				}
			}
		})
	}
}

func mustPEM(t *testing.T, b []byte) []byte {
	t.Helper()
	p, _ := pem.Decode(b)
	if p == nil {
		t.Fatal("no PEM")
	}
	return p.Bytes
}

// The subresource server reaches a node's agent only if it presents that node's certificate:
// another node's agent (or root there, with its key) cannot answer for it.
func TestOnlyTheNodesOwnAgentIsReached(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	var caSecret corev1.Secret
	if err := w.cl.Client.Get(ctx, types.NamespacedName{Namespace: subresourcestest.CANamespace, Name: pki.CASecret}, &caSecret); err != nil {
		t.Fatal(err)
	}
	ca := pki.Pair{Cert: caSecret.Data["tls.crt"], Key: caSecret.Data["tls.key"]}
	rot := &pki.Rotator{Client: w.cl.Client, Reader: w.cl.Client, Namespace: testcluster.ChartNamespace, CANamespace: subresourcestest.CANamespace,
		Service: "imp-subresources", Clock: clocktesting.NewFakePassiveClock(time.Now()), Log: logr.Discard()}
	if err := rot.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	// node-y's agent, with the certificate node-y may get.
	y, err := pki.Issue(ca, pki.Request{CommonName: pki.AgentName, DNSNames: []string{pki.AgentDNSName("node-y")}, Server: true, Lifetime: time.Hour}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(y.Cert, y.Key)
	if err != nil {
		t.Fatal(err)
	}
	l, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequireAnyClientCert})
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
			_ = c.(*tls.Conn).Handshake()
			c.Close()
		}
	}()
	for _, tc := range []struct {
		node string
		ok   bool
	}{{"node-y", true}, {"node-x", false}} {
		cfg := rot.AgentClientTLS().Clone()
		cfg.ServerName = pki.AgentDNSName(tc.node)
		c, err := tls.Dial("tcp", l.Addr().String(), cfg)
		if err == nil {
			c.Close()
		}
		if (err == nil) != tc.ok {
			t.Errorf("node-y's agent reached as %s's: %v", tc.node, err)
		}
	}
}

// An agent restarted with a certificate kept from an access CA the operator has since replaced
// serves it at once, and gets a certificate of the current CA straight away: rotating the CA
// takes effect at the agents' restart, as docs/access.md says.
func TestAKeptCertificateOfAnOldCAIsReplaced(t *testing.T) {
	w := newWorld(t) // runs the signer
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	node := "kept-" + w.nsA[len(w.nsA)-5:]
	old, err := pki.NewCA("an old access CA", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	p, err := pki.Issue(old, pki.Request{CommonName: pki.AgentName, DNSNames: []string{pki.AgentDNSName(node)}, Server: true, Lifetime: time.Hour}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, access.KeptFile), slices.Concat(p.Cert, old.Cert, p.Key), 0o600); err != nil {
		t.Fatal(err)
	}
	agentClient, err := client.New(w.cl.AsNode(t, testcluster.Agent, node), client.Options{Scheme: w.cl.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	s := &access.Server{Addr: addr, ClientName: pki.ClientName, Handler: http.NotFoundHandler(), Log: logr.Discard(),
		CSR: &access.CSR{Client: agentClient, Node: node, Dir: dir, Poll: 50 * time.Millisecond}}
	go func() { _ = s.Start(ctx) }()

	var caSecret corev1.Secret
	if err := w.cl.Client.Get(ctx, types.NamespacedName{Namespace: subresourcestest.CANamespace, Name: pki.CASecret}, &caSecret); err != nil {
		t.Fatal(err)
	}
	issuer := func(roots []byte) (string, error) {
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(roots)
		var got string
		c, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: pool, ServerName: pki.AgentDNSName(node), MinVersion: tls.VersionTLS13,
			VerifyConnection: func(cs tls.ConnectionState) error { got = cs.PeerCertificates[0].Issuer.CommonName; return nil }})
		if err != nil && got == "" {
			return "", err
		}
		if c != nil {
			c.Close()
		}
		return got, nil
	}
	// At once: the kept certificate (the handshake then fails on the missing client
	// certificate, after the server's was verified).
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		got, err := issuer(old.Cert)
		if got == "an old access CA" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the restarted endpoint did not serve its kept certificate: %q %v", got, err)
		}
	}
	// Then the current CA's.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		got, err := issuer(caSecret.Data["tls.crt"])
		if got != "" && got != "an old access CA" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the endpoint still serves the old CA's certificate: %q %v", got, err)
		}
	}
	// And it keeps the new one for its next restart.
	if b, err := os.ReadFile(filepath.Join(dir, access.KeptFile)); err != nil || bytes.Contains(b, old.Cert) {
		t.Errorf("the kept file still holds the old CA (%v)", err)
	}
}

// TestStreamsAreCapped: a user with view rights opens followed logs, each held open: past
// DefaultMaxStreamsPerVM to one VM the next is refused 429 naming the VM, for another user
// too, until one closes; past DefaultMaxStreamsPerUser over two VMs the user's next is refused
// naming the user.
func TestStreamsAreCapped(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	viewer := w.user(t, "vicky", "imp-view")
	other := w.user(t, "olga", "imp-view")
	rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: w.nsB, Name: "vicky-imp-view"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "imp-view"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: "vicky"}}}
	if err := w.cl.Client.Create(ctx, rb); err != nil {
		t.Fatal(err)
	}
	follow := func(cfg *rest.Config, ns string) (*http.Response, error) {
		hc, err := rest.HTTPClientFor(cfg)
		if err != nil {
			return nil, err
		}
		resp, err := hc.Get(strings.TrimSuffix(cfg.Host, "/") + w.path(ns, "log") + "?follow=true")
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { resp.Body.Close() })
		return resp, nil
	}
	refusal := func(resp *http.Response) string {
		if resp.StatusCode == http.StatusOK {
			return "200: a stream, served"
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Sprintf("%d %s", resp.StatusCode, b)
	}
	var open []*http.Response
	for i := range subresources.DefaultMaxStreamsPerVM {
		resp, err := follow(viewer, w.nsA)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("stream %d: %v %v", i, err, resp)
		}
		open = append(open, resp)
	}
	for _, cfg := range []*rest.Config{viewer, other} {
		resp, err := follow(cfg, w.nsA)
		if err != nil {
			t.Fatal(err)
		}
		if got := refusal(resp); resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(got, "ImpVM "+w.nsA+"/vm has 32 streams open") {
			t.Errorf("a stream past the VM's bound: %s", got)
		}
	}
	// 32 to B too: vicky's 64, her bound, and the next is refused for her.
	for i := range subresources.DefaultMaxStreamsPerVM {
		resp, err := follow(viewer, w.nsB)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("stream %d to B: %v %v", i, err, resp)
		}
	}
	resp, err := follow(viewer, w.nsB)
	if err != nil {
		t.Fatal(err)
	}
	if got := refusal(resp); resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(got, "user vicky has 64 streams open") {
		t.Errorf("a stream past the user's bound: %s", got)
	}
	// One of vicky's to A closes: olga's is served.
	open[0].Body.Close()
	// The subresource server sees the close when its copy next fails: a moment.
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := follow(other, w.nsA)
		if err == nil && resp.StatusCode == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after one closed, another is still refused: %v %v", err, resp)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestIdleVMsWakeForASession (issue 49): an exec in a VM suspended because it was idle wakes it
// (its Idle suspension deleted), waits for it to run, and runs; a VM a person suspended is not
// woken by a session.
func TestIdleVMsWakeForASession(t *testing.T) {
	w := newWorld(t)
	alice := w.user(t, "alice", "imp-edit", "imp-view")
	ctx := context.Background()
	key := types.NamespacedName{Namespace: w.nsA, Name: "vm"}
	suspend := func(reason string) {
		t.Helper()
		if err := w.cl.Client.Create(ctx, &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: w.nsA, Name: "vm"},
			Spec: impv1.ImpVMSuspensionSpec{Reason: reason}}); err != nil {
			t.Fatal(err)
		}
		vm := &impv1.ImpVM{}
		if err := w.cl.Client.Get(ctx, key, vm); err != nil {
			t.Fatal(err)
		}
		vm.Status.Phase, vm.Status.Suspension = impv1.VMSuspended, &impv1.SuspensionStatus{Reason: reason}
		vm.Status.Runtime = &impv1.RuntimeStatus{State: impv1.RuntimeSuspended}
		if err := w.cl.Client.Status().Update(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	gone := func() bool {
		return apierrors.IsNotFound(w.cl.Client.Get(ctx, key, &impv1.ImpVMSuspension{}))
	}
	// The operator and the agent, resuming the VM once its suspension is gone.
	resumed := make(chan struct{})
	suspend(impv1.SuspendReasonIdle)
	go func() {
		defer close(resumed)
		for !gone() {
			time.Sleep(20 * time.Millisecond)
		}
		vm := &impv1.ImpVM{}
		_ = w.cl.Client.Get(ctx, key, vm)
		vm.Status.Phase, vm.Status.Suspension = impv1.VMRunning, nil
		vm.Status.Runtime = &impv1.RuntimeStatus{State: impv1.RuntimeRunning, GuestReady: true}
		_ = w.cl.Client.Status().Update(ctx, vm)
	}()
	// kubectl imp exec, as alice: it says it wakes the VM, which runs the command.
	var out, errOut bytes.Buffer
	cmd := kubectlimp.NewCommand(strings.NewReader(""), &out, &errOut)
	cmd.SetArgs([]string{"--kubeconfig", w.cl.Kubeconfig(t), "--as", "alice", "-n", w.nsA, "exec", "vm", "--", "sh", "-c", "echo awake"})
	if err := cmd.Execute(); err != nil || out.String() != "awake\n" || !strings.Contains(errOut.String(), "ImpVM vm is suspended because it was idle: waking it.") {
		t.Errorf("kubectl imp exec in the idle-suspended VM: %q, %v; stderr %q", out.String(), err, errOut.String())
	}
	select {
	case <-resumed:
	case <-time.After(30 * time.Second):
		t.Fatal("the session did not wake the VM: its Idle suspension is still there")
	}

	// Reading its log (the view role may) never wakes it.
	suspend(impv1.SuspendReasonIdle)
	bob := w.user(t, "bob", "imp-view")
	_, _ = w.log(bob, w.nsA)
	if gone() {
		t.Error("a log read woke the idle-suspended VM")
	}
	if err := w.cl.Client.Delete(ctx, &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: w.nsA, Name: "vm"}}); err != nil {
		t.Fatal(err)
	}
	for !gone() {
		time.Sleep(20 * time.Millisecond)
	}

	// A person's suspension stays: the session is not proxied to a running VM (the test's
	// agent would run it; the server must not have woken it first).
	suspend(impv1.SuspendReasonUser)
	_, _ = w.exec(alice, w.nsA, "", "true")
	if gone() {
		t.Error("a session deleted a User suspension")
	}
}
