package hostnet_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/testnetns"
)

func network(name, cidr string, vni uint32, nat bool) hostnet.Network {
	p := netip.MustParsePrefix(cidr)
	n := hostnet.Network{Namespace: "ns", Name: name, UID: "uid-" + name, VNI: vni, Prefix: p, Gateway: p.Addr().Next(), NAT: nat}
	if nat {
		n.Egress = hostnet.PublicEgress // the agent's default
	}
	return n
}

func open(t *testing.T, ns string, vtep string) *hostnet.Host {
	t.Helper()
	opts := hostnet.Options{NetNS: ns, NSDir: testnetns.PinDir(t), StateDir: t.TempDir()}
	if vtep != "" {
		opts.VTEP = netip.MustParseAddr(vtep)
	}
	h, err := hostnet.Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	return h
}

// impLinks lists the links of ns whose names IMP uses, with their addresses.
func impLinks(t *testing.T, nl *netlink.Handle) []string {
	t.Helper()
	links, err := nl.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range links {
		if !strings.HasPrefix(l.Attrs().Name, "imp") {
			continue
		}
		addrs, _ := nl.AddrList(l, unix.AF_INET)
		s := l.Type() + " " + l.Attrs().Name
		for _, a := range addrs {
			s += " " + a.IPNet.String()
		}
		out = append(out, s)
	}
	sort.Strings(out)
	return out
}

func forwarding(t *testing.T, ns string) string {
	t.Helper()
	var v []byte
	if err := testnetns.Do(ns, func() (err error) {
		v, err = os.ReadFile("/proc/sys/net/ipv4/ip_forward")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(v))
}

func fdb(t *testing.T, nl *netlink.Handle, dev string) []string {
	t.Helper()
	l, err := nl.LinkByName(dev)
	if err != nil {
		t.Fatal(err)
	}
	entries, err := nl.NeighList(l.Attrs().Index, unix.AF_BRIDGE)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if e.IP != nil {
			out = append(out, e.HardwareAddr.String()+" "+e.IP.String())
		}
	}
	sort.Strings(out)
	return out
}

// attach attaches a VM and closes its tap, returning the network's namespace.
func attach(t *testing.T, h *hostnet.Host, n hostnet.Network, vm, ip string) string {
	t.Helper()
	at, err := h.Attach(n, vm, netip.MustParseAddr(ip))
	if err != nil {
		t.Fatal(err)
	}
	at.Tap.Close()
	return at.NetNS
}

// routes lists the IPv4 destinations of ns's main table.
func routes(t *testing.T, nl *netlink.Handle) []string {
	t.Helper()
	rs, err := nl.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range rs {
		if r.Dst != nil {
			out = append(out, r.Dst.String())
		} else {
			out = append(out, "default")
		}
	}
	sort.Strings(out)
	return out
}

