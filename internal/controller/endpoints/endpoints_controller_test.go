package endpoints_test

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/endpoints"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// start runs the endpoints reconciler alone, as the operator's ServiceAccount with the chart's
// authority.
func start(t *testing.T, c *testcluster.Cluster) {
	mgr, err := ctrl.NewManager(c.As(t, testcluster.Operator), ctrl.Options{
		Scheme: c.Scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
		Cache:      operator.CacheOptions(operator.Options{}),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := (&endpoints.Reconciler{Client: mgr.GetClient()}).SetupWithManager(mgr); err != nil {
		t.Fatal(err)
	}
	testcluster.RunManager(t, mgr)
}

type world struct {
	t    *testing.T
	c    client.Client
	ns   string
	node string // its ImpNode has the block 100.72.0.0/24
}

// vm creates a VM labelled app=app declaring ports ("name:port"), and reports it placed and
// running at endpoint (empty: not yet given one), ready or not.
func (w *world) vm(ns, name, app string, ports []string, endpoint string, ready bool) {
	w.t.Helper()
	ctx := context.Background()
	v := &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"app": app}},
		Spec: impv1.ImpVMSpec{Image: "registry.test/web:1",
			Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("256Mi"))}},
	}
	for _, p := range ports {
		n, num, _ := strings.Cut(p, ":")
		var port int32
		fmt.Sscan(num, &port)
		v.Spec.Ports = append(v.Spec.Ports, impv1.VMPort{Name: n, Port: port, Protocol: corev1.ProtocolTCP})
	}
	if err := w.c.Create(ctx, v); err != nil {
		w.t.Fatal(err)
	}
	w.report(ns, name, endpoint, ready)
}

func (w *world) report(ns, name, endpoint string, ready bool) {
	w.t.Helper()
	v := &impv1.ImpVM{}
	if err := w.c.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, v); err != nil {
		w.t.Fatal(err)
	}
	v.Status.NodeName, v.Status.Instance = w.node, 1
	v.Status.Runtime = &impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeRunning, GuestReady: true, Endpoint: endpoint, Ports: v.Spec.Ports}
	st := metav1.ConditionFalse
	if ready {
		st = metav1.ConditionTrue
	}
	meta.SetStatusCondition(&v.Status.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: st, Reason: "Test"})
	if err := w.c.Status().Update(context.Background(), v); err != nil {
		w.t.Fatal(err)
	}
}

// endpoints are the Service's IMP endpoints: "address:port[,port…] name ready/serving/terminating".
func (w *world) endpoints(svc string) []string {
	var l discoveryv1.EndpointSliceList
	if err := w.c.List(context.Background(), &l, client.InNamespace(w.ns), client.MatchingLabels{discoveryv1.LabelServiceName: svc}); err != nil {
		w.t.Fatal(err)
	}
	var out []string
	for _, s := range l.Items {
		if s.Labels[discoveryv1.LabelManagedBy] != endpoints.ManagedBy || len(s.OwnerReferences) != 1 || s.OwnerReferences[0].Name != svc {
			out = append(out, "a slice not IMP's: "+s.Name)
			continue
		}
		var ports []string
		for _, p := range s.Ports {
			ports = append(ports, fmt.Sprintf("%s=%d", *p.Name, *p.Port))
		}
		sort.Strings(ports)
		for _, e := range s.Endpoints {
			c := e.Conditions
			out = append(out, fmt.Sprintf("%s:%s %s %v/%v/%v %s", e.Addresses[0], strings.Join(ports, ","), e.TargetRef.Name,
				*c.Ready, *c.Serving, *c.Terminating, ptr.Deref(e.Hostname, "")))
		}
	}
	sort.Strings(out)
	return out
}

func eventually(t *testing.T, f any) AsyncAssertion {
	return NewWithT(t).Eventually(f).WithTimeout(30 * time.Second).WithPolling(50 * time.Millisecond)
}

