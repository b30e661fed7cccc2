package agent_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/nftables"
	. "github.com/onsi/gomega"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/testcluster"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testnetns"
	"github.com/syscode-labs/imp/internal/testregistry"
)

// TestNetworksAcrossNodes simulates two nodes, each a network namespace with its own agent,
// joined by a veth underlay; node A also has an uplink to an "outside" namespace, which holds
// a metadata server on 169.254.169.254 that node A routes to. Node A listens on every address
// (0.0.0.0:10260, the port of the agent's access endpoint). Four guests boot under QEMU/TCG: a1 (node A) and b1 (node B) on ImpNetwork
// blue, which has NAT; a2 (node A) on red, which has none; c1 (node A) on another namespace's
// ImpNetwork, also named blue, with blue's CIDR. Each guest pings and connects to addresses of
// the networks, the node and the outside.
//
//   - a1 and b1 reach each other across the VXLAN overlay, and each greets the other by name;
//     neither reaches a2, nor a2 them; c1 reaches its own gateway and never a1 or b1, whose
//     addresses are also its network's;
//   - a1 and c1 reach the outside server, which sees node A's address; a2 does not reach it,
//     although the outside has a route back to both networks;
//   - no VM on node A reaches node A's listener, by gateway, node or transit address, nor the
//     metadata server; node A's routing table holds neither network's CIDR;
//   - after the VMs are deleted, neither node namespace holds an IMP link, address or rule,
//     and no network namespace is left pinned.
//
// nodePort is node A's listener: the agent's access endpoint's port, which the operator, and
// nothing a VM sends, reaches.
const nodePort = "10260"

