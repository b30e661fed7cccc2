package hostnet_test

import (
	"bytes"
	"encoding/binary"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/testnetns"
)

func network(name, cidr string, vni uint32, nat bool) hostnet.Network {
	p := netip.MustParsePrefix(cidr)
	return hostnet.Network{Namespace: "ns", Name: name, UID: "uid-" + name, VNI: vni, Prefix: p, Gateway: p.Addr().Next(), NAT: nat}
}

func open(t *testing.T, ns string, vtep string) *hostnet.Host {
	t.Helper()
	opts := hostnet.Options{NetNS: ns, StateDir: t.TempDir()}
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

func TestNetworkLifecycle(t *testing.T) {
	ns := testnetns.New(t, "imp-hn-life")
	nl := testnetns.Handle(t, ns)
	h := open(t, ns, "192.0.2.1")
	n := network("blue", "10.77.0.0/24", 100, true)

	tap, err := h.Attach(n, "vm-1", netip.MustParseAddr("10.77.0.2"))
	if err != nil {
		t.Fatal(err)
	}
	tap.Close()
	br, vx, tn := n.BridgeName(), n.VXLANName(), hostnet.TapName("vm-1")
	if got, want := impLinks(t, nl), []string{"bridge " + br + " 10.77.0.1/24", "tuntap " + tn}; !slices.Equal(got, want) {
		t.Fatalf("links after Attach = %q, want %q", got, want)
	}
	l, _ := nl.LinkByName(br)
	if l.Attrs().HardwareAddr.String() != "0a:58:0a:4d:00:01" || l.Attrs().Alias != "imp-net:ns/blue" {
		t.Errorf("bridge MAC %s alias %q", l.Attrs().HardwareAddr, l.Attrs().Alias)
	}
	tl, _ := nl.LinkByName(tn)
	if tl.Attrs().MasterIndex != l.Attrs().Index || tl.Attrs().MTU != hostnet.DefaultMTU || tl.Attrs().Flags&net.FlagUp == 0 {
		t.Errorf("tap master %d (bridge %d), MTU %d, flags %v", tl.Attrs().MasterIndex, l.Attrs().Index, tl.Attrs().MTU, tl.Attrs().Flags)
	}
	rules, err := h.Rules()
	if err != nil {
		t.Fatal(err)
	}
	// The network's: 5 forward, 1 masquerade, 2 keeping the gateway off the overlay; the tap's: 5.
	if len(rules) != 5+1+2+5 {
		t.Errorf("rules after Attach = %d, want 13:\n%s", len(rules), strings.Join(rules, "\n"))
	}
	if forwarding(t, ns) != "1" {
		t.Error("IPv4 forwarding is off with a NAT network present")
	}

	// Attaching again changes nothing.
	tap, err = h.Attach(n, "vm-1", netip.MustParseAddr("10.77.0.2"))
	if err != nil {
		t.Fatal(err)
	}
	tap.Close()
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
	v, err := nl.LinkByName(vx)
	if err != nil {
		t.Fatal(err)
	}
	if x := v.(*netlink.Vxlan); x.VxlanId != 100 || x.Port != hostnet.DefaultVXLANPort || x.Learning || x.MasterIndex != l.Attrs().Index {
		t.Errorf("vxlan %+v", x)
	}
	want := []string{"00:00:00:00:00:00 192.0.2.2", "00:00:00:00:00:00 192.0.2.3", "0a:58:0a:4d:00:03 192.0.2.2", "0a:58:0a:4d:00:04 192.0.2.2", "0a:58:0a:4d:00:05 192.0.2.3"}
	if got := fdb(t, nl, vx); !slices.Equal(got, want) {
		t.Errorf("fdb = %q, want %q", got, want)
	}
	// A peer leaves, and with it its node.
	if _, err := h.Sync(n, peers[:2]); err != nil {
		t.Fatal(err)
	}
	want = []string{"00:00:00:00:00:00 192.0.2.2", "0a:58:0a:4d:00:03 192.0.2.2", "0a:58:0a:4d:00:04 192.0.2.2"}
	if got := fdb(t, nl, vx); !slices.Equal(got, want) {
		t.Errorf("fdb after a peer left = %q, want %q", got, want)
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
	if forwarding(t, ns) != "0" {
		t.Error("IPv4 forwarding stayed on after the NAT network left")
	}
}

func TestPrune(t *testing.T) {
	ns := testnetns.New(t, "imp-hn-prune")
	nl := testnetns.Handle(t, ns)
	h := open(t, ns, "")
	red, green := network("red", "10.78.0.0/24", 0, false), network("green", "10.79.0.0/16", 0, true)
	for _, a := range []struct {
		n  hostnet.Network
		vm string
		ip string
	}{{red, "vm-1", "10.78.0.2"}, {red, "vm-2", "10.78.0.3"}, {green, "vm-3", "10.79.3.4"}} {
		f, err := h.Attach(a.n, a.vm, netip.MustParseAddr(a.ip))
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	if got, _ := h.Present(); !slices.Equal(sorted(got), []string{"ns/green", "ns/red"}) {
		t.Errorf("Present = %q", got)
	}
	if err := h.Prune(func(uid string) bool { return uid == "vm-1" }); err != nil {
		t.Fatal(err)
	}
	want := []string{"bridge " + red.BridgeName() + " 10.78.0.1/24", "tuntap " + hostnet.TapName("vm-1")}
	if got := impLinks(t, nl); !slices.Equal(got, want) {
		t.Errorf("links after Prune = %q, want %q", got, want)
	}
	rules, _ := h.Rules()
	for _, r := range rules {
		if !strings.Contains(r, red.BridgeName()) && !strings.Contains(r, hostnet.TapName("vm-1")) {
			t.Errorf("rule of a pruned link left: %s", r)
		}
	}
	if len(rules) != 4+5 {
		t.Errorf("rules after Prune = %d, want 9:\n%s", len(rules), strings.Join(rules, "\n"))
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
	var b bytes.Buffer
	b.Write(make([]byte, 10))
	b.Write(dstMAC)
	b.Write(srcMAC)
	_ = binary.Write(&b, binary.BigEndian, uint16(unix.ETH_P_IP))
	ip := []byte{0x45, 0, 0, 20 + 8 + 4, 0, 1, 0, 0, 64, unix.IPPROTO_UDP, 0, 0}
	s, d := src.As4(), dst.As4()
	ip = append(append(ip, s[:]...), d[:]...)
	var sum uint32
	for i := 0; i < len(ip); i += 2 {
		sum += uint32(ip[i])<<8 | uint32(ip[i+1])
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(ip[10:], ^uint16(sum))
	b.Write(ip)
	b.Write([]byte{0x30, 0x39, 0x30, 0x39, 0, 12, 0, 0, 'i', 'm', 'p', '!'}) // no UDP checksum
	return b.Bytes()
}

// TestAntiSpoofing writes frames into one VM's tap as its guest would and reads what reaches
// another VM's tap on the same bridge.
func TestAntiSpoofing(t *testing.T) {
	ns := testnetns.New(t, "imp-hn-spoof")
	h := open(t, ns, "")
	n := network("spoof", "10.80.0.0/24", 0, false)
	ipA, ipB := netip.MustParseAddr("10.80.0.2"), netip.MustParseAddr("10.80.0.3")
	tapA, err := h.Attach(n, "vm-a", ipA)
	if err != nil {
		t.Fatal(err)
	}
	defer tapA.Close()
	tapB, err := h.Attach(n, "vm-b", ipB)
	if err != nil {
		t.Fatal(err)
	}
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
			h, err := hostnet.Open(hostnet.Options{NetNS: ns, StateDir: state, BootID: "boot-2"})
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
	h, err := hostnet.Open(hostnet.Options{NetNS: ns, StateDir: t.TempDir(), BootID: "boot-2"})
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
	tap, err := h.Attach(n, "vm-1", netip.MustParseAddr("10.78.0.2"))
	if err != nil {
		t.Fatal(err)
	}
	tap.Close()
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