func TestNetworkLifecycle(t *testing.T) {
	ns := testnetns.New(t, "imp-hn-life")
	nl := testnetns.Handle(t, ns)
	h := open(t, ns, "192.0.2.1")
	n := network("blue", "10.77.0.0/24", 100, true)

	space := attach(t, h, n, "vm-1", "10.77.0.2")
	in := testnetns.Handle(t, space)
	br, vx, tn := n.BridgeName(), n.VXLANName(), hostnet.TapName("vm-1")
	id := strings.TrimPrefix(br, "impb")
	if got, want := impLinks(t, in), []string{"bridge " + br + " 10.77.0.1/24", "tuntap " + tn, "veth impu" + id + " 169.254.210.2/32"}; !slices.Equal(got, want) {
		t.Fatalf("links of the network's namespace after Attach = %q, want %q", got, want)
	}
	// The node holds the transit link's end, without an address, and a route to the
	// network's transit address: nothing of the tenant's CIDR.
	if got, want := impLinks(t, nl), []string{"veth impe" + id}; !slices.Equal(got, want) {
		t.Fatalf("links of the node after Attach = %q, want %q", got, want)
	}
	if got := routes(t, nl); !slices.Equal(got, []string{"169.254.210.2/32"}) {
		t.Errorf("node routes = %q, want only the transit address", got)
	}
	if got := routes(t, in); !slices.Equal(got, []string{"0.0.0.0/0", "10.77.0.0/24", "169.254.210.1/32"}) {
		t.Errorf("routes of the network's namespace = %q", got)
	}
	l, _ := in.LinkByName(br)
	if l.Attrs().HardwareAddr.String() != "0a:58:0a:4d:00:01" || l.Attrs().Alias != "imp-net:ns/blue" {
		t.Errorf("bridge MAC %s alias %q", l.Attrs().HardwareAddr, l.Attrs().Alias)
	}
	tl, _ := in.LinkByName(tn)
	if tl.Attrs().MasterIndex != l.Attrs().Index || tl.Attrs().MTU != hostnet.DefaultMTU || tl.Attrs().Flags&net.FlagUp == 0 {
		t.Errorf("tap master %d (bridge %d), MTU %d, flags %v", tl.Attrs().MasterIndex, l.Attrs().Index, tl.Attrs().MTU, tl.Attrs().Flags)
	}
	rules, err := h.Rules()
	if err != nil {
		t.Fatal(err)
	}
	// The node's: input 6 (replies over transit links, transit links, VXLAN peers, VXLAN
	// frames of the peers' VMs: IPv4, ARP, the rest dropped), forward 8 (replies over transit
	// links, between networks, not IPv4, link-local, four overlay ports), 1 masquerade; the
	// network's: input 4, forward 18 (policy of VMs' ingress, bridged, replies, exposed VMs
	// both ways, the 11 non-public ranges, public egress, the rest), polpre 1 (policy of VMs'
	// egress), 2 masquerade (egress, exposed VMs), bridge prerouting 2, bridge postrouting 1
	// (each tap's in- chain); the tap's chain:
	// 6 (5 anti-spoofing, the count of what passed), its in- chain 1 (the count of what it
	// gets).
	if len(rules) != 15+28+7 {
		t.Errorf("rules after Attach = %d, want 50:\n%s", len(rules), strings.Join(rules, "\n"))
	}
	if forwarding(t, ns) != "1" {
		t.Error("IPv4 forwarding is off with a NAT network present")
	}

	// Attaching again changes nothing.
	attach(t, h, n, "vm-1", "10.77.0.2")
	if again, _ := h.Rules(); !slices.Equal(again, rules) {
		t.Errorf("rules changed on a second Attach:\n%s", strings.Join(again, "\n"))
	}

	peers := []hostnet.Peer{
		{IP: netip.MustParseAddr("10.77.0.3"), VTEP: netip.MustParseAddr("192.0.2.2")},
		{IP: netip.MustParseAddr("10.77.0.4"), VTEP: netip.MustParseAddr("192.0.2.2")},
		{IP: netip.MustParseAddr("10.77.0.5"), VTEP: netip.MustParseAddr("192.0.2.3")},
	}
	if present, err := h.Sync(n, peers); err != nil || !present {
		t.Fatalf("Sync = %v, %v", present, err)
	}
	v, err := in.LinkByName(vx)
	if err != nil {
		t.Fatal(err)
	}
	if x := v.(*netlink.Vxlan); x.VxlanId != 100 || x.Port != hostnet.DefaultVXLANPort || x.Learning || x.MasterIndex != l.Attrs().Index {
		t.Errorf("vxlan %+v", x)
	}
	want := []string{"00:00:00:00:00:00 192.0.2.2", "00:00:00:00:00:00 192.0.2.3", "0a:58:0a:4d:00:03 192.0.2.2", "0a:58:0a:4d:00:04 192.0.2.2", "0a:58:0a:4d:00:05 192.0.2.3"}
	if got := fdb(t, in, vx); !slices.Equal(got, want) {
		t.Errorf("fdb = %q, want %q", got, want)
	}
	if got := vxlanPeers(t, ns); !slices.Equal(got, []string{"192.0.2.2 100", "192.0.2.3 100"}) {
		t.Errorf("overlay peers = %q", got)
	}
	// A peer leaves, and with it its node.
	if _, err := h.Sync(n, peers[:2]); err != nil {
		t.Fatal(err)
	}
	want = []string{"00:00:00:00:00:00 192.0.2.2", "0a:58:0a:4d:00:03 192.0.2.2", "0a:58:0a:4d:00:04 192.0.2.2"}
	if got := fdb(t, in, vx); !slices.Equal(got, want) {
		t.Errorf("fdb after a peer left = %q, want %q", got, want)
	}
	if got := vxlanPeers(t, ns); !slices.Equal(got, []string{"192.0.2.2 100"}) {
		t.Errorf("overlay peers after a node left = %q", got)
	}

	if err := h.Detach("vm-1"); err != nil {
		t.Fatal(err)
	}
	if present, err := h.Sync(n, peers); err != nil || present {
		t.Fatalf("Sync without VMs = %v, %v", present, err)
	}
	if got := impLinks(t, nl); len(got) != 0 {
		t.Errorf("links left: %q", got)
	}
	if got, _ := h.Rules(); len(got) != 0 {
		t.Errorf("rules left: %q", got)
	}
	if got := routes(t, nl); len(got) != 0 {
		t.Errorf("routes left: %q", got)
	}
	if _, err := os.Stat(space); !os.IsNotExist(err) {
		t.Errorf("the network's namespace is still pinned at %s: %v", space, err)
	}
	if forwarding(t, ns) != "0" {
		t.Error("IPv4 forwarding stayed on after the NAT network left")
	}
}

// vxlanPeers lists the node's overlay admissions as "address VNI".
func vxlanPeers(t *testing.T, ns string) []string {
	t.Helper()
	conn := nftConn(t, ns)
	set, err := conn.GetSetByName(&nftables.Table{Family: nftables.TableFamilyINet, Name: "imp"}, "vxlan-peers")
	if err != nil {
		return nil
	}
	els, err := conn.GetSetElements(set)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range els {
		out = append(out, fmt.Sprintf("%s %d", netip.AddrFrom4([4]byte(e.Key[:4])), binary.BigEndian.Uint32(e.Key[4:])>>8))
	}
	sort.Strings(out)
	return out
}

