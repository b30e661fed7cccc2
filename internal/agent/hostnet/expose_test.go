package hostnet_test

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/testnetns"
)

// guestBehind attaches VM vm of n at ip and puts a guest in its place: a namespace of its own
// behind a veth named as the VM's tap (so the tap's anti-spoofing applies), with the VM's
// address, MAC and default route via the gateway. It returns the guest's namespace.
func guestBehind(t *testing.T, h *hostnet.Host, n hostnet.Network, vm, ip string) string {
	t.Helper()
	space := attach(t, h, n, vm, ip)
	sh := testnetns.Handle(t, space)
	tap := hostnet.TapName(vm)
	if l, err := sh.LinkByName(tap); err != nil || sh.LinkDel(l) != nil {
		t.Fatalf("removing the tap %s: %v", tap, err)
	}
	g := testnetns.New(t, "imp-hn-g"+n.Name+"-"+vm)
	testnetns.Link(t, space, tap, "", g, "eth0", ip+"/24")
	br, _ := sh.LinkByName(n.BridgeName())
	tl, _ := sh.LinkByName(tap)
	if err := sh.LinkSetMaster(tl, br); err != nil {
		t.Fatal(err)
	}
	gh := testnetns.Handle(t, g)
	e, _ := gh.LinkByName("eth0")
	addr := netip.MustParseAddr(ip)
	if err := gh.LinkSetHardwareAddr(e, hostnet.MAC(addr)); err != nil {
		t.Fatal(err)
	}
	if err := gh.RouteAdd(&netlink.Route{LinkIndex: e.Attrs().Index, Gw: n.Gateway.AsSlice()}); err != nil {
		t.Fatal(err)
	}
	return g
}

// greet serves TCP on addr in ns: each connection gets "<who> saw <remote address>".
func greet(t *testing.T, ns, addr, who string) {
	t.Helper()
	testnetns.Serve(t, ns, addr, func(c net.Conn) {
		host, _, _ := net.SplitHostPort(c.RemoteAddr().String())
		fmt.Fprintf(c, "%s saw %s\n", who, host)
		c.Close()
	})
}

// ask connects from ns to addr and returns the greeting, or the error.
func ask(ns, addr string) string {
	var out string
	err := testnetns.Do(ns, func() error {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		out, err = bufio.NewReader(c).ReadString('\n')
		return err
	})
	if err != nil {
		return "error: " + err.Error()
	}
	return strings.TrimSpace(out)
}

