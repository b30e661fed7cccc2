package agent_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/controller/impvm"
	"github.com/syscode-labs/imp/internal/guestsession"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/testcluster"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testnetns"
	"github.com/syscode-labs/imp/internal/testregistry"
)

// TestServicesReachVMs: two tenants' ImpNetworks with the same CIDR on one node (a network
// namespace with its own agent), a web VM in each declaring port 8080 (named http) with an HTTP
// readiness probe; a Service in each namespace selecting it. Each Service's EndpointSlice holds
// its own VM's endpoint address only, ready once the probe passes; from a pod (a namespace
// routed through the node) each endpoint answers with its own VM's greeting on 8080, and the
// undeclared 8081 answers nothing; the node's routes hold no tenant CIDR. The readiness probe
// failing takes the endpoint out of ready; deleting the VM removes it.
func TestServicesReachVMs(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	nsA, nsB := c.Namespace(t), c.Namespace(t)
	vms := map[string]string{nsA: "web-a", nsB: "web-b"}
	sw := newSvcWorld(t, c, vms)
	endpoints, pod, node := sw.endpoints, sw.pod, sw.node
	g := NewWithT(t)
	addr := map[string]string{}
	for ns, name := range vms {
		g.Eventually(func() []string { return endpoints(ns) }).WithTimeout(12*time.Minute).WithPolling(200*time.Millisecond).Should(
			ConsistOf(MatchRegexp(`^100\.72\.\d+\.\d+:8080 `+name+` true$`)), func() string {
				w := sw.world(ns)
				v := w.get(name)
				con := w.console(v)
				if len(con) > 3000 {
					con = con[len(con)-3000:]
				}
				return fmt.Sprintf("VM %s: %+v\nconsole (end):\n%s", name, v.Status, con)
			})
		addr[ns] = strings.Fields(endpoints(ns)[0])[0]
	}
	if addr[nsA] == addr[nsB] {
		t.Fatalf("both VMs have endpoint %s", addr[nsA])
	}
	// The node routes each endpoint address over a transit link, and nothing of the tenants'.
	nh := testnetns.Handle(t, node)
	rs, _ := nh.RouteList(nil, netlink.FAMILY_V4)
	var dsts []string
	for _, r := range rs {
		if r.Dst != nil {
			dsts = append(dsts, r.Dst.String())
			if strings.HasPrefix(r.Dst.String(), "10.93.") {
				t.Errorf("a tenant's route on the node: %s", r.Dst)
			}
		}
	}
	for _, a := range addr {
		ip, _, _ := strings.Cut(a, ":")
		if !slices.Contains(dsts, ip+"/32") {
			t.Fatalf("no route to endpoint %s among %v", ip, dsts)
		}
	}
	for ns, name := range vms {
		g.Eventually(func() string { return get(pod, addr[ns]) }).WithTimeout(time.Minute).Should(Equal("hello from " + name))
		ip, _, _ := strings.Cut(addr[ns], ":")
		if got := get(pod, ip+":8081"); got != "error" {
			t.Errorf("the undeclared port 8081 of %s answered through its endpoint: %q", name, got)
		}
	}

	// Readiness fails: the endpoint stays, not ready, within two probe periods and a report.
	sw.exec(t, nsA, "web-a", "tool-touch", "/dev/imp-unready")
	began := time.Now()
	g.Eventually(func() []string { return endpoints(nsA) }).WithTimeout(time.Minute).WithPolling(50 * time.Millisecond).Should(Equal([]string{addr[nsA] + " web-a false"}))
	t.Logf("readiness failing (period 1s) → endpoint not ready: %v", time.Since(began).Round(time.Millisecond))
	sw.exec(t, nsA, "web-a", "tool-rm", "/dev/imp-unready")
	g.Eventually(func() []string { return endpoints(nsA) }).WithTimeout(time.Minute).WithPolling(50 * time.Millisecond).Should(Equal([]string{addr[nsA] + " web-a true"}))

	// Deleted: its endpoint goes; the other tenant's stays.
	if err := c.Client.Delete(ctx, sw.world(nsA).get("web-a")); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() []string { return endpoints(nsA) }).WithTimeout(3 * time.Minute).Should(BeEmpty())
	g.Eventually(func() string { return get(pod, addr[nsA]) }).WithTimeout(time.Minute).Should(Equal("error"))
	if got := get(pod, addr[nsB]); got != "hello from web-b" {
		t.Errorf("tenant B's VM after A's went: %q", got)
	}

	// Another node (its underlay address the pod's side of the link): the operator gives it a
	// block, and this node routes that block via it.
	other := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: sw.nodeName + "-b"}}
	if err := c.Client.Create(ctx, other); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Client.Delete(context.Background(), other) })
	// A patch, as an agent writes its report: the operator gives the node its block meanwhile.
	if err := c.Client.Status().Patch(ctx, other, client.RawPatch(types.MergePatchType, []byte(`{"status":{"overlayAddress":"192.168.79.2"}}`))); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string {
		_ = c.Client.Get(ctx, types.NamespacedName{Name: other.Name}, other)
		if other.Spec.EndpointCIDR == "" {
			return "no block yet"
		}
		rs, _ := nh.RouteList(nil, netlink.FAMILY_V4)
		for _, r := range rs {
			if r.Dst != nil && r.Dst.String() == other.Spec.EndpointCIDR && r.Gw.String() == "192.168.79.2" {
				return "routed"
			}
		}
		return "block " + other.Spec.EndpointCIDR + " not routed"
	}).WithTimeout(time.Minute).Should(Equal("routed"))
}