func TestPrune(t *testing.T) {
	ns := testnetns.New(t, "imp-hn-prune")
	nl := testnetns.Handle(t, ns)
	h := open(t, ns, "")
	red, green := network("red", "10.78.0.0/24", 0, false), network("green", "10.79.0.0/16", 0, true)
	spaces := map[string]string{}
	for _, a := range []struct {
		n  hostnet.Network
		vm string
		ip string
	}{{red, "vm-1", "10.78.0.2"}, {red, "vm-2", "10.78.0.3"}, {green, "vm-3", "10.79.3.4"}} {
		spaces[a.n.Name] = attach(t, h, a.n, a.vm, a.ip)
	}
	if got, _ := h.Present(); !slices.Equal(sorted(got), []string{"ns/green", "ns/red"}) {
		t.Errorf("Present = %q", got)
	}
	if err := h.Prune(func(uid string) bool { return uid == "vm-1" }); err != nil {
		t.Fatal(err)
	}
	want := []string{"bridge " + red.BridgeName() + " 10.78.0.1/24", "tuntap " + hostnet.TapName("vm-1")}
	if got := impLinks(t, testnetns.Handle(t, spaces["red"])); !slices.Equal(got, want) {
		t.Errorf("links after Prune = %q, want %q", got, want)
	}
	if _, err := os.Stat(spaces["green"]); !os.IsNotExist(err) {
		t.Errorf("green's namespace is still pinned: %v", err)
	}
	if got := impLinks(t, nl); len(got) != 0 {
		t.Errorf("the node keeps links of green, which has no VM left: %q", got)
	}
	rules, _ := h.Rules()
	for _, r := range rules {
		if strings.Contains(r, hostnet.TapName("vm-2")) || strings.Contains(r, hostnet.TapName("vm-3")) {
			t.Errorf("rule of a pruned tap left: %s", r)
		}
	}
	if err := h.Prune(func(string) bool { return false }); err != nil {
		t.Fatal(err)
	}
	if got := impLinks(t, nl); len(got) != 0 {
		t.Errorf("links left: %q", got)
	}
	if got, _ := h.Rules(); len(got) != 0 {
		t.Errorf("rules left: %q", got)
	}
	if entries, _ := os.ReadDir(filepath.Dir(spaces["red"])); len(entries) != 0 {
		t.Errorf("namespaces left: %v", entries)
	}
}

func sorted(s []string) []string { sort.Strings(s); return s }