// TestExposure: two networks with the same CIDR, one with NAT and one closed, each with a VM at
// the same address serving its declared port 8080 and an undeclared 8081. A pod (a namespace
// routed through the node) and the node itself reach each VM at its own endpoint address, on
// the declared port only; the VM sees its gateway as the peer; the node's routes hold the
// endpoint addresses and no tenant CIDR; an endpoint address is never taken from the network
// it is routed to; unexposed or detached, a VM is unreachable again.
func TestExposure(t *testing.T) {
	node, pod := testnetns.New(t, "imp-hn-exp"), testnetns.New(t, "imp-hn-pod")
	testnetns.Link(t, node, "eth1", "192.168.77.1/24", pod, "eth0", "192.168.77.2/24")
	ph := testnetns.Handle(t, pod)
	pl, _ := ph.LinkByName("eth0")
	if err := ph.RouteAdd(&netlink.Route{LinkIndex: pl.Attrs().Index, Gw: net.ParseIP("192.168.77.1")}); err != nil {
		t.Fatal(err)
	}
	nl := testnetns.Handle(t, node)
	h := open(t, node, "")
	one, two := network("one", "10.71.0.0/24", 0, true), network("two", "10.71.0.0/24", 0, false)
	two.Namespace = "other"
	g1, g2 := guestBehind(t, h, one, "vm-one", "10.71.0.2"), guestBehind(t, h, two, "vm-two", "10.71.0.2")
	for g, who := range map[string]string{g1: "one", g2: "two"} {
		greet(t, g, ":8080", who)
		greet(t, g, ":8081", who+"-undeclared")
	}
	web := []hostnet.Port{{Protocol: unix.IPPROTO_TCP, Port: 8080}}
	vm := netip.MustParseAddr("10.71.0.2")
	e1, e2 := netip.MustParseAddr("100.72.0.2"), netip.MustParseAddr("100.72.0.3")
	if err := h.Expose(one, "vm-one", vm, hostnet.Exposure{Endpoint: e1, Ports: web}); err != nil {
		t.Fatal(err)
	}
	if err := h.Expose(two, "vm-two", vm, hostnet.Exposure{Endpoint: e2, Ports: web}); err != nil {
		t.Fatal(err)
	}
	// Again: nothing changes.
	before, _ := h.Rules()
	if err := h.Expose(one, "vm-one", vm, hostnet.Exposure{Endpoint: e1, Ports: web}); err != nil {
		t.Fatal(err)
	}
	if after, _ := h.Rules(); !slices.Equal(before, after) {
		t.Errorf("a second Expose changed the rules:\n%s", strings.Join(after, "\n"))
	}

	for _, tc := range []struct{ from, addr, want string }{
		{pod, "100.72.0.2:8080", "one saw 10.71.0.1"},
		{pod, "100.72.0.3:8080", "two saw 10.71.0.1"},
		{node, "100.72.0.2:8080", "one saw 10.71.0.1"},
		{node, "100.72.0.3:8080", "two saw 10.71.0.1"},
		{pod, "100.72.0.2:8081", "error"},
		{pod, "100.72.0.3:8081", "error"},
		{node, "100.72.0.3:8081", "error"},
		{g1, "100.72.0.3:8080", "error"}, // NAT egress reaches public addresses only
		{g2, "100.72.0.2:8080", "error"}, // a closed network reaches nothing
	} {
		if got := ask(tc.from, tc.addr); !strings.HasPrefix(got, tc.want) {
			t.Errorf("%s from %s: %q, want %q", tc.addr, tc.from, got, tc.want)
		}
	}
	got := routes(t, nl)
	for _, r := range got {
		if strings.HasPrefix(r, "10.71.") {
			t.Errorf("a tenant's route on the node: %s", r)
		}
	}
	if !slices.Contains(got, "100.72.0.2/32") || !slices.Contains(got, "100.72.0.3/32") {
		t.Errorf("node routes %q lack the endpoint addresses", got)
	}
	// An endpoint address inside a range the node routes itself (a pod CIDR, its subnet) is
	// refused: IMP's /32 would take that range's traffic.
	if err := h.Expose(one, "vm-one", vm, hostnet.Exposure{Endpoint: netip.MustParseAddr("192.168.77.9"), Ports: web}); err == nil ||
		!strings.Contains(err.Error(), "overlaps the node's route to 192.168.77.0/24") {
		t.Errorf("an endpoint address in the node's own subnet: %v", err)
	}
	if got := ask(pod, "100.72.0.2:8080"); got != "one saw 10.71.0.1" {
		t.Errorf("network one's endpoint after the refusal: %q", got)
	}
	// Network two's VM cannot take network one's endpoint address.
	if err := h.Expose(two, "vm-two", vm, hostnet.Exposure{Endpoint: e1, Ports: web}); err == nil {
		t.Error("an endpoint address routed to network one was exposed in network two")
	}
	if got := ask(pod, "100.72.0.2:8080"); got != "one saw 10.71.0.1" {
		t.Errorf("network one's endpoint after the attempt: %q", got)
	}

	// The transit links lost (deleted by hand; a pair that lost its other half): the next
	// sync of each network makes them again, with the routes of its exposed VMs, which a
	// new link does not have.
	links, err := nl.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, "impe") {
			if err := nl.LinkDel(l); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := ask(pod, "100.72.0.3:8080"); !strings.HasPrefix(got, "error") {
		t.Fatalf("network two's endpoint answered without its transit link: %q", got)
	}
	for _, n := range []hostnet.Network{one, two} {
		if _, err := h.Sync(n, nil); err != nil {
			t.Fatal(err)
		}
	}
	for addr, want := range map[string]string{"100.72.0.2:8080": "one saw 10.71.0.1", "100.72.0.3:8080": "two saw 10.71.0.1"} {
		if got := ask(pod, addr); got != want {
			t.Errorf("%s after its network's transit link was made anew: %q, want %q (node routes %q)", addr, got, want, routes(t, nl))
		}
	}

	if err := h.Unexpose("vm-one"); err != nil {
		t.Fatal(err)
	}
	if got := ask(pod, "100.72.0.2:8080"); !strings.HasPrefix(got, "error") {
		t.Errorf("an unexposed VM answered: %q", got)
	}
	if err := h.Detach("vm-two"); err != nil {
		t.Fatal(err)
	}
	if got := routes(t, nl); slices.Contains(got, "100.72.0.2/32") || slices.Contains(got, "100.72.0.3/32") {
		t.Errorf("endpoint routes left: %q", got)
	}
	if present, err := h.Sync(two, nil); err != nil || present {
		t.Errorf("network two after its last VM left: present %v, %v", present, err)
	}
}