// svcWorld is a node (a network namespace with its own agent) with web VMs on ImpNetworks of
// the same CIDR, each behind a Service web of its namespace, and a pod (a namespace routed
// through the node) to reach them from.
type svcWorld struct {
	c                        *testcluster.Cluster
	ag                       *agent.Agent
	node, pod, pins          string
	host, nodeName, stateDir string
	vms                      map[string]string // namespace → VM name
}

// newSvcWorld starts the node and, for each namespace of vms, its network, its VM (the web
// workload, port 8080 named http, an HTTP readiness probe of period 1 s) and its Service.
func newSvcWorld(t *testing.T, c *testcluster.Cluster, vms map[string]string) *svcWorld {
	ctx := context.Background()
	var sfx string
	for ns := range vms {
		sfx = ns[len(ns)-5:]
		break
	}
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	sw := &svcWorld{c: c, host: testregistry.Start(t, "", ""), nodeName: "imp-svc-" + sfx, stateDir: filepath.Join(tmp, "state"), vms: vms}
	testguest.Image(t, sw.host, "hello")
	sw.node, sw.pod = testnetns.New(t, "imp-v-"+sfx), testnetns.New(t, "imp-p-"+sfx)
	testnetns.Link(t, sw.node, "eth1", "192.168.79.1/24", sw.pod, "eth0", "192.168.79.2/24")
	ph := testnetns.Handle(t, sw.pod)
	pl, _ := ph.LinkByName("eth0")
	if err := ph.RouteAdd(&netlink.Route{LinkIndex: pl.Attrs().Index, Gw: net.ParseIP("192.168.79.1")}); err != nil {
		t.Fatal(err)
	}
	readyNode(t, c, sw.nodeName)
	startOperatorWith(t, c, operator.Options{VM: impvm.DefaultOptions(), Concurrency: 2,
		EndpointRange: netip.MustParsePrefix("100.72.0.0/16"), EndpointBlockBits: 24})
	sw.pins = testnetns.PinDir(t)
	sw.ag = startAgent(t, c, agent.Options{NodeName: sw.nodeName, StateDir: sw.stateDir, Kernel: kernel, Initramfs: initrd, NetNS: sw.node, NetNSDir: sw.pins, EndpointBlocks: true})
	for ns, name := range vms {
		if err := c.Client.Create(ctx, &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.93.0.0/24"}}); err != nil {
			t.Fatal(err)
		}
		vm := sw.world(ns).vm(name, "web")
		vm.Labels = map[string]string{"app": "web"}
		vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
		vm.Spec.Ports = []impv1.VMPort{{Name: "http", Port: 8080, Protocol: corev1.ProtocolTCP}}
		vm.Spec.ReadinessProbe = &impv1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromString("http")}},
			PeriodSeconds: 1, FailureThreshold: 1, SuccessThreshold: 1, TimeoutSeconds: 1}
		if err := c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
		if err := c.Client.Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "web"}, Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "web"}, Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
		}}); err != nil {
			t.Fatal(err)
		}
	}
	return sw
}

func (sw *svcWorld) world(ns string) *world {
	return &world{c: sw.c, ns: ns, host: sw.host, node: sw.nodeName, stateDir: sw.stateDir}
}

// endpoints are the endpoints of Service web of ns: "address:port vm ready".
func (sw *svcWorld) endpoints(ns string) []string {
	var l discoveryv1.EndpointSliceList
	if err := sw.c.Client.List(context.Background(), &l, client.InNamespace(ns), client.MatchingLabels{discoveryv1.LabelServiceName: "web"}); err != nil {
		return []string{err.Error()}
	}
	var out []string
	for _, s := range l.Items {
		for _, e := range s.Endpoints {
			for _, p := range s.Ports {
				out = append(out, fmt.Sprintf("%s:%d %s %v", e.Addresses[0], *p.Port, e.TargetRef.Name, *e.Conditions.Ready))
			}
		}
	}
	sort.Strings(out)
	return out
}

// get asks target for / from netns. The connection is made inside the namespace (a dial runs on
// the calling thread; an http.Client would dial from another, in the machine's own namespace,
// and reach the outside).
func get(netns, target string) string {
	var out string
	err := testnetns.Do(netns, func() error {
		conn, err := net.DialTimeout("tcp", target, 2*time.Second)
		if err != nil {
			return err
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := fmt.Fprintf(conn, "GET / HTTP/1.0\r\nHost: web\r\n\r\n"); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		out = strings.TrimSpace(string(b))
		return nil
	})
	if err != nil {
		return "error"
	}
	return out
}

// exec runs the hello tool args in VM name of ns.
func (sw *svcWorld) exec(t *testing.T, ns, name string, args ...string) {
	t.Helper()
	v := sw.world(ns).get(name)
	s, err := sw.ag.Runs.Session(types.NamespacedName{Namespace: ns, Name: name}, v.UID)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Exec(context.Background(), guestsession.ExecOptions{Command: append([]string{"/bin/hello"}, args...)}); err != nil {
		t.Fatal(err)
	}
}