// arpRequest is a broadcast ARP request as a tap opened with IFF_VNET_HDR carries it: a zero
// virtio-net header first.
func arpRequest(srcMAC net.HardwareAddr, senderMAC net.HardwareAddr, senderIP, targetIP netip.Addr) []byte {
	var b bytes.Buffer
	b.Write(make([]byte, 10)) // virtio_net_hdr
	b.Write([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	b.Write(srcMAC)
	_ = binary.Write(&b, binary.BigEndian, uint16(unix.ETH_P_ARP))
	_ = binary.Write(&b, binary.BigEndian, []uint16{1, unix.ETH_P_IP})
	b.Write([]byte{6, 4, 0, 1})
	b.Write(senderMAC)
	s, tg := senderIP.As4(), targetIP.As4()
	b.Write(s[:])
	b.Write(make([]byte, 6))
	b.Write(tg[:])
	return b.Bytes()
}

// udpPacket is an IPv4 UDP datagram in an Ethernet frame, behind a zero virtio-net header.
func udpPacket(srcMAC, dstMAC net.HardwareAddr, src, dst netip.Addr) []byte {
	return append(make([]byte, 10), ipv4Frame(srcMAC, dstMAC, src, dst, unix.IPPROTO_UDP, udp(12345, 12345, []byte("imp!")))...)
}

// TestAntiSpoofing writes frames into one VM's tap as its guest would and reads what reaches
// another VM's tap on the same bridge.
func TestAntiSpoofing(t *testing.T) {
	ns := testnetns.New(t, "imp-hn-spoof")
	h := open(t, ns, "")
	n := network("spoof", "10.80.0.0/24", 0, false)
	ipA, ipB := netip.MustParseAddr("10.80.0.2"), netip.MustParseAddr("10.80.0.3")
	atA, err := h.Attach(n, "vm-a", ipA)
	if err != nil {
		t.Fatal(err)
	}
	tapA := atA.Tap
	defer tapA.Close()
	atB, err := h.Attach(n, "vm-b", ipB)
	if err != nil {
		t.Fatal(err)
	}
	tapB := atB.Tap
	defer tapB.Close()
	macA, macB := hostnet.MAC(ipA), hostnet.MAC(ipB)
	target := netip.MustParseAddr("10.80.0.9")

	// received reads tapB until a frame for sentinel arrives (an ARP request from A, sent after
	// the frame under test: the bridge keeps their order) and says whether an ARP request for
	// target, or a datagram to target, came before it. The bound only ends a broken run.
	sentinel := netip.MustParseAddr("10.80.0.250")
	received := func(target netip.Addr) bool {
		if _, err := tapA.Write(arpRequest(macA, macA, ipA, sentinel)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 2048)
		deadline := time.Now().Add(30 * time.Second)
		seen := false
		for {
			_ = tapB.SetReadDeadline(deadline)
			n, err := tapB.Read(buf)
			if err != nil {
				t.Fatalf("the sentinel frame never reached the other VM: %v", err)
			}
			f := buf[10:n]
			for addr, hit := range map[netip.Addr]*bool{target: &seen, sentinel: nil} {
				a4 := addr.As4()
				arp := len(f) >= 42 && binary.BigEndian.Uint16(f[12:]) == unix.ETH_P_ARP && bytes.Equal(f[38:42], a4[:])
				ip := len(f) >= 34 && binary.BigEndian.Uint16(f[12:]) == unix.ETH_P_IP && bytes.Equal(f[30:34], a4[:])
				if arp || ip {
					if hit == nil {
						return seen
					}
					*hit = true
				}
			}
		}
	}
	for _, tc := range []struct {
		name  string
		frame []byte
		want  bool
	}{
		{"its own MAC and IP", arpRequest(macA, macA, ipA, target), true},
		// Bridged within the network, also where br_netfilter shows it to the IP hooks.
		{"a datagram to the other VM", udpPacket(macA, macB, ipA, ipB), true},
		{"a datagram from another VM's IP", udpPacket(macA, macB, target, ipB), false},
		{"another VM's IP", arpRequest(macA, macA, ipB, target), false},
		{"another VM's MAC", arpRequest(macB, macB, ipA, target), false},
		{"its MAC outside, another inside the ARP", arpRequest(macA, macB, ipA, target), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tapA.Write(tc.frame); err != nil {
				t.Fatal(err)
			}
			look := target
			if binary.BigEndian.Uint16(tc.frame[10+12:]) == unix.ETH_P_IP {
				look = ipB
			}
			if got := received(look); got != tc.want {
				t.Errorf("frame reached the other VM: %v, want %v", got, tc.want)
			}
		})
	}
}

// TestForwardingMarkerOfAnEarlierBoot: forwarding that the node's own configuration turned on
// stays on when the last NAT network leaves, although a marker from an earlier boot says IMP
// had turned it on then; within one boot, IMP turns off what it turned on.
func TestForwardingMarkerOfAnEarlierBoot(t *testing.T) {
	for _, tt := range []struct {
		name, marker string // marker left in the state directory; "" for none
		wantAfter    string // ip_forward once the NAT network is gone
	}{
		{"marker of an earlier boot", "boot-1\n", "1"},
		{"marker of the format before boot ids", "", "1"},
		{"no marker", "-", "1"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ns := testnetns.New(t, "imp-hn-fwd")
			if err := testnetns.Do(ns, func() error { return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644) }); err != nil {
				t.Fatal(err)
			}
			state := t.TempDir()
			if tt.marker != "-" {
				if err := os.WriteFile(filepath.Join(state, "ip_forward-enabled-by-imp"), []byte(tt.marker), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			h, err := hostnet.Open(hostnet.Options{NetNS: ns, NSDir: testnetns.PinDir(t), StateDir: state, BootID: "boot-2"})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(h.Close)
			attachAndLeave(t, h)
			if got := forwarding(t, ns); got != tt.wantAfter {
				t.Errorf("ip_forward = %s after the last NAT network left, want %s (the node turned it on)", got, tt.wantAfter)
			}
		})
	}

	// Within one boot, IMP turns off what it turned on.
	ns := testnetns.New(t, "imp-hn-fwd")
	if err := testnetns.Do(ns, func() error { return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("0"), 0o644) }); err != nil {
		t.Fatal(err)
	}
	h, err := hostnet.Open(hostnet.Options{NetNS: ns, NSDir: testnetns.PinDir(t), StateDir: t.TempDir(), BootID: "boot-2"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	attachAndLeave(t, h, func() {
		if got := forwarding(t, ns); got != "1" {
			t.Fatalf("ip_forward = %s with a NAT network", got)
		}
	})
	if got := forwarding(t, ns); got != "0" {
		t.Errorf("ip_forward = %s after IMP's own NAT network left, want 0", got)
	}
}

// attachAndLeave attaches a VM to a NAT network, runs while, then detaches it and syncs the
// network away.
func attachAndLeave(t *testing.T, h *hostnet.Host, while ...func()) {
	t.Helper()
	n := network("blue", "10.78.0.0/24", 0, true)
	attach(t, h, n, "vm-1", "10.78.0.2")
	for _, f := range while {
		f()
	}
	if err := h.Detach("vm-1"); err != nil {
		t.Fatal(err)
	}
	if present, err := h.Sync(n, nil); err != nil || present {
		t.Fatalf("Sync without VMs = %v, %v", present, err)
	}
}

// arpReply reads tap until an ARP reply for ip arrives and returns its sender MAC; ok is false
// when none came within the bound.
func arpReply(t *testing.T, tap *os.File, ip netip.Addr, bound time.Duration) (net.HardwareAddr, bool) {
	t.Helper()
	buf := make([]byte, 2048)
	a := ip.As4()
	deadline := time.Now().Add(bound)
	for {
		_ = tap.SetReadDeadline(deadline)
		n, err := tap.Read(buf)
		if err != nil {
			return nil, false
		}
		f := buf[10:n]
		if len(f) >= 42 && binary.BigEndian.Uint16(f[12:]) == unix.ETH_P_ARP && binary.BigEndian.Uint16(f[20:]) == 2 && bytes.Equal(f[28:32], a[:]) {
			return net.HardwareAddr(f[22:28]), true
		}
	}
}

// TestSameCIDRSideBySide: two networks with the same CIDR on one node, whose own subnet is
// that CIDR too. Each VM reaches its own network's gateway, and nothing of the other network;
// the node's routing table holds neither network, and the node still reaches a host of its
// own subnet.
func TestSameCIDRSideBySide(t *testing.T) {
	ns, lan := testnetns.New(t, "imp-hn-same"), testnetns.New(t, "imp-hn-lan")
	testnetns.Link(t, ns, "eth0", "10.70.0.100/24", lan, "eth0", "10.70.0.1/24")
	nl := testnetns.Handle(t, ns)
	lanHost := serve(t, lan, "10.70.0.1:8080")
	h := open(t, ns, "")
	one, two := network("one", "10.70.0.0/24", 0, true), network("two", "10.70.0.0/24", 0, false)
	two.Namespace = "other"
	ip := netip.MustParseAddr("10.70.0.2")
	taps := map[string]*os.File{}
	for _, n := range []hostnet.Network{one, two} {
		at, err := h.Attach(n, "vm-"+n.Name, ip)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { at.Tap.Close() })
		taps[n.Name] = at.Tap
	}
	for _, r := range routes(t, nl) {
		if r != "10.70.0.0/24" && strings.HasPrefix(r, "10.70.") {
			t.Errorf("node route %s", r)
		}
	}
	if got := routes(t, nl); slices.Index(got, "10.70.0.0/24") < 0 || len(got) != 2 {
		t.Errorf("node routes = %q, want its own subnet and one transit address", got)
	}
	if err := testnetns.Do(ns, func() error { return dial(lanHost) }); err != nil {
		t.Errorf("the node lost its own subnet: %v", err)
	}
	// Each VM's ARP request for the gateway is answered in its own network alone.
	gw := one.Gateway
	if _, err := taps["one"].Write(arpRequest(hostnet.MAC(ip), hostnet.MAC(ip), ip, gw)); err != nil {
		t.Fatal(err)
	}
	if mac, ok := arpReply(t, taps["one"], gw, 10*time.Second); !ok || mac.String() != hostnet.MAC(gw).String() {
		t.Errorf("network one's gateway did not answer its VM: %v %v", mac, ok)
	}
	if _, ok := arpReply(t, taps["two"], gw, time.Second); ok {
		t.Error("network two's VM saw a reply to network one's VM")
	}
}

// serve accepts TCP connections on addr inside the namespace at path, until the test ends.
func serve(t *testing.T, path, addr string) string {
	t.Helper()
	greet(t, path, addr, "server")
	return addr
}

func dial(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err == nil {
		c.Close()
	}
	return err
}

// vxlanFrame is a VXLAN packet's payload: the header with vni, then inner.
func vxlanFrame(vni uint32, inner []byte) []byte {
	h := make([]byte, 8)
	h[0] = 0x08
	binary.BigEndian.PutUint32(h[4:], vni<<8)
	return append(h, inner...)
}

// underlay makes a node (192.0.2.1) and, linked to it, a namespace holding the addresses of
// two other nodes (192.0.2.2 and .3), named name and name+"r".
func underlay(t *testing.T, name string) (node, remote string) {
	t.Helper()
	node, remote = testnetns.New(t, name), testnetns.New(t, name+"r")
	testnetns.Link(t, node, "under0", "192.0.2.1/24", remote, "under0", "192.0.2.2/24")
	hr := testnetns.Handle(t, remote)
	u, _ := hr.LinkByName("under0")
	if err := hr.AddrAdd(u, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP("192.0.2.3"), Mask: net.CIDRMask(24, 32)}}); err != nil {
		t.Fatal(err)
	}
	return node, remote
}