// TestEndpointBlocksAcrossNodes: node B routes node A's endpoint block via node A's address
// (as a CNI routes pod CIDRs), and a pod of node B reaches a VM of node A at its endpoint
// address; blocks no longer given are unrouted.
func TestEndpointBlocksAcrossNodes(t *testing.T) {
	a, b, pod := testnetns.New(t, "imp-hn-xa"), testnetns.New(t, "imp-hn-xb"), testnetns.New(t, "imp-hn-xp")
	testnetns.Link(t, a, "eth0", "10.55.0.1/24", b, "eth0", "10.55.0.2/24")
	testnetns.Link(t, b, "eth1", "192.168.80.1/24", pod, "eth0", "192.168.80.2/24")
	ph, ah := testnetns.Handle(t, pod), testnetns.Handle(t, a)
	pl, _ := ph.LinkByName("eth0")
	if err := ph.RouteAdd(&netlink.Route{LinkIndex: pl.Attrs().Index, Gw: net.ParseIP("192.168.80.1")}); err != nil {
		t.Fatal(err)
	}
	// What the cluster's CNI does: node A routes node B's pods, node B forwards.
	if err := ah.RouteAdd(&netlink.Route{Dst: &net.IPNet{IP: net.ParseIP("192.168.80.0").To4(), Mask: net.CIDRMask(24, 32)}, Gw: net.ParseIP("10.55.0.2")}); err != nil {
		t.Fatal(err)
	}
	if err := testnetns.Do(b, func() error { return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644) }); err != nil {
		t.Fatal(err)
	}
	ha, hb := open(t, a, ""), open(t, b, "")
	n := network("web", "10.72.0.0/24", 0, false)
	g := guestBehind(t, ha, n, "vm-x", "10.72.0.2")
	greet(t, g, ":8080", "x")
	if err := ha.Expose(n, "vm-x", netip.MustParseAddr("10.72.0.2"), hostnet.Exposure{Endpoint: netip.MustParseAddr("100.72.1.2"),
		Ports: []hostnet.Port{{Protocol: unix.IPPROTO_TCP, Port: 8080}}}); err != nil {
		t.Fatal(err)
	}
	if got := ask(pod, "100.72.1.2:8080"); !strings.HasPrefix(got, "error") {
		t.Fatalf("reached node A's block before node B routes it: %q", got)
	}
	blocks := map[netip.Prefix]netip.Addr{netip.MustParsePrefix("100.72.1.0/24"): netip.MustParseAddr("10.55.0.1")}
	if failed, err := hb.SyncBlocks(blocks); err != nil || len(failed) != 0 {
		t.Fatalf("SyncBlocks: %v, %v", failed, err)
	}
	if got := ask(pod, "100.72.1.2:8080"); got != "x saw 10.72.0.1" {
		t.Errorf("a pod of node B to a VM of node A: %q", got)
	}
	// A block via an address no network of the node reaches is refused, and said so.
	failed, err := hb.SyncBlocks(map[netip.Prefix]netip.Addr{netip.MustParsePrefix("100.72.2.0/24"): netip.MustParseAddr("192.0.2.9")})
	if err != nil || failed[netip.MustParsePrefix("100.72.2.0/24")] == nil {
		t.Errorf("an unreachable next hop: %v, %v", failed, err)
	}
	if got := routes(t, testnetns.Handle(t, b)); slices.Contains(got, "100.72.1.0/24") {
		t.Errorf("a block no longer given is still routed: %q", got)
	}
}

