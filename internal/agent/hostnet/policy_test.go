package hostnet_test

import (
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/testnetns"
)

// TestPolicyOnEveryPath: two VMs of a network, A and B, and a pod routed through the node. A
// VM's policy holds on each path into and out of it: between the VMs (bridged), from the pod
// through B's endpoint address (the pod's own address is what the policy sees, not the
// gateway's the VM sees), and out through NAT; peers on the network's segment are told apart
// from peers beyond its transit link; ports and protocols count; replies always pass; a guest
// forging a permitted peer's address is dropped before policy; a policy allowing everything
// never opens the node's own ports; a second identical SetPolicy changes nothing; an empty
// policy and detaching leave nothing behind.
func TestPolicyOnEveryPath(t *testing.T) {
	node, pod := testnetns.New(t, "imp-hn-pol"), testnetns.New(t, "imp-hn-polp")
	testnetns.Link(t, node, "eth1", "192.168.77.1/24", pod, "eth0", "192.168.77.2/24")
	ph := testnetns.Handle(t, pod)
	pl, _ := ph.LinkByName("eth0")
	if err := ph.RouteAdd(&netlink.Route{LinkIndex: pl.Attrs().Index, Gw: net.ParseIP("192.168.77.1")}); err != nil {
		t.Fatal(err)
	}
	h := open(t, node, "")
	n := network("pol", "10.71.0.0/24", 0, true)
	podNet := netip.MustParsePrefix("192.168.77.0/24")
	n.Egress.Allow = []hostnet.EgressRule{{Prefix: podNet}}
	a, b := netip.MustParseAddr("10.71.0.2"), netip.MustParseAddr("10.71.0.3")
	ga, gb := guestBehind(t, h, n, "vm-a", a.String()), guestBehind(t, h, n, "vm-b", b.String())
	gc := guestBehind(t, h, n, "vm-c", "10.71.0.4")
	for g, who := range map[string]string{ga: "a", gb: "b"} {
		greet(t, g, ":8080", who)
		greet(t, g, ":8081", who)
	}
	greet(t, pod, ":9090", "pod")
	greet(t, node, ":9100", "node") // the agent's, the kubelet's ports: never a VM's
	if err := h.Expose(n, "vm-b", b, hostnet.Exposure{Endpoint: netip.MustParseAddr("100.72.0.3"),
		Ports: []hostnet.Port{{Protocol: unix.IPPROTO_TCP, Port: 8080}, {Protocol: unix.IPPROTO_TCP, Port: 8081}}}); err != nil {
		t.Fatal(err)
	}
	probes := []struct{ name, from, to string }{
		{"a→b:8080", ga, "10.71.0.3:8080"},
		{"a→b:8081", ga, "10.71.0.3:8081"},
		{"b→a:8080", gb, "10.71.0.2:8080"},
		{"pod→b:8080", pod, "100.72.0.3:8080"},
		{"a→pod:9090", ga, "192.168.77.2:9090"},
		{"b→pod:9090", gb, "192.168.77.2:9090"},
		{"a→node:9100", ga, "192.168.77.1:9100"},
	}
	check := func(step string, open ...string) {
		t.Helper()
		got := make([]string, len(probes))
		var wg sync.WaitGroup
		for i, p := range probes {
			wg.Go(func() { got[i] = ask(p.from, p.to) })
		}
		wg.Wait()
		for i, p := range probes {
			want := slices.Contains(open, p.name)
			if ok := !strings.HasPrefix(got[i], "error"); ok != want {
				t.Errorf("%s: %s %q, want open %v", step, p.name, got[i], want)
			}
		}
	}
	set := func(vm string, ip netip.Addr, p hostnet.Policy) {
		t.Helper()
		if err := h.SetPolicy(n, vm, ip, p); err != nil {
			t.Fatal(err)
		}
	}
	all := []string{"a→b:8080", "a→b:8081", "b→a:8080", "pod→b:8080", "a→pod:9090", "b→pod:9090"}
	check("no policy", all...)

	// B isolated for ingress, nothing allowed: only B's own connections pass (and their replies).
	set("vm-b", b, hostnet.Policy{Ingress: []hostnet.Allow{}})
	check("b denies all ingress", "b→a:8080", "a→pod:9090", "b→pod:9090")

	// From A on 8080, from the pod on any port. The pod is seen as itself, not as the gateway.
	tcp8080 := []hostnet.PortRange{{Protocol: unix.IPPROTO_TCP, From: 8080, To: 8080}}
	set("vm-b", b, hostnet.Policy{Ingress: []hostnet.Allow{
		{Network: []netip.Prefix{netip.PrefixFrom(a, 32)}, Ports: tcp8080},
		{Outside: []netip.Prefix{podNet}},
	}})
	check("b admits a:8080 and the pod", "a→b:8080", "b→a:8080", "pod→b:8080", "a→pod:9090", "b→pod:9090")
	before, _ := h.Rules()
	set("vm-b", b, hostnet.Policy{Ingress: []hostnet.Allow{
		{Network: []netip.Prefix{netip.PrefixFrom(a, 32)}, Ports: tcp8080},
		{Outside: []netip.Prefix{podNet}},
	}})
	if after, _ := h.Rules(); !slices.Equal(before, after) {
		t.Errorf("a second SetPolicy changed the rules:\n%s", strings.Join(after, "\n"))
	}

	// The pod's prefix admitted beyond the transit link is not the same address on the
	// network's segment: C taking 192.168.77.2 would be a spoof anyway, but A's address
	// admitted on the segment does not admit it from outside, and the reverse.
	set("vm-b", b, hostnet.Policy{Ingress: []hostnet.Allow{{Outside: []netip.Prefix{netip.PrefixFrom(a, 32)}}}})
	check("a's address admitted from outside only", "b→a:8080", "a→pod:9090", "b→pod:9090")

	// A guest forging A's address: dropped before any policy sees it.
	set("vm-b", b, hostnet.Policy{Ingress: []hostnet.Allow{{Network: []netip.Prefix{netip.PrefixFrom(a, 32)}}}})
	gch := testnetns.Handle(t, gc)
	el, _ := gch.LinkByName("eth0")
	if err := gch.AddrAdd(el, &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(32, 32)}}); err != nil {
		t.Fatal(err)
	}
	if err := testnetns.Do(gc, func() error {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: a.AsSlice()}, Timeout: 1e9}
		c, err := d.Dial("tcp", "10.71.0.3:8080")
		if err == nil {
			c.Close()
			t.Error("C, forging A's address, reached B")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	check("a admitted from the segment", "a→b:8080", "a→b:8081", "b→a:8080", "a→pod:9090", "b→pod:9090")

	// A isolated for egress: to the pod's 9090 only. Connections to A still pass (replies too).
	set("vm-b", b, hostnet.Policy{})
	set("vm-a", a, hostnet.Policy{Egress: []hostnet.Allow{{Outside: []netip.Prefix{podNet},
		Ports: []hostnet.PortRange{{Protocol: unix.IPPROTO_TCP, From: 9000, To: 9099}}}}})
	check("a egresses to the pod only", "b→a:8080", "pod→b:8080", "a→pod:9090", "b→pod:9090")
	set("vm-a", a, hostnet.Policy{Egress: []hostnet.Allow{{Outside: []netip.Prefix{podNet},
		Ports: []hostnet.PortRange{{Protocol: unix.IPPROTO_UDP, From: 9090, To: 9090}}}}})
	check("a egresses to the pod on UDP only", "b→a:8080", "pod→b:8080", "b→pod:9090")

	// Both at once: A's egress and B's ingress must each allow a bridged connection.
	set("vm-a", a, hostnet.Policy{Egress: []hostnet.Allow{{Network: []netip.Prefix{netip.MustParsePrefix("10.71.0.0/24")}}}})
	set("vm-b", b, hostnet.Policy{Ingress: []hostnet.Allow{{Network: []netip.Prefix{netip.PrefixFrom(a, 32)}, Ports: tcp8080}}})
	check("a's egress and b's ingress", "a→b:8080", "b→a:8080", "b→pod:9090")

	// A policy allowing everything opens nothing the node closes: the node stays out of reach.
	everything := []hostnet.Allow{{Network: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}, Outside: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}}}
	set("vm-a", a, hostnet.Policy{Ingress: everything, Egress: everything})
	set("vm-b", b, hostnet.Policy{})
	check("a allowed everything", all...)

	set("vm-a", a, hostnet.Policy{})
	check("policies removed", all...)
	rules, _ := h.Rules()
	for _, r := range rules {
		if strings.Contains(r, " ing-") || strings.Contains(r, " egr-") {
			t.Errorf("policy left after its removal: %s", r)
		}
	}

	// Readdressed (a warm member handed to its claim): the policy follows the VM to its new
	// address, and the old address is no longer held to it.
	set("vm-b", b, hostnet.Policy{Ingress: []hostnet.Allow{}})
	check("b isolated", "b→a:8080", "a→pod:9090", "b→pod:9090")
	set("vm-b", netip.MustParseAddr("10.71.0.9"), hostnet.Policy{Ingress: []hostnet.Allow{}})
	check("b's policy moved to another address", all...)
	set("vm-b", b, hostnet.Policy{})

	// Detaching a VM removes its policy with its tap.
	set("vm-b", b, hostnet.Policy{Ingress: []hostnet.Allow{}, Egress: []hostnet.Allow{}})
	if err := h.Detach("vm-b"); err != nil {
		t.Fatal(err)
	}
	// A VM taking B's address starts with none of B's connections, which policies, looking at
	// a connection's first packet only, would never see.
	at, err := h.Attach(n, "vm-b2", b)
	if err != nil {
		t.Fatal(err)
	}
	at.Tap.Close()
	if left := flowsOf(t, at.NetNS, b); left != 0 {
		t.Errorf("%d connections of B's address left for the VM that took it", left)
	}
	rules, _ = h.Rules()
	for _, r := range rules {
		if strings.Contains(r, " ing-") || strings.Contains(r, " egr-") {
			t.Errorf("policy left after detaching: %s", r)
		}
	}
}