func TestNetworksAcrossNodes(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	sfx := ns[len(ns)-5:]
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	host := testregistry.Start(t, "", "")
	testguest.Image(t, host, "hello")

	nsA, nsB, out := testnetns.New(t, "imp-a-"+sfx), testnetns.New(t, "imp-b-"+sfx), testnetns.New(t, "imp-out-"+sfx)
	testnetns.Link(t, nsA, "under0", "192.168.77.1/24", nsB, "under0", "192.168.77.2/24")
	testnetns.Link(t, nsA, "uplink0", "203.0.113.1/24", out, "uplink0", "203.0.113.2/24")
	ho := testnetns.Handle(t, out)
	up, _ := ho.LinkByName("uplink0")
	for _, dst := range []string{"10.90.0.0/24", "10.91.0.0/24"} {
		_, d, _ := net.ParseCIDR(dst)
		if err := ho.RouteAdd(&netlink.Route{LinkIndex: up.Attrs().Index, Dst: d, Gw: net.ParseIP("203.0.113.1")}); err != nil {
			t.Fatal(err)
		}
	}
	seen := serveOutside(t, out, "203.0.113.2:9000")
	// The cloud's metadata server, which node A reaches, and node A's own services.
	lo, _ := ho.LinkByName("lo")
	if err := ho.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP("169.254.169.254"), Mask: net.CIDRMask(32, 32)}}); err != nil {
		t.Fatal(err)
	}
	ha := testnetns.Handle(t, nsA)
	upA, _ := ha.LinkByName("uplink0")
	if err := ha.RouteAdd(&netlink.Route{LinkIndex: upA.Attrs().Index, Dst: &net.IPNet{IP: net.ParseIP("169.254.169.254"), Mask: net.CIDRMask(32, 32)},
		Gw: net.ParseIP("203.0.113.2")}); err != nil {
		t.Fatal(err)
	}
	metadata := serveOutside(t, out, "169.254.169.254:80")
	onNode := serveOutside(t, nsA, "0.0.0.0:"+nodePort)
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range []string{nsA, nsB} {
				dump, _ := exec.Command("sh", "-c", "ip -n $0 -d link; ip -n $0 addr; ip netns exec $0 bridge fdb; ip netns exec $0 nft list ruleset", filepath.Base(n)).CombinedOutput()
				t.Logf("%s:\n%s", n, dump)
			}
		}
	})

	nodeA, nodeB := "imp-net-a-"+sfx, "imp-net-b-"+sfx
	readyNode(t, c, nodeA)
	readyNode(t, c, nodeB)
	startOperator(t, c)
	pins := map[string]string{}
	for _, n := range []struct{ node, netns, vtep string }{{nodeA, nsA, "192.168.77.1"}, {nodeB, nsB, "192.168.77.2"}} {
		pins[n.node] = testnetns.PinDir(t)
		startAgent(t, c, agent.Options{NodeName: n.node, StateDir: filepath.Join(tmp, n.node), Kernel: kernel, Initramfs: initrd,
			NetNS: n.netns, NetNSDir: pins[n.node], OverlayAddress: netip.MustParseAddr(n.vtep)})
	}
	other := c.Namespace(t)
	for _, n := range []impv1.ImpNetwork{
		{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "blue"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.90.0.0/24", NAT: impv1.NATSpec{Enabled: true}}},
		{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "red"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.91.0.0/24"}},
		{ObjectMeta: metav1.ObjectMeta{Namespace: other, Name: "blue"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.90.0.0/24", NAT: impv1.NATSpec{Enabled: true}}},
	} {
		if err := c.Client.Create(ctx, &n); err != nil {
			t.Fatal(err)
		}
	}
	w := &world{c: c, ns: ns, host: host}
	probe := "icmp:10.90.0.1-3,icmp:10.91.0.1-2,tcp:203.0.113.2:9000,who:10.90.0.2:7000,who:10.90.0.3:7000"
	// Node A's services, by every address a VM on node A could aim at.
	nodeTargets := []string{"tcp:10.90.0.1:" + nodePort, "tcp:10.91.0.1:" + nodePort, "tcp:192.168.77.1:" + nodePort, "tcp:203.0.113.1:" + nodePort,
		"tcp:169.254.210.1:" + nodePort, "tcp:169.254.210.2:" + nodePort, "tcp:169.254.169.254:80"}
	vms := map[string]*impv1.ImpVM{}
	for _, v := range []struct{ name, node, network, ns string }{{"a1", nodeA, "blue", ns}, {"a2", nodeA, "red", ns}, {"b1", nodeB, "blue", ns}, {"c1", nodeA, "blue", other}} {
		w.node = v.node
		vm := w.vm(v.name, "net")
		vm.Namespace = v.ns
		vm.Spec.NetworkRef = &impv1.NetworkReference{Name: v.network}
		p := probe
		if v.node == nodeA {
			p += "," + strings.Join(nodeTargets, ",")
		}
		vm.Spec.Env = []impv1.EnvVar{{Name: "PROBE", Value: p}}
		if err := c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
		vms[v.name] = vm
	}
	g := NewWithT(t)
	ips := map[string]string{}
	// latest is the last state a guest printed for a probe target.

	for name, vm := range vms {
		g.Eventually(func() string {
			v := &impv1.ImpVM{}
			if err := c.Client.Get(ctx, client.ObjectKeyFromObject(vm), v); err != nil {
				return ""
			}
			// Ready: the guest runs its workload (four TCG guests on two cores, beside other
			// suites' guests in CI, boot slowly).
			if v == nil || v.Status.Phase != impv1.VMRunning || !meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition) {
				return ""
			}
			vms[name] = v
			return v.Status.IP
		}).WithTimeout(15*time.Minute).WithPolling(200*time.Millisecond).ShouldNot(BeEmpty(), func() string {
			return "VM " + name + ": " + diagnose(c.Client, vm, func(node string) string { return filepath.Join(tmp, node) })
		})
		ips[name] = vms[name].Status.IP
	}
	t.Logf("addresses: %v", ips)
	console := func(name string) string {
		vm := vms[name]
		w.stateDir = filepath.Join(tmp, vm.Status.NodeName)
		return w.console(vm)
	}
	latest := func(from, target string) func() string {
		return func() string {
			state := ""
			for _, l := range strings.Split(console(from), "\n") {
				if s, ok := strings.CutPrefix(strings.TrimSpace(l), "probe "+target+" "); ok {
					state = s
				}
			}
			return state
		}
	}
	outside := "tcp:203.0.113.2:9000"
	// Connectivity first, waited for: the guests boot slowly under TCG.
	g.Eventually(latest("a1", "icmp:"+ips["b1"])).WithTimeout(9*time.Minute).Should(Equal("ok"), func() string { return "a1 → b1 across nodes:\n" + console("a1") })
	g.Eventually(latest("b1", "icmp:"+ips["a1"])).WithTimeout(6*time.Minute).Should(Equal("ok"), func() string { return "b1 → a1 across nodes:\n" + console("b1") })
	g.Eventually(latest("a1", outside)).WithTimeout(6*time.Minute).Should(Equal("ok"), func() string { return "a1 → outside with NAT:\n" + console("a1") })
	// Then what must not work has had every chance to.
	g.Eventually(latest("a2", "icmp:"+ips["a2"])).WithTimeout(6*time.Minute).Should(Equal("ok"), func() string { return "a2 pings itself:\n" + console("a2") })
	for _, bad := range []struct{ from, target string }{
		{"a2", "icmp:" + ips["a1"]}, {"a2", "icmp:" + ips["b1"]}, {"a1", "icmp:" + ips["a2"]}, {"b1", "icmp:" + ips["a2"]}, {"a2", outside},
	} {
		// Each probe must have run and failed: waited for, not assumed after a pause.
		g.Eventually(latest(bad.from, bad.target)).WithTimeout(6*time.Minute).Should(Equal("fail"), func() string {
			return bad.from + " → " + bad.target + " never tried:\n" + console(bad.from)
		})
		if strings.Contains(console(bad.from), "probe "+bad.target+" ok") {
			t.Errorf("%s reached %s:\n%s", bad.from, bad.target, console(bad.from))
		}
	}
	// Same CIDR, same name, another namespace: c1 has its own gateway and NAT, and nothing of
	// blue's; a1 and b1 greet each other, not c1.
	g.Eventually(latest("a1", "who:"+ips["b1"]+":7000")).WithTimeout(6*time.Minute).Should(Equal("ok b1"), func() string { return "a1 greets b1:\n" + console("a1") })
	g.Eventually(latest("b1", "who:"+ips["a1"]+":7000")).WithTimeout(6*time.Minute).Should(Equal("ok a1"), func() string { return "b1 greets a1:\n" + console("b1") })
	g.Eventually(latest("c1", "icmp:10.90.0.1")).WithTimeout(6*time.Minute).Should(Equal("ok"), func() string { return "c1 → its gateway:\n" + console("c1") })
	g.Eventually(latest("c1", outside)).WithTimeout(6*time.Minute).Should(Equal("ok"), func() string { return "c1 → outside with NAT:\n" + console("c1") })
	for _, other := range []string{"a1", "b1"} {
		if ips[other] == ips["c1"] {
			continue // c1 greets itself there
		}
		g.Eventually(latest("c1", "who:"+ips[other]+":7000")).WithTimeout(6*time.Minute).Should(Equal("fail"), func() string { return "c1 never tried " + other + ":\n" + console("c1") })
	}
	for name, from := range map[string]string{"a1": "c1", "b1": "c1", "c1": "a1"} {
		if c := console(from); strings.Contains(c, " ok "+name+"\n") && name != from {
			t.Errorf("%s greeted %s, a VM of another network with the same CIDR:\n%s", from, name, c)
		}
	}
	if c := console("a1") + console("b1"); strings.Contains(c, " ok c1") {
		t.Errorf("a VM of blue greeted c1:\n%s", c)
	}
	// Nothing of node A answers a VM on it, whatever address it aims at.
	for _, from := range []string{"a1", "a2", "c1"} {
		for _, target := range nodeTargets {
			g.Eventually(latest(from, target)).WithTimeout(6*time.Minute).Should(Equal("fail"), func() string {
				return from + " → " + target + " never tried:\n" + console(from)
			})
			if strings.Contains(console(from), "probe "+target+" ok") {
				t.Errorf("%s reached node A's %s:\n%s", from, target, console(from))
			}
		}
	}
	if got := onNode(); len(got) > 0 {
		t.Errorf("node A's listener accepted connections from %v", got)
	}
	if got := metadata(); len(got) > 0 {
		t.Errorf("the metadata server accepted connections from %v", got)
	}
	if got := seen(); len(got) == 0 || len(got) != strings.Count(strings.Join(got, ","), "203.0.113.1") {
		t.Errorf("the outside server saw %v; want only node A's address 203.0.113.1", got)
	}
	routes, err := ha.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range routes {
		if r.Dst != nil && (strings.HasPrefix(r.Dst.String(), "10.90.") || strings.HasPrefix(r.Dst.String(), "10.91.")) {
			t.Errorf("node A routes a tenant's CIDR: %s", r)
		}
	}

	// Delete everything: nothing of IMP stays in either node's namespace.
	for _, vm := range vms {
		if err := c.Client.Delete(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range []string{nsA, nsB} {
		g.Eventually(func() []string { return impLeftovers(t, n) }).WithTimeout(6*time.Minute).WithPolling(250*time.Millisecond).Should(BeEmpty(), "in %s", n)
	}
	for node, dir := range pins {
		g.Eventually(func() []string {
			entries, _ := os.ReadDir(dir)
			var names []string
			for _, e := range entries {
				names = append(names, e.Name())
			}
			return names
		}).WithTimeout(time.Minute).Should(BeEmpty(), "network namespaces left pinned on %s", node)
	}
}

// serveOutside accepts TCP connections on addr inside netns and returns a function listing
// the remote addresses it saw.
func serveOutside(t *testing.T, netnsPath, addr string) func() []string {
	var l net.Listener
	if err := testnetns.Do(netnsPath, func() (err error) { l, err = net.Listen("tcp", addr); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var mu sync.Mutex
	var seen []string
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			host, _, _ := net.SplitHostPort(c.RemoteAddr().String())
			mu.Lock()
			seen = append(seen, host)
			mu.Unlock()
			_, _ = c.Write([]byte("hi\n"))
			c.Close()
		}
	}()
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), seen...)
	}
}

// impLeftovers lists IMP links, addresses on them and nftables tables in the namespace.
func impLeftovers(t *testing.T, path string) []string {
	h := testnetns.Handle(t, path)
	links, err := h.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, "imp") {
			left = append(left, "link "+l.Attrs().Name)
		}
		addrs, _ := h.AddrList(l, netlink.FAMILY_V4)
		for _, a := range addrs {
			if strings.HasPrefix(a.IPNet.String(), "10.9") {
				left = append(left, fmt.Sprintf("address %s on %s", a.IPNet, l.Attrs().Name))
			}
		}
	}
	nsh, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	defer nsh.Close()
	conn, err := nftables.New(nftables.WithNetNSFd(int(nsh)))
	if err != nil {
		t.Fatal(err)
	}
	tables, err := conn.ListTables()
	if err != nil {
		t.Fatal(err)
	}
	for _, tb := range tables {
		left = append(left, "nftables table "+tb.Name)
	}
	return left
}

