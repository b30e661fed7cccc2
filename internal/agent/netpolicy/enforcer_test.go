package netpolicy_test

import (
	"context"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/netpolicy"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// setter records the policies set, by VM, as lines of what each side allows.
type setter struct {
	mu  sync.Mutex
	got map[string]string
}

func (s *setter) SetPolicy(_ hostnet.Network, uid string, _ netip.Addr, p hostnet.Policy) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got[uid] = describe(p)
	return nil
}

func (s *setter) of(uid string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.got[uid]
}

func describe(p hostnet.Policy) string {
	side := func(as []hostnet.Allow) string {
		if as == nil {
			return "open"
		}
		var out []string
		for _, a := range as {
			for _, n := range a.Network {
				out = append(out, "net "+n.String())
			}
			for _, o := range a.Outside {
				out = append(out, "out "+o.String())
			}
		}
		slices.Sort(out)
		return "[" + strings.Join(out, " ") + "]"
	}
	return "in " + side(p.Ingress) + " eg " + side(p.Egress)
}

// networks reads a VM's ImpNetwork as the agent's network controller does.
type networks struct{ c client.Client }

func (n networks) HostNetwork(ctx context.Context, vm *impv1.ImpVM) (hostnet.Network, error) {
	net := &impv1.ImpNetwork{}
	if err := n.c.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: vm.Spec.NetworkRef.Name}, net); err != nil {
		return hostnet.Network{}, err
	}
	p, _ := net.Spec.Prefix()
	return hostnet.Network{Namespace: net.Namespace, Name: net.Name, UID: string(net.UID), Prefix: p}, nil
}

// TestEnforcerFollowsTheAPI: the agent's enforcer, with the chart's authority for the agent,
// sets a VM's policy from the API's objects and follows each kind of change — a policy made,
// a pod relabelled, a namespace relabelled, a peer VM relabelled (its address), the policy
// deleted, a Service's endpoints — each waited for (how long each took is logged).
func TestEnforcerFollowsTheAPI(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	other := ns + "-other"
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(c.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: other, Labels: map[string]string{"team": "b"}}}))
	t.Cleanup(func() {
		_ = c.Client.Delete(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: other}})
	})
	node := "np-" + ns
	net := &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.60.0.0/24"}}
	must(c.Client.Create(ctx, net))
	web := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "web", Labels: map[string]string{"app": "web"}},
		Spec: impv1.ImpVMSpec{Image: "registry.test/app:1", NetworkRef: &impv1.NetworkReference{Name: "net"},
			Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}}}
	must(c.Client.Create(ctx, web))
	web.Status.NodeName, web.Status.IP = node, "10.60.0.2"
	must(c.Client.Status().Update(ctx, web))
	db := &impv1.ImpIPAddress{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: impv1.IPAddressName("net", "10.60.0.3")},
		Spec: impv1.ImpIPAddressSpec{Network: "net", Address: "10.60.0.3", VMRef: impv1.VMReference{Name: "db", UID: "db-uid"}, NodeName: "elsewhere",
			VMLabels: map[string]string{"app": "db"}}}
	must(c.Client.Create(ctx, db))
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: other, Name: "client", Labels: map[string]string{"app": "client"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "registry.test/c:1"}}}}
	must(c.Client.Create(ctx, pod))
	pod.Status.Phase, pod.Status.PodIPs = corev1.PodRunning, []corev1.PodIP{{IP: "192.168.5.5"}}
	must(c.Client.Status().Update(ctx, pod))

	mgr, err := ctrl.NewManager(c.AsNode(t, testcluster.Agent, node), ctrl.Options{Scheme: c.Scheme, Cache: agent.CacheOptions(node),
		Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0", Controller: config.Controller{SkipNameValidation: ptr.To(true)}})
	must(err)
	fleet, err := cache.New(mgr.GetConfig(), cache.Options{Scheme: mgr.GetScheme(), Mapper: mgr.GetRESTMapper(),
		ByObject: map[client.Object]cache.ByObject{&impv1.ImpIPAddress{}: {}}})
	must(err)
	must(mgr.Add(fleet))
	set := &setter{got: map[string]string{}}
	e := &netpolicy.Enforcer{Client: mgr.GetClient(), Net: set, Networks: networks{mgr.GetClient()}, Fleet: fleet}
	must(e.SetupWithManager(mgr))
	testcluster.RunManager(t, mgr)

	uid := string(web.UID)
	within := func(what, want string) {
		t.Helper()
		start := time.Now()
		for time.Since(start) < 10*time.Second {
			if set.of(uid) == want {
				// Logged, not asserted: how fast is the bench's and the e2e's to measure.
				t.Logf("%s: set in %v", what, time.Since(start).Round(time.Millisecond))
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Fatalf("%s: the VM's policy is %q, want %q", what, set.of(uid), want)
	}
	within("no policy", "in open eg open")

	pol := &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "web"},
		Spec: networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{
				{PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "db"}}},
				{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "b"}},
					PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "client"}}},
			}}}}}
	must(c.Client.Create(ctx, pol))
	within("a policy made", "in [net 10.60.0.3/32 out 192.168.5.5/32] eg open")

	pod.Labels = map[string]string{"app": "stranger"}
	must(c.Client.Update(ctx, pod))
	within("the pod relabelled", "in [net 10.60.0.3/32] eg open")
	pod.Labels = map[string]string{"app": "client"}
	must(c.Client.Update(ctx, pod))
	within("the pod labelled back", "in [net 10.60.0.3/32 out 192.168.5.5/32] eg open")

	ons := &corev1.Namespace{}
	must(c.Client.Get(ctx, types.NamespacedName{Name: other}, ons))
	ons.Labels["team"] = "c"
	must(c.Client.Update(ctx, ons))
	within("the pod's namespace relabelled", "in [net 10.60.0.3/32] eg open")

	db.Spec.VMLabels = map[string]string{"app": "cache"}
	must(c.Client.Update(ctx, db))
	within("the peer VM relabelled", "in [] eg open")

	must(c.Client.Delete(ctx, pol))
	within("the policy deleted", "in open eg open")

	// Egress to the client pod: its Service's ClusterIP too, once the Service's one endpoint
	// is the pod; not when another endpoint joins that the policy does not allow.
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: other, Name: "client"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}}}
	must(c.Client.Create(ctx, svc))
	vip := svc.Spec.ClusterIP
	slice := &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: other, Name: "client-1", Labels: map[string]string{discoveryv1.LabelServiceName: "client"}},
		AddressType: discoveryv1.AddressTypeIPv4, Ports: []discoveryv1.EndpointPort{{Name: ptr.To("http"), Protocol: ptr.To(corev1.ProtocolTCP), Port: ptr.To[int32](8080)}},
		Endpoints: []discoveryv1.Endpoint{{Addresses: []string{"192.168.5.5"}}}}
	must(c.Client.Create(ctx, slice))
	ons.Labels["team"] = "b"
	must(c.Client.Update(ctx, ons))
	out := &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "out"},
		Spec: networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeEgress},
			Egress: []networkingv1.NetworkPolicyEgressRule{{To: []networkingv1.NetworkPolicyPeer{
				{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "b"}}}}}}}}
	must(c.Client.Create(ctx, out))
	within("egress to the pod's namespace", "in open eg [out "+vip+"/32 out 192.168.5.5/32]")
	slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{Addresses: []string{"192.168.9.9"}})
	must(c.Client.Update(ctx, slice))
	within("an endpoint the policy does not allow joins", "in open eg [out 192.168.5.5/32]")
}