// TestServicesSelectVMs: a Service gets its namespace's selected VMs that declare its ports,
// grouped by the numbers its named targetPort resolves to, ready only when Ready and not
// terminating; relabelled, deleting, foreign-namespace and portless VMs are handled; a slice
// someone edits is put back; the Service's going takes its slices.
func TestServicesSelectVMs(t *testing.T) {
	c := testcluster.Require(t, shared)
	w := &world{t: t, c: c.Client, ns: c.Namespace(t)}
	w.node = w.ns + "-node"
	other := c.Namespace(t)
	start(t, c)
	ctx := context.Background()
	block := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: w.node}, Spec: impv1.ImpNodeSpec{EndpointCIDR: "100.72.0.0/24"}}
	if err := c.Client.Create(ctx, block); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Client.Delete(context.Background(), block) })
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "web"}, Spec: corev1.ServiceSpec{
		Selector: map[string]string{"app": "web"},
		Ports: []corev1.ServicePort{
			{Name: "http", Port: 80, TargetPort: intstr.FromString("http")},
			{Name: "metrics", Port: 9090, TargetPort: intstr.FromInt32(9090)},
		},
	}}
	if err := c.Client.Create(ctx, svc); err != nil {
		t.Fatal(err)
	}
	w.vm(w.ns, "a", "web", []string{"http:8080"}, "100.72.0.2", true)
	w.vm(w.ns, "b", "web", []string{"http:8081", "metrics:9090"}, "100.72.0.3", false)
	w.vm(w.ns, "booting", "web", []string{"http:8080"}, "", false)     // no endpoint yet
	w.vm(w.ns, "portless", "web", nil, "100.72.0.4", true)             // declares none of the ports
	w.vm(w.ns, "db", "db", []string{"http:8080"}, "100.72.0.5", true)  // not selected
	w.vm(other, "a", "web", []string{"http:8080"}, "100.72.0.6", true) // another namespace
	eventually(t, func() []string { return w.endpoints("web") }).Should(Equal([]string{
		"100.72.0.2:http=8080 a true/true/false a",
		"100.72.0.3:http=8081,metrics=9090 b false/false/false b",
	}))

	// b's spec drops its metrics port: its run still forwards it, so its slice keeps it until
	// the next run reports its ports.
	b := &impv1.ImpVM{}
	if err := c.Client.Get(ctx, types.NamespacedName{Namespace: w.ns, Name: "b"}, b); err != nil {
		t.Fatal(err)
	}
	b.Spec.Ports = b.Spec.Ports[:1]
	if err := c.Client.Update(ctx, b); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Consistently(func() []string { return w.endpoints("web") }).WithTimeout(2 * time.Second).Should(ContainElement(
		"100.72.0.3:http=8081,metrics=9090 b false/false/false b"))
	// b passes its readiness (a new report, of the run's ports as the spec now says); a is
	// relabelled away.
	b.Spec.Ports = append(b.Spec.Ports, impv1.VMPort{Name: "metrics", Port: 9090, Protocol: corev1.ProtocolTCP})
	if err := c.Client.Update(ctx, b); err != nil {
		t.Fatal(err)
	}
	w.report(w.ns, "b", "100.72.0.3", true)
	a := &impv1.ImpVM{}
	if err := c.Client.Get(ctx, types.NamespacedName{Namespace: w.ns, Name: "a"}, a); err != nil {
		t.Fatal(err)
	}
	a.Labels["app"] = "old"
	if err := c.Client.Update(ctx, a); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() []string { return w.endpoints("web") }).Should(Equal([]string{
		"100.72.0.3:http=8081,metrics=9090 b true/true/false b",
	}))

	// Suspended because it was idle, b stays ready: what arrives wakes it. Suspended by a
	// person, it is terminating.
	for _, state := range []impv1.RuntimeState{impv1.RuntimeSuspending, impv1.RuntimeSuspended} {
		b := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, types.NamespacedName{Namespace: w.ns, Name: "b"}, b); err != nil {
			t.Fatal(err)
		}
		b.Status.Suspension = &impv1.SuspensionStatus{Reason: impv1.SuspendReasonIdle}
		b.Status.Runtime.State, b.Status.Runtime.GuestReady = state, false
		meta.SetStatusCondition(&b.Status.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: "Suspended"})
		if err := c.Client.Status().Update(ctx, b); err != nil {
			t.Fatal(err)
		}
		NewWithT(t).Consistently(func() []string { return w.endpoints("web") }).WithTimeout(time.Second).Should(Equal([]string{
			"100.72.0.3:http=8081,metrics=9090 b true/true/false b"}), string(state))
	}
	for _, reason := range []string{impv1.SuspendReasonIdle, impv1.SuspendReasonUser} {
		b := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, types.NamespacedName{Namespace: w.ns, Name: "b"}, b); err != nil {
			t.Fatal(err)
		}
		b.Status.Suspension = &impv1.SuspensionStatus{Reason: reason}
		b.Status.Runtime.State, b.Status.Runtime.GuestReady = impv1.RuntimeSuspended, false
		meta.SetStatusCondition(&b.Status.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: "Suspended"})
		if err := c.Client.Status().Update(ctx, b); err != nil {
			t.Fatal(err)
		}
		want := "100.72.0.3:http=8081,metrics=9090 b true/true/false b"
		if reason == impv1.SuspendReasonUser {
			want = "" // a suspended run of a person's: no endpoint
		}
		eventually(t, func() string { return strings.Join(w.endpoints("web"), "|") }).Should(Equal(want), reason)
	}
	w.report(w.ns, "b", "100.72.0.3", true)
	b = &impv1.ImpVM{}
	_ = c.Client.Get(ctx, types.NamespacedName{Namespace: w.ns, Name: "b"}, b)
	b.Status.Suspension = nil
	if err := c.Client.Status().Update(ctx, b); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() []string { return w.endpoints("web") }).Should(Equal([]string{
		"100.72.0.3:http=8081,metrics=9090 b true/true/false b",
	}))

	// A VM being deleted stays, terminating and not ready, until it is gone.
	w.vm(w.ns, "c", "web", []string{"http:8080"}, "100.72.0.7", true)
	cvm := &impv1.ImpVM{}
	_ = c.Client.Get(ctx, types.NamespacedName{Namespace: w.ns, Name: "c"}, cvm)
	cvm.Finalizers = []string{"imp.test/hold"}
	if err := c.Client.Update(ctx, cvm); err != nil {
		t.Fatal(err)
	}
	if err := c.Client.Delete(ctx, cvm); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() []string { return w.endpoints("web") }).Should(Equal([]string{
		"100.72.0.3:http=8081,metrics=9090 b true/true/false b",
		"100.72.0.7:http=8080 c false/true/true c",
	}))
	_ = c.Client.Get(ctx, types.NamespacedName{Namespace: w.ns, Name: "c"}, cvm)
	cvm.Finalizers = nil
	if err := c.Client.Update(ctx, cvm); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() []string { return w.endpoints("web") }).Should(HaveLen(1))

	// Someone adds an endpoint to IMP's slice: it is put back.
	var l discoveryv1.EndpointSliceList
	if err := c.Client.List(ctx, &l, client.InNamespace(w.ns), client.MatchingLabels{discoveryv1.LabelManagedBy: endpoints.ManagedBy}); err != nil || len(l.Items) != 1 {
		t.Fatalf("slices %v, %v", l.Items, err)
	}
	s := l.Items[0]
	s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{"10.0.0.1"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true), Serving: ptr.To(true), Terminating: ptr.To(false)},
		TargetRef: &corev1.ObjectReference{Name: "intruder"}})
	if err := c.Client.Update(ctx, &s); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() []string { return w.endpoints("web") }).Should(Equal([]string{"100.72.0.3:http=8081,metrics=9090 b true/true/false b"}))

	// The Service goes: so do its slices. A Service in the other namespace gets only its own VM.
	if err := c.Client.Delete(ctx, svc); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() []string { return w.endpoints("web") }).Should(BeEmpty())
	svc2 := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: other, Name: "web"}, Spec: corev1.ServiceSpec{
		Selector: map[string]string{"app": "web"}, ClusterIP: corev1.ClusterIPNone,
		Ports: []corev1.ServicePort{{Name: "http", Port: 8080}},
	}}
	if err := c.Client.Create(ctx, svc2); err != nil {
		t.Fatal(err)
	}
	w2 := &world{t: t, c: c.Client, ns: other, node: w.node}
	eventually(t, func() []string { return w2.endpoints("web") }).Should(Equal([]string{"100.72.0.6:http=8080 a true/true/false a"}))
}