// TestSuspendResume suspends a real guest (QEMU/TCG) counting ticks on an ImpNetwork, through
// an ImpVMSuspension: its VMM is gone while suspended; after the suspension is deleted it
// runs again with the same address, answers on it, and its count goes on from where it was.
func TestSuspendResume(t *testing.T) {
	w, pins := netWorld(t, "10.92.0.0/24")
	c, ns, ctx, stateDir := w.c, w.ns, context.Background(), w.stateDir
	vm := w.vm("counter", "net")
	vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	running := func() bool {
		v := w.get("counter")
		return v != nil && v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}
	g.Eventually(running).WithTimeout(15 * time.Minute).WithPolling(100 * time.Millisecond).Should(BeTrue())
	v := w.get("counter")
	ip, uid := v.Status.IP, v.UID
	ticks := func() int { return strings.Count(w.console(v), "hello: tick ") }
	g.Eventually(ticks).WithTimeout(6 * time.Minute).Should(BeNumerically(">=", 3))
	// The node reaches none of its VMs; the network's own namespace does.
	answer := func() string {
		var out string
		spaces, _ := filepath.Glob(filepath.Join(pins, "impn*"))
		if len(spaces) != 1 {
			return fmt.Sprintf("%d network namespaces", len(spaces))
		}
		_ = testnetns.Do(spaces[0], func() error {
			c, err := net.DialTimeout("tcp", ip+":7000", time.Second)
			if err != nil {
				return err
			}
			defer c.Close()
			_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
			b := make([]byte, 64)
			n, _ := c.Read(b)
			out = strings.TrimSpace(string(b[:n]))
			return nil
		})
		return out
	}
	g.Eventually(answer).WithTimeout(3 * time.Minute).Should(Equal("hello from counter"))
	rec, err := vmm.ReadRecord(filepath.Join(stateDir, "vms", string(uid)))
	if err != nil {
		t.Fatal(err)
	}

	susp := &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "counter"},
		Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonUser, Message: "by the test"}}
	if err := c.Client.Create(ctx, susp); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.VMPhase { return w.get("counter").Status.Phase }).WithTimeout(6 * time.Minute).Should(Equal(impv1.VMSuspended))
	v = w.get("counter")
	cond := meta.FindStatusCondition(v.Status.Conditions, impv1.SuspendedCondition)
	if cond == nil || cond.Status != metav1.ConditionTrue || cond.Reason != impv1.SuspendReasonUser || v.Status.Suspension.Since == nil {
		t.Errorf("suspended VM: condition %+v, suspension %+v", cond, v.Status.Suspension)
	}
	if rec.Alive() {
		t.Fatal("the VMM still runs while the VM is suspended")
	}
	before := ticks()
	time.Sleep(2 * time.Second)
	if ticks() != before {
		t.Error("the guest ticked while suspended")
	}

	if err := c.Client.Delete(ctx, susp); err != nil {
		t.Fatal(err)
	}
	g.Eventually(running).WithTimeout(6 * time.Minute).WithPolling(100 * time.Millisecond).Should(BeTrue())
	v = w.get("counter")
	if v.Status.IP != ip || v.Status.Instance != 1 || v.Status.RestartCount != 0 {
		t.Errorf("after resume: ip %s (was %s), instance %d, restarts %d", v.Status.IP, ip, v.Status.Instance, v.Status.RestartCount)
	}
	g.Eventually(ticks).WithTimeout(3 * time.Minute).Should(BeNumerically(">", before+1))
	after := w.console(v)
	if strings.Count(after, "hello from imp") != 1 || strings.Contains(after[strings.LastIndex(after, "hello: tick "+strconv.Itoa(before-1)):], "hello: tick 0\r") {
		qlog, _ := os.ReadFile(filepath.Join(stateDir, "vms", string(uid), "qemu.log"))
		var events corev1.EventList
		_ = c.Client.List(ctx, &events, client.InNamespace(ns))
		var evs []string
		for _, e := range events.Items {
			evs = append(evs, e.Reason+": "+e.Message)
		}
		t.Errorf("the workload started again instead of continuing:\n%s\nqemu.log:\n%s\nevents:\n%s", after, qlog, strings.Join(evs, "\n"))
	}
	g.Eventually(answer).WithTimeout(3 * time.Minute).Should(Equal("hello from counter"))
	if err := c.Client.Delete(ctx, v); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() *impv1.ImpVM { return w.get("counter") }).WithTimeout(3 * time.Minute).Should(BeNil())
}
