package subresources_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/client-go/transport/spdy"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/access"
	"github.com/syscode-labs/imp/internal/guestsession/guesttest"
	"github.com/syscode-labs/imp/internal/pki"
	"github.com/syscode-labs/imp/internal/subresources"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var (
	shared   *testcluster.Cluster
	auditLog string
	fpDir    string
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "imp-subresources-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer os.RemoveAll(dir)
	fpDir = dir
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

const apiService = "v1alpha1.subresources.imp.dev"

// listen is a TCP listener on a free port of 127.0.0.1.
func listen(t *testing.T) (net.Listener, int) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l, l.Addr().(*net.TCPAddr).Port
}

// world is the whole path: the API server with its front proxy, the subresource server as
// the operator runs it (its identity, its certificates), and one node's agent endpoint whose
// VMs' guests run in this process.
type world struct {
	cl       *testcluster.Cluster
	nsA, nsB string
	uids     map[types.NamespacedName]types.UID
	vms      *guesttest.VMs
	subPort  int
}

func newWorld(t *testing.T) *world {
	t.Helper()
	cl := testcluster.Require(t, shared)
	ctx := context.Background()
	admin := cl.Client
	w := &world{cl: cl, nsA: cl.Namespace(t), nsB: cl.Namespace(t), uids: map[types.NamespacedName]types.UID{}}
	// The chart's roles, and the operator's.
	cl.InstallChartObjects(t, "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount")
	operator := cl.As(t, testcluster.Operator)
	opClient, err := client.New(operator, client.Options{Scheme: cl.Scheme})
	if err != nil {
		t.Fatal(err)
	}

	// The subresource server, on 127.0.0.1: a Service of type ExternalName "localhost" points
	// the API server at it (no kube-proxy here), under the Service's name for TLS.
	subL, subPort := listen(t)
	w.subPort = subPort
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: testcluster.ChartNamespace, Name: "imp-subresources"},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeExternalName, ExternalName: "localhost"}}
	if err := admin.Create(ctx, svc); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	apisvc := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
		"metadata": map[string]any{"name": apiService},
		"spec": map[string]any{"group": subresources.Group, "version": subresources.Version, "groupPriorityMinimum": int64(1000), "versionPriority": int64(15),
			"service": map[string]any{"namespace": testcluster.ChartNamespace, "name": "imp-subresources", "port": int64(subPort)}},
	}}
	if err := admin.Create(ctx, apisvc); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Delete(context.Background(), apisvc) })

	rot := &pki.Rotator{Client: opClient, Reader: opClient, Namespace: testcluster.ChartNamespace, Service: "imp-subresources",
		APIService: apiService, Clock: clock.RealClock{}, Log: logr.Discard()}
	if err := rot.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	fp := &subresources.FrontProxy{}
	if err := fp.Load(ctx, opClient); err != nil {
		t.Fatal(err)
	}
	agentL, agentPort := listen(t)
	srv := &subresources.Server{Reader: opClient, FrontProxy: fp, AgentTLS: rot.AgentClientTLS(), AgentPort: agentPort, Log: logr.Discard()}
	hs := &http.Server{Handler: srv, TLSConfig: subresources.TLSConfig(rot.ServingCertificate)}
	go func() { _ = hs.ServeTLS(subL, "", "") }()
	t.Cleanup(func() { hs.Close() })

	// A node, at 127.0.0.1, and a VM placed on it in each namespace.
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "sub-node-" + w.nsA[len(w.nsA)-5:]}}
	if err := admin.Create(ctx, node); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Delete(context.Background(), node) })
	node.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "127.0.0.1"}}
	if err := admin.Status().Update(ctx, node); err != nil {
		t.Fatal(err)
	}
	for _, ns := range []string{w.nsA, w.nsB} {
		vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "vm"},
			Spec: impv1.ImpVMSpec{Image: "registry.test/app:1", Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}}}
		if err := admin.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
		vm.Status.NodeName, vm.Status.Phase = node.Name, impv1.VMRunning
		if err := admin.Status().Update(ctx, vm); err != nil {
			t.Fatal(err)
		}
		w.uids[types.NamespacedName{Namespace: ns, Name: "vm"}] = vm.UID
	}

	// The node's agent endpoint, with the certificate the operator issued for agents.
	var agentSecret corev1.Secret
	if err := admin.Get(ctx, types.NamespacedName{Namespace: testcluster.ChartNamespace, Name: pki.AgentSecret}, &agentSecret); err != nil {
		t.Fatal(err)
	}
	certDir := t.TempDir()
	for _, f := range []string{"tls.crt", "tls.key", "ca.crt"} {
		if err := os.WriteFile(filepath.Join(certDir, f), agentSecret.Data[f], 0o600); err != nil {
			t.Fatal(err)
		}
	}
	agentTLS, err := access.TLSConfig(filepath.Join(certDir, "tls.crt"), filepath.Join(certDir, "tls.key"), filepath.Join(certDir, "ca.crt"), pki.ClientName)
	if err != nil {
		t.Fatal(err)
	}
	w.vms = guesttest.NewVMs(t, w.uids)
	as := &http.Server{Handler: access.Handler(w.vms, logr.Discard()), TLSConfig: agentTLS}
	go func() { _ = as.ServeTLS(agentL, "", "") }()
	t.Cleanup(func() { as.Close() })

	// The API server serves the group once the APIService is available.
	dc := discovery.NewDiscoveryClientForConfigOrDie(cl.Config)
	deadline := time.Now().Add(90 * time.Second)
	for {
		_, err := dc.ServerResourcesForGroupVersion(subresources.Group + "/" + subresources.Version)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the API server does not serve %s: %v", apiService, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
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
	}
	cfg := rest.CopyConfig(w.cl.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: name}
	return cfg
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

	// Port-forward.
	u, _, _ := rest.DefaultServerUrlFor(alice)
	u.Path = w.path(w.nsA, "portforward")
	rt, upgrader, err := spdy.RoundTripperFor(alice)
	if err != nil {
		t.Fatal(err)
	}
	stop, ready := make(chan struct{}), make(chan struct{})
	fw, err := portforward.NewOnAddresses(spdy.NewDialer(upgrader, &http.Client{Transport: rt}, "POST", u),
		[]string{"127.0.0.1"}, []string{"0:" + strconv.Itoa(guesttest.EchoPort)}, stop, ready, io.Discard, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 1)
	go func() { errs <- fw.ForwardPorts() }()
	select {
	case <-ready:
	case err := <-errs:
		t.Fatalf("alice's port-forward: %v", err)
	}
	ports, _ := fw.GetPorts()
	c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(ports[0].Local))))
	if err != nil {
		t.Fatal(err)
	}
	msg := bytes.Repeat([]byte("port-forward "), 10000)
	go func() { _, _ = c.Write(msg) }()
	got := make([]byte, len(msg))
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Errorf("echo through alice's port-forward: %v", err)
	}
	c.Close()
	close(stop) // the port-forward's request ends, and only then is it audited
	<-errs

	// The audit log records each access with the user's name.
	want := []string{"alice get impvms/exec A 101", "alice get impvms/exec B 403", "alice create impvms/portforward A 101",
		"victor get impvms/log A 200", "victor get impvms/exec A 403"}
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