// TestForgedRepliesDoNotReachTheNode: the node accepts over transit links only replies from
// exposed endpoint addresses, not everything conntrack calls related. A guest of a NAT network
// that may reach the node's subnet forges an ICMP port-unreachable about a connected UDP socket
// of the node (the inner header names it; the outer source is the guest's own address): the
// node's socket never hears of it.
func TestForgedRepliesDoNotReachTheNode(t *testing.T) {
	node, lan := testnetns.New(t, "imp-hn-fn"), testnetns.New(t, "imp-hn-fl")
	testnetns.Link(t, node, "eth1", "10.74.0.100/24", lan, "eth0", "10.74.0.1/24")
	if err := testnetns.Do(node, func() error { // no reverse-path check to hide what the rules do
		for _, k := range []string{"all", "default", "eth1"} {
			if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+k+"/rp_filter", []byte("0"), 0o644); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var quiet *net.UDPConn // a UDP server that never answers, so no real ICMP comes back
	if err := testnetns.Do(lan, func() (err error) {
		quiet, err = net.ListenUDP("udp4", &net.UDPAddr{IP: net.ParseIP("10.74.0.1"), Port: 9999})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { quiet.Close() })
	h := open(t, node, "")
	n := network("evil", "10.75.0.0/24", 0, true)
	n.Egress = hostnet.Egress{Allow: []hostnet.EgressRule{{Prefix: netip.MustParsePrefix("10.74.0.0/24")}}}
	vm := netip.MustParseAddr("10.75.0.2")
	at, err := h.Attach(n, "vm-evil", vm)
	if err != nil {
		t.Fatal(err)
	}
	g := newGuest(t, at.Tap, vm, n.Gateway)

	var sock *net.UDPConn
	if err := testnetns.Do(node, func() (err error) {
		sock, err = net.DialUDP("udp4", nil, &net.UDPAddr{IP: net.ParseIP("10.74.0.1"), Port: 9999})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer sock.Close()
	if _, err := sock.Write([]byte("x")); err != nil { // the connection conntrack knows
		t.Fatal(err)
	}
	sport := uint16(sock.LocalAddr().(*net.UDPAddr).Port)
	nodeIP, lanIP := netip.MustParseAddr("10.74.0.100"), netip.MustParseAddr("10.74.0.1")
	inner := ipv4Frame(nil, nil, nodeIP, lanIP, unix.IPPROTO_UDP, udp(sport, 9999, []byte("x")))[2:] // no Ethernet header
	icmp := append([]byte{3, 3, 0, 0, 0, 0, 0, 0}, inner...)                                         // port unreachable
	binary.BigEndian.PutUint16(icmp[2:], checksum(icmp))
	for i := 0; i < 3; i++ {
		g.send(ipv4Frame(hostnet.MAC(vm), hostnet.MAC(n.Gateway), vm, nodeIP, unix.IPPROTO_ICMP, icmp))
		time.Sleep(100 * time.Millisecond)
	}
	_ = sock.SetReadDeadline(time.Now().Add(2 * time.Second))
	_, err = sock.Read(make([]byte, 16))
	if !os.IsTimeout(err) {
		t.Fatalf("the node's socket heard %v from a guest's forged ICMP error; want nothing (a timeout)", err)
	}
}