// TestVXLANFromPeersOnly sends VXLAN packets with the network's VNI to the node's overlay port
// from a peer node's address and from another: only the peer's reach the VM's tap, and the
// others are counted as dropped.
func TestVXLANFromPeersOnly(t *testing.T) {
	node, remote := underlay(t, "imp-hn-vx")
	h := open(t, node, "192.0.2.1")
	n := network("vx", "10.71.0.0/24", 4711, false)
	vmIP, peerIP := netip.MustParseAddr("10.71.0.2"), netip.MustParseAddr("10.71.0.3")
	at, err := h.Attach(n, "vm-1", vmIP)
	if err != nil {
		t.Fatal(err)
	}
	defer at.Tap.Close()
	if _, err := h.Sync(n, []hostnet.Peer{{IP: peerIP, VTEP: netip.MustParseAddr("192.0.2.2")}}); err != nil {
		t.Fatal(err)
	}
	send := func(from string, target netip.Addr) {
		t.Helper()
		err := testnetns.Do(remote, func() error {
			c, err := net.DialUDP("udp4", &net.UDPAddr{IP: net.ParseIP(from)}, &net.UDPAddr{IP: net.ParseIP("192.0.2.1"), Port: hostnet.DefaultVXLANPort})
			if err != nil {
				return err
			}
			defer c.Close()
			frame := arpRequest(hostnet.MAC(peerIP), hostnet.MAC(peerIP), peerIP, target)[10:] // no virtio header on the wire
			_, err = c.Write(vxlanFrame(n.VNI, frame))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// arrived reads the VM's tap until the ARP request for sentinel (sent by the peer after
	// the packet under test) and says whether one for target came first.
	arrived := func(target, sentinel netip.Addr) bool {
		buf := make([]byte, 2048)
		deadline := time.Now().Add(10 * time.Second)
		seen := false
		for {
			_ = at.Tap.SetReadDeadline(deadline)
			k, err := at.Tap.Read(buf)
			if err != nil {
				t.Fatalf("the peer's packet never reached the VM: %v", err)
			}
			f := buf[10:k]
			if len(f) < 42 || binary.BigEndian.Uint16(f[12:]) != unix.ETH_P_ARP {
				continue
			}
			switch tgt := netip.AddrFrom4([4]byte(f[38:42])); tgt {
			case target:
				seen = true
			case sentinel:
				return seen
			}
		}
	}
	before := vxlanDrops(t, node)
	send("192.0.2.3", netip.MustParseAddr("10.71.0.9"))
	send("192.0.2.2", netip.MustParseAddr("10.71.0.10"))
	if arrived(netip.MustParseAddr("10.71.0.9"), netip.MustParseAddr("10.71.0.10")) {
		t.Error("a VXLAN packet from a node that is no peer of the network reached the VM")
	}
	if after := vxlanDrops(t, node); after != before+1 {
		t.Errorf("dropped VXLAN packets: %d, then %d; want one more", before, after)
	}
	send("192.0.2.2", netip.MustParseAddr("10.71.0.11"))
	send("192.0.2.2", netip.MustParseAddr("10.71.0.12"))
	if !arrived(netip.MustParseAddr("10.71.0.11"), netip.MustParseAddr("10.71.0.12")) {
		t.Error("a VXLAN packet from the peer did not reach the VM")
	}
	// The peer's node sending with another network's VNI is no peer of that one.
	if err := testnetns.Do(remote, func() error {
		c, err := net.DialUDP("udp4", &net.UDPAddr{IP: net.ParseIP("192.0.2.2")}, &net.UDPAddr{IP: net.ParseIP("192.0.2.1"), Port: hostnet.DefaultVXLANPort})
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write(vxlanFrame(4712, make([]byte, 42)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if got := vxlanDrops(t, node); got != before+2 {
		t.Errorf("a packet of another VNI from a peer of this one: drops %d, want %d", got, before+2)
	}
}

// vxlanDrops reads the counter of the node's rule that drops VXLAN from non-peers.
func vxlanDrops(t *testing.T, ns string) uint64 {
	t.Helper()
	conn := nftConn(t, ns)
	table := &nftables.Table{Family: nftables.TableFamilyINet, Name: "imp"}
	rs, err := conn.GetRules(table, &nftables.Chain{Name: "input", Table: table})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		lookup := false
		for _, e := range r.Exprs {
			switch e := e.(type) {
			case *expr.Lookup:
				lookup = e.SetName == "vxlan-peers"
			case *expr.Counter:
				if lookup {
					return e.Packets
				}
			}
		}
	}
	t.Fatal("no rule drops VXLAN from non-peers")
	return 0
}

// TestMigrationFromTheNodeNamespace: a VM plumbed by an agent of the earlier layout (bridge,
// tap and rules in the node's namespace) keeps its tap, open as its VMM holds it, when a Host
// opens: the tap moves into the network's namespace, where the gateway still answers it with
// the same MAC, and its anti-spoofing rules come along; the node keeps nothing of the network.
func TestMigrationFromTheNodeNamespace(t *testing.T) {
	ns := testnetns.New(t, "imp-hn-migr")
	nl := testnetns.Handle(t, ns)
	n := network("old", "10.72.0.0/24", 0, false)
	ip := netip.MustParseAddr("10.72.0.2")
	tap, err := hostnet.LegacyAttach(ns, n, "vm-1", ip)
	if err != nil {
		t.Fatal(err)
	}
	defer tap.Close()
	if got := routes(t, nl); !slices.Equal(got, []string{"10.72.0.0/24"}) {
		t.Fatalf("the earlier layout: node routes %q", got)
	}
	h := open(t, ns, "")
	if got := impLinks(t, nl); len(got) != 0 {
		t.Errorf("node links after the migration: %q", got)
	}
	if got := routes(t, nl); len(got) != 0 {
		t.Errorf("node routes after the migration: %q", got)
	}
	rules, err := h.Rules()
	if err != nil {
		t.Fatal(err)
	}
	tapRules := 0
	for _, r := range rules {
		if strings.Contains(r, " tap-"+hostnet.TapName("vm-1")+" ") {
			tapRules++
		}
		if strings.HasPrefix(r, "node ") && !strings.Contains(r, "imp:node:") {
			t.Errorf("a rule of the earlier layout is left in the node: %s", r)
		}
	}
	if tapRules != 6 {
		t.Errorf("the moved tap has %d rules, want 6 (5 anti-spoofing, a count):\n%s", tapRules, strings.Join(rules, "\n"))
	}
	if _, err := tap.Write(arpRequest(hostnet.MAC(ip), hostnet.MAC(ip), ip, n.Gateway)); err != nil {
		t.Fatal(err)
	}
	if mac, ok := arpReply(t, tap, n.Gateway, 10*time.Second); !ok || mac.String() != hostnet.MAC(n.Gateway).String() {
		t.Errorf("after the migration the gateway answered %v (%v), want %s", mac, ok, hostnet.MAC(n.Gateway))
	}
	if got, _ := h.Present(); !slices.Equal(got, []string{"ns/old"}) {
		t.Errorf("Present = %q", got)
	}
}

// nftConn is an nftables connection in the namespace at path, closed when the test ends.
func nftConn(t *testing.T, path string) *nftables.Conn {
	t.Helper()
	h, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() }) // each request opens its socket through it
	conn, err := nftables.New(nftables.WithNetNSFd(int(h)))
	if err != nil {
		t.Fatal(err)
	}
	return conn
}

// TestVXLANFramesOnlyOfThePeersVMs: a peer node of a network (compromised: root, its own
// VXLAN socket) sends the node frames on that network's overlay as another node's VM, as the
// node's own VM, as the gateway, with its VM's MAC and another's address or the other way
// round, tagged, or too short to tell: none reaches the node's VM. What its own VM sends, and
// what the other peer's VM sends from that peer, does.
func TestVXLANFramesOnlyOfThePeersVMs(t *testing.T) {
	node, remote := underlay(t, "imp-hn-vxv")
	h := open(t, node, "192.0.2.1")
	n := network("vxv", "10.71.0.0/24", 4713, false)
	ip := func(last byte) netip.Addr { return netip.AddrFrom4([4]byte{10, 71, 0, last}) }
	gw, local, onP, onQ := ip(1), ip(2), ip(3), ip(4) // P is 192.0.2.2 (the attacker), Q 192.0.2.3
	at, err := h.Attach(n, "vm-1", local)
	if err != nil {
		t.Fatal(err)
	}
	defer at.Tap.Close()
	if _, err := h.Sync(n, []hostnet.Peer{{IP: onP, VTEP: netip.MustParseAddr("192.0.2.2")}, {IP: onQ, VTEP: netip.MustParseAddr("192.0.2.3")}}); err != nil {
		t.Fatal(err)
	}
	send := func(from string, frame []byte) {
		t.Helper()
		if err := testnetns.Do(remote, func() error {
			c, err := net.DialUDP("udp4", &net.UDPAddr{IP: net.ParseIP(from)}, &net.UDPAddr{IP: net.ParseIP("192.0.2.1"), Port: hostnet.DefaultVXLANPort})
			if err != nil {
				return err
			}
			defer c.Close()
			_, err = c.Write(vxlanFrame(n.VNI, frame))
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	arp := func(src, sender net.HardwareAddr, senderIP netip.Addr, target byte) []byte {
		return arpRequest(src, sender, senderIP, ip(target))[10:]
	}
	toLocal := func(src net.HardwareAddr, srcIP netip.Addr, port uint16) []byte {
		return ipv4Frame(src, hostnet.MAC(local), srcIP, local, unix.IPPROTO_UDP, udp(port, port, []byte("imp!")))
	}
	mac := hostnet.MAC
	tagged := append(append(append([]byte{}, arp(mac(onP), mac(onP), onP, 25)[:12]...), 0x81, 0x00, 0x00, 0x07), arp(mac(onP), mac(onP), onP, 25)[12:]...)
	forged := []struct {
		what  string
		frame []byte
	}{
		{"ARP as Q's VM", arp(mac(onQ), mac(onQ), onQ, 20)},
		{"ARP as the node's own VM", arp(mac(local), mac(local), local, 21)},
		{"ARP as the gateway", arp(mac(gw), mac(gw), gw, 22)},
		{"ARP from P's VM's MAC with Q's VM's address", arp(mac(onP), mac(onP), onQ, 23)},
		{"ARP from P's VM's MAC with Q's VM's sender MAC", arp(mac(onP), mac(onQ), onP, 24)},
		{"IPv4 from P's VM's MAC with Q's VM's address", toLocal(mac(onP), onQ, 4001)},
		{"IPv4 from Q's VM's MAC", toLocal(mac(onQ), onP, 4002)},
		{"IPv4 from a MAC of no VM", toLocal(net.HardwareAddr{0x02, 0, 10, 71, 0, 3}, onP, 4003)},
		{"a VLAN-tagged ARP from P's VM", tagged},
		{"IPv4 too short to hold its source", toLocal(mac(onP), onP, 4004)[:30]},
	}
	for _, f := range forged {
		send("192.0.2.2", f.frame)
	}
	send("192.0.2.2", arp(mac(onP), mac(onP), onP, 30))
	send("192.0.2.2", toLocal(mac(onP), onP, 4010))
	send("192.0.2.3", arp(mac(onQ), mac(onQ), onQ, 31))
	send("192.0.2.2", arp(mac(onP), mac(onP), onP, 99)) // the sentinel: P's, last

	// What reached the VM's tap before the sentinel: ARP targets, UDP ports, anything else.
	seen := map[string]bool{}
	buf := make([]byte, 2048)
	deadline := time.Now().Add(10 * time.Second)
	for !seen["arp 10.71.0.99"] {
		_ = at.Tap.SetReadDeadline(deadline)
		k, err := at.Tap.Read(buf)
		if err != nil {
			t.Fatalf("the sentinel never reached the VM (%v); saw %v", err, seen)
		}
		f := buf[10:k]
		switch {
		case len(f) >= 42 && binary.BigEndian.Uint16(f[12:]) == unix.ETH_P_ARP:
			seen["arp "+netip.AddrFrom4([4]byte(f[38:42])).String()] = true
		case len(f) >= 38 && binary.BigEndian.Uint16(f[12:]) == unix.ETH_P_IP && f[23] == unix.IPPROTO_UDP:
			seen[fmt.Sprintf("udp %d", binary.BigEndian.Uint16(f[36:]))] = true
		case len(f) >= 24 && binary.BigEndian.Uint16(f[12:]) == unix.ETH_P_IP && f[23] == unix.IPPROTO_IGMP:
			// the bridge's own multicast reports
		case len(f) >= 14:
			seen[fmt.Sprintf("type %#04x, %d bytes", binary.BigEndian.Uint16(f[12:]), len(f))] = true
		}
	}
	for _, want := range []string{"arp 10.71.0.30", "udp 4010", "arp 10.71.0.31"} {
		if !seen[want] {
			t.Errorf("what a peer's own VM sent did not reach the VM (%s); saw %v", want, seen)
		}
	}
	delete(seen, "arp 10.71.0.99")
	for _, want := range []string{"arp 10.71.0.30", "udp 4010", "arp 10.71.0.31"} {
		delete(seen, want)
	}
	for s := range seen {
		t.Errorf("a frame node P forged reached the VM: %s (sent: %v)", s, forged)
	}
}

// TestTapCounters (issue 49): a tap's counters say what its VM received — unicast frames for
// its MAC, not broadcasts — and what it sent past its anti-spoofing rules, not what they
// dropped.
func TestTapCounters(t *testing.T) {
	ns := testnetns.New(t, "imp-hn-count")
	h := open(t, ns, "")
	n := network("count", "10.81.0.0/24", 0, false)
	ipA, ipB := netip.MustParseAddr("10.81.0.2"), netip.MustParseAddr("10.81.0.3")
	atA, err := h.Attach(n, "vm-a", ipA)
	if err != nil {
		t.Fatal(err)
	}
	defer atA.Tap.Close()
	atB, err := h.Attach(n, "vm-b", ipB)
	if err != nil {
		t.Fatal(err)
	}
	defer atB.Tap.Close()
	macA, macB := hostnet.MAC(ipA), hostnet.MAC(ipB)
	counters := func(vm string) (uint64, uint64) {
		in, out, err := h.TapCounters(n, vm)
		if err != nil {
			t.Fatal(err)
		}
		return in, out
	}
	var wrote uint64
	write := func(f []byte) {
		if _, err := atA.Tap.Write(f); err != nil {
			t.Fatal(err)
		}
		wrote += uint64(len(f)) - 10 // the kernel counts the frame, not its virtio-net header
	}
	write(arpRequest(macA, macA, ipA, ipB))                             // broadcast: reaches B, not counted as B's
	write(udpPacket(macA, macB, ipA, ipB))                              // to B
	write(udpPacket(macA, macB, ipA, ipB))                              // to B
	write(udpPacket(macA, macB, netip.MustParseAddr("10.81.0.9"), ipB)) // spoofed: dropped
	deadline := time.Now().Add(10 * time.Second)
	for {
		inB, _ := counters("vm-b")
		_, outA := counters("vm-a")
		if inB == 2 && outA == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("B received %d (want 2: the two datagrams, not the broadcast nor the spoofed one); A sent %d (want 3)", inB, outA)
		}
		time.Sleep(20 * time.Millisecond)
	}
	inA, _ := counters("vm-a")
	if _, outB := counters("vm-b"); inA != 0 || outB != 0 {
		t.Errorf("A received %d, B sent %d; want none", inA, outB)
	}
	// The taps' own counters (imp_vm_network_*): everything A sent, the spoofed frame too,
	// and nothing it received; B's tap is there and A's traffic is not counted as B's sending.
	taps, err := h.Taps()
	if err != nil {
		t.Fatal(err)
	}
	a, b := taps[hostnet.TapName("vm-a")], taps[hostnet.TapName("vm-b")]
	if _, ok := taps[hostnet.TapName("vm-b")]; !ok || len(taps) != 2 {
		t.Fatalf("taps: %+v, want vm-a's and vm-b's", taps)
	}
	if a.TransmitPackets != 4 || a.TransmitBytes != wrote || a.ReceivePackets != 0 || b.TransmitPackets != 0 {
		t.Errorf("A's tap: %+v, want 4 frames (%d bytes) sent and none received; B's: %+v, want none sent", a, wrote, b)
	}
}