// TestPolicyAcrossNodes: VMs of one network on two nodes, over the overlay. B's ingress policy,
// enforced on B's node, and A's egress policy, enforced on A's node, each hold for frames that
// cross the underlay; replies pass.
func TestPolicyAcrossNodes(t *testing.T) {
	n1, n2 := testnetns.New(t, "imp-hn-pxa"), testnetns.New(t, "imp-hn-pxb")
	testnetns.Link(t, n1, "under0", "192.0.2.1/24", n2, "under0", "192.0.2.2/24")
	h1, h2 := open(t, n1, "192.0.2.1"), open(t, n2, "192.0.2.2")
	n := network("pxn", "10.74.0.0/24", 4713, false)
	a, b := netip.MustParseAddr("10.74.0.2"), netip.MustParseAddr("10.74.0.3")
	ga, gb := guestBehind(t, h1, n, "vm-a", a.String()), guestBehind(t, h2, n, "vm-b", b.String())
	if _, err := h1.Sync(n, []hostnet.Peer{{IP: b, VTEP: netip.MustParseAddr("192.0.2.2")}}); err != nil {
		t.Fatal(err)
	}
	if _, err := h2.Sync(n, []hostnet.Peer{{IP: a, VTEP: netip.MustParseAddr("192.0.2.1")}}); err != nil {
		t.Fatal(err)
	}
	greet(t, ga, ":8080", "a")
	greet(t, gb, ":8080", "b")
	greet(t, gb, ":8081", "b")
	reach := func(step, from, to string, want bool) {
		t.Helper()
		got := ask(from, to)
		if ok := !strings.HasPrefix(got, "error"); ok != want {
			t.Errorf("%s: %s → %s: %q, want open %v", step, from, to, got, want)
		}
	}
	reach("no policy", ga, "10.74.0.3:8080", true)
	reach("no policy", gb, "10.74.0.2:8080", true)

	tcp8080 := []hostnet.PortRange{{Protocol: unix.IPPROTO_TCP, From: 8080, To: 8080}}
	if err := h2.SetPolicy(n, "vm-b", b, hostnet.Policy{Ingress: []hostnet.Allow{{Network: []netip.Prefix{netip.PrefixFrom(a, 32)}, Ports: tcp8080}}}); err != nil {
		t.Fatal(err)
	}
	reach("b admits a on 8080", ga, "10.74.0.3:8080", true)
	reach("b admits a on 8080", ga, "10.74.0.3:8081", false)
	reach("b admits a on 8080", gb, "10.74.0.2:8080", true)

	if err := h1.SetPolicy(n, "vm-a", a, hostnet.Policy{Egress: []hostnet.Allow{}}); err != nil {
		t.Fatal(err)
	}
	reach("a isolated for egress", ga, "10.74.0.3:8080", false)
	reach("a isolated for egress", gb, "10.74.0.2:8080", true) // a's replies pass
}

// flowsOf counts the connections conntrack holds in ns that involve ip.
func flowsOf(t *testing.T, ns string, ip netip.Addr) int {
	t.Helper()
	flows, err := testnetns.Handle(t, ns).ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, f := range flows {
		for _, a := range []net.IP{f.Forward.SrcIP, f.Forward.DstIP, f.Reverse.SrcIP, f.Reverse.DstIP} {
			if a.Equal(ip.AsSlice()) {
				n++
				break
			}
		}
	}
	return n
}
