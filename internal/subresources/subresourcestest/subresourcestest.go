// Package subresourcestest serves the ImpVM subresources through a test's API server as a
// cluster does: the APIService, the operator's subresource server under the operator's
// identity and certificates, and one node's agent endpoint at 127.0.0.1.
package subresourcestest

import (
	"context"
	"io"
	"log"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/syscode-labs/imp/internal/agent/access"
	"github.com/syscode-labs/imp/internal/agentcsr"
	"github.com/syscode-labs/imp/internal/controller/idle"
	"github.com/syscode-labs/imp/internal/pki"
	"github.com/syscode-labs/imp/internal/subresources"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// APIService is the chart's, and CANamespace the namespace of its access CA.
const (
	APIService  = "v1alpha1.subresources.imp.dev"
	CANamespace = testcluster.ChartNamespace + "-access"
)

// Serve serves the subresources of vms, the VMs of node (created if missing, its address set
// to 127.0.0.1), through cl's API server, which must run with testcluster.WithFrontProxy. It
// returns the subresource server's port once the API server serves the group; everything
// stops when the test ends.
func Serve(t testing.TB, cl *testcluster.Cluster, node string, vms access.VMs) int {
	t.Helper()
	ctx := context.Background()
	admin := cl.Client
	caNS := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: CANamespace}}
	if err := admin.Create(ctx, caNS); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	cl.InstallChartObjects(t, "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount")
	opClient, err := client.New(cl.As(t, testcluster.Operator), client.Options{Scheme: cl.Scheme})
	if err != nil {
		t.Fatal(err)
	}

	// The subresource server, on 127.0.0.1: a Service of type ExternalName "localhost" points
	// the API server at it (no kube-proxy here), under the Service's name for TLS.
	subL, subPort := listen(t)
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: testcluster.ChartNamespace, Name: "imp-subresources"},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeExternalName, ExternalName: "localhost"}}
	if err := admin.Create(ctx, svc); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	apisvc := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
		"metadata": map[string]any{"name": APIService},
		"spec": map[string]any{"group": subresources.Group, "version": subresources.Version, "groupPriorityMinimum": int64(1000), "versionPriority": int64(15),
			"service": map[string]any{"namespace": testcluster.ChartNamespace, "name": "imp-subresources", "port": int64(subPort)}},
	}}
	if err := admin.Create(ctx, apisvc); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Delete(context.Background(), apisvc) })

	rot := &pki.Rotator{Client: opClient, Reader: opClient, Namespace: testcluster.ChartNamespace, CANamespace: CANamespace, Service: "imp-subresources",
		APIService: APIService, Clock: clock.RealClock{}, Log: logr.Discard()}
	if err := rot.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	fp := &subresources.FrontProxy{}
	if err := fp.Load(ctx, opClient); err != nil {
		t.Fatal(err)
	}
	agentL, agentPort := listen(t)
	srv := &subresources.Server{Reader: opClient, FrontProxy: fp, AgentTLS: rot.AgentClientTLS(), AgentPort: agentPort, Log: logr.Discard(),
		Waker: idle.Waker{Client: opClient}}
	hs := &http.Server{Handler: srv, TLSConfig: subresources.TLSConfig(rot.ServingCertificate), ErrorLog: quiet()}
	go func() { _ = hs.ServeTLS(subL, "", "") }()
	t.Cleanup(func() { hs.Close() })

	// The node, at 127.0.0.1.
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}
	if err := admin.Create(ctx, n); apierrors.IsAlreadyExists(err) {
		err = admin.Get(ctx, types.NamespacedName{Name: node}, n)
	} else if err == nil {
		t.Cleanup(func() { _ = admin.Delete(context.Background(), n) })
	}
	if err != nil {
		t.Fatal(err)
	}
	n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "127.0.0.1"}}
	if err := admin.Status().Update(ctx, n); err != nil {
		t.Fatal(err)
	}

	// The agents' certificate signer, as the operator runs it, and the node's agent endpoint,
	// which asks it for its node's certificate as the node's agent.
	mgr, err := ctrl.NewManager(cl.As(t, testcluster.Operator), ctrl.Options{Scheme: cl.Scheme, Metrics: metricsserver.Options{BindAddress: "0"},
		Controller: config.Controller{SkipNameValidation: ptr.To(true)}})
	if err != nil {
		t.Fatal(err)
	}
	signer := &agentcsr.Reconciler{Client: mgr.GetClient(), CA: rot.CA, AgentUser: "system:serviceaccount:" + testcluster.ChartNamespace + ":" + testcluster.Agent, Clock: clock.RealClock{}}
	if err := signer.SetupWithManager(mgr); err != nil {
		t.Fatal(err)
	}
	mctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = mgr.Start(mctx) }()
	agentClient, err := client.New(cl.AsNode(t, testcluster.Agent, node), client.Options{Scheme: cl.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	agentL.Close()
	as := &access.Server{Addr: agentL.Addr().String(), ClientName: pki.ClientName, CSR: &access.CSR{Client: agentClient, Node: node, Poll: 50 * time.Millisecond},
		Handler: access.Handler(vms, logr.Discard()), Log: logr.Discard()}
	go func() { _ = as.Start(mctx) }()
	t.Cleanup(func() { stop(); <-done })
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		c, err := net.Dial("tcp", agentL.Addr().String())
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent endpoint does not serve: %v", err)
		}
	}

	// The API server serves the group once the APIService is available.
	dc := discovery.NewDiscoveryClientForConfigOrDie(cl.Config)
	deadline := time.Now().Add(90 * time.Second)
	for {
		_, err := dc.ServerResourcesForGroupVersion(subresources.Group + "/" + subresources.Version)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the API server does not serve %s: %v", APIService, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
	return subPort
}

// listen is a TCP listener on a free port of 127.0.0.1.
func listen(t testing.TB) (net.Listener, int) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l, l.Addr().(*net.TCPAddr).Port
}

// quiet drops the servers' handshake errors: the API server tries the subresource server
// before the APIService's caBundle names its CA.
func quiet() *log.Logger { return log.New(io.Discard, "", 0) }
