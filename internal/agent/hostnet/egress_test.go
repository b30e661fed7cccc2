package hostnet_test

import (
	"bytes"
	"encoding/binary"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/testnetns"
)

// TestNATEgress: two simulated nodes, A and B, joined by an underlay on a private range, and
// an "outside" server on a public address beyond node A. Network victim has a VM on node B and
// node A as its overlay peer, so B takes VXLAN packets of victim's VNI from A's address. A
// guest on network evil, with NAT, on node A, writes frames into its tap as a hostile guest
// would:
//
//   - a VXLAN packet to B's overlay port with victim's VNI (what NAT used to carry out with
//     node A's address, which B trusts): victim's tap never sees its inner frame, by default
//     nor when evil's egress allows the underlay's range;
//   - a TCP connection to B's listener (B's kubelet, say): refused by default, opened when the
//     network allows the range, refused again for an address the cluster denies;
//   - a TCP connection to the outside: opened by default, refused when the network denies
//     it, or reaches the internet no more.
func TestNATEgress(t *testing.T) {
	nodeA, nodeB, out := testnetns.New(t, "imp-eg-a"), testnetns.New(t, "imp-eg-b"), testnetns.New(t, "imp-eg-out")
	testnetns.Link(t, nodeA, "under0", "192.168.78.1/24", nodeB, "under0", "192.168.78.2/24")
	testnetns.Link(t, nodeA, "uplink0", "203.0.113.1/24", out, "uplink0", "203.0.113.2/24")
	hb := testnetns.Handle(t, nodeB)
	u, _ := hb.LinkByName("under0")
	for _, a := range []string{"192.168.78.3", "192.168.78.4"} {
		if err := hb.AddrAdd(u, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP(a), Mask: net.CIDRMask(24, 32)}}); err != nil {
			t.Fatal(err)
		}
	}
	kubelet, denied := serve(t, nodeB, "192.168.78.3:10250"), serve(t, nodeB, "192.168.78.4:10250")
	outside := serve(t, out, "203.0.113.2:9000")

	optsA := hostnet.Options{NetNS: nodeA, NSDir: testnetns.PinDir(t), StateDir: t.TempDir(), VTEP: netip.MustParseAddr("192.168.78.1"),
		DeniedEgress: []netip.Prefix{netip.MustParsePrefix("192.168.78.4/32")}}
	hA, err := hostnet.Open(optsA)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(hA.Close)
	hB := open(t, nodeB, "192.168.78.2")

	victim := network("victim", "10.72.0.0/24", 5001, false)
	vat, err := hB.Attach(victim, "vm-victim", netip.MustParseAddr("10.72.0.2"))
	if err != nil {
		t.Fatal(err)
	}
	defer vat.Tap.Close()
	if _, err := hB.Sync(victim, []hostnet.Peer{{IP: netip.MustParseAddr("10.72.0.3"), VTEP: netip.MustParseAddr("192.168.78.1")}}); err != nil {
		t.Fatal(err)
	}

	evil := network("evil", "10.73.0.0/24", 0, true)
	evil.Egress = hostnet.PublicEgress
	ip := netip.MustParseAddr("10.73.0.2")
	at, err := hA.Attach(evil, "vm-evil", ip)
	if err != nil {
		t.Fatal(err)
	}
	defer at.Tap.Close()
	g := newGuest(t, at.Tap, ip, evil.Gateway)

	// injected sends victim's VNI to B's overlay port from the guest, then the same from node
	// A itself (B's peer), and says whether the guest's inner frame reached victim's VM before
	// node A's.
	round := uint8(0)
	injected := func() bool {
		t.Helper()
		round++
		attack, sentinel := netip.AddrFrom4([4]byte{10, 72, 0, 100 + round}), netip.AddrFrom4([4]byte{10, 72, 0, 200 + round})
		peer := netip.MustParseAddr("10.72.0.3")
		inner := func(target netip.Addr) []byte {
			return arpRequest(hostnet.MAC(peer), hostnet.MAC(peer), peer, target)[10:]
		}
		g.send(ipv4Frame(hostnet.MAC(ip), hostnet.MAC(evil.Gateway), ip, netip.MustParseAddr("192.168.78.2"), unix.IPPROTO_UDP,
			udp(40000, hostnet.DefaultVXLANPort, vxlanFrame(victim.VNI, inner(attack)))))
		time.Sleep(500 * time.Millisecond)
		if err := testnetns.Do(nodeA, func() error {
			c, err := net.DialUDP("udp4", &net.UDPAddr{IP: net.ParseIP("192.168.78.1")}, &net.UDPAddr{IP: net.ParseIP("192.168.78.2"), Port: hostnet.DefaultVXLANPort})
			if err != nil {
				return err
			}
			defer c.Close()
			_, err = c.Write(vxlanFrame(victim.VNI, inner(sentinel)))
			return err
		}); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 2048)
		seen := false
		deadline := time.Now().Add(10 * time.Second)
		for {
			_ = vat.Tap.SetReadDeadline(deadline)
			k, err := vat.Tap.Read(buf)
			if err != nil {
				t.Fatalf("node A's own VXLAN packet never reached victim's VM: %v", err)
			}
			f := buf[10:k]
			if len(f) < 42 || binary.BigEndian.Uint16(f[12:]) != unix.ETH_P_ARP {
				continue
			}
			switch netip.AddrFrom4([4]byte(f[38:42])) {
			case attack:
				seen = true
			case sentinel:
				return seen
			}
		}
	}
	connects := func(addr string) bool { t.Helper(); return g.connects(t, netip.MustParseAddrPort(addr)) }

	// The default: public addresses only.
	if injected() {
		t.Error("default egress: the guest injected a frame into another network over node B's overlay port")
	}
	if connects(kubelet) {
		t.Error("default egress: the guest connected to node B's listener")
	}
	if !connects(outside) {
		t.Fatal("default egress: the guest cannot reach a public address")
	}

	// The network allows the underlay: B's listener is reached, its overlay port still not,
	// and not the address the cluster denies.
	evil.Egress = hostnet.Egress{Internet: true, Allow: []hostnet.EgressRule{{Prefix: netip.MustParsePrefix("192.168.78.0/24")}}}
	if _, err := hA.Sync(evil, nil); err != nil {
		t.Fatal(err)
	}
	if !connects(kubelet) {
		t.Error("egress allowing 192.168.78.0/24: the guest cannot reach 192.168.78.3")
	}
	if injected() {
		t.Error("egress allowing the underlay: the guest injected a frame over node B's overlay port")
	}
	if connects(denied) {
		t.Error("the guest reached 192.168.78.4, which the cluster denies, because its network allows the range")
	}

	// Denied by port, then the internet off with an allow list.
	evil.Egress = hostnet.Egress{Internet: true, Deny: []hostnet.EgressRule{{Prefix: netip.MustParsePrefix("203.0.113.2/32"),
		Ports: []hostnet.PortRange{{Protocol: unix.IPPROTO_TCP, From: 8000, To: 9000}}}}}
	if _, err := hA.Sync(evil, nil); err != nil {
		t.Fatal(err)
	}
	if connects(outside) {
		t.Error("egress denying 203.0.113.2 tcp 8000-9000: the guest reached 203.0.113.2:9000")
	}
	evil.Egress = hostnet.Egress{Allow: []hostnet.EgressRule{{Prefix: netip.MustParsePrefix("192.168.78.3/32"),
		Ports: []hostnet.PortRange{{Protocol: unix.IPPROTO_TCP, From: 10250, To: 10250}}}}}
	if _, err := hA.Sync(evil, nil); err != nil {
		t.Fatal(err)
	}
	if connects(outside) {
		t.Error("egress without the internet: the guest reached a public address")
	}
	if !connects(kubelet) {
		t.Error("egress allowing 192.168.78.3 tcp 10250 alone: the guest cannot reach it")
	}
}

// guest plays a VM on a tap: it answers ARP for its address and hands every IPv4 frame to
// frames.
type guest struct {
	tap     *os.File
	ip, gw  netip.Addr
	frames  chan []byte
	sport   uint16
	stopped chan struct{}
}

func newGuest(t *testing.T, tap *os.File, ip, gw netip.Addr) *guest {
	g := &guest{tap: tap, ip: ip, gw: gw, frames: make(chan []byte, 256), sport: 41000, stopped: make(chan struct{})}
	go func() {
		defer close(g.stopped)
		buf := make([]byte, 65536)
		for {
			_ = tap.SetReadDeadline(time.Now().Add(time.Second))
			k, err := tap.Read(buf)
			if os.IsTimeout(err) {
				continue
			}
			if err != nil {
				return
			}
			f := append([]byte(nil), buf[10:k]...)
			if len(f) < 14 {
				continue
			}
			switch binary.BigEndian.Uint16(f[12:]) {
			case unix.ETH_P_ARP:
				if len(f) >= 42 && binary.BigEndian.Uint16(f[20:]) == 1 && netip.AddrFrom4([4]byte(f[38:42])) == ip {
					g.send(arpReplyFrame(hostnet.MAC(ip), net.HardwareAddr(f[22:28]), ip, netip.AddrFrom4([4]byte(f[28:32]))))
				}
			case unix.ETH_P_IP:
				select {
				case g.frames <- f:
				default:
				}
			}
		}
	}()
	t.Cleanup(func() { tap.Close(); <-g.stopped })
	return g
}

func (g *guest) send(frame []byte) {
	_, _ = g.tap.Write(append(make([]byte, 10), frame...)) // behind a zero virtio-net header
}

// connects sends a TCP SYN to dst and says whether a SYN-ACK came back within 3 s.
func (g *guest) connects(t *testing.T, dst netip.AddrPort) bool {
	t.Helper()
	g.sport++
	sport := g.sport
	for len(g.frames) > 0 {
		<-g.frames
	}
	g.send(ipv4Frame(hostnet.MAC(g.ip), hostnet.MAC(g.gw), g.ip, dst.Addr(), unix.IPPROTO_TCP, tcpSYN(g.ip, dst.Addr(), sport, dst.Port())))
	timeout := time.After(3 * time.Second)
	for {
		select {
		case f := <-g.frames:
			ihl := int(f[14]&0x0f) * 4
			if len(f) < 14+ihl+20 || f[14+9] != unix.IPPROTO_TCP || netip.AddrFrom4([4]byte(f[14+12:14+16])) != dst.Addr() {
				continue
			}
			tcp := f[14+ihl:]
			if binary.BigEndian.Uint16(tcp[0:]) == dst.Port() && binary.BigEndian.Uint16(tcp[2:]) == sport && tcp[13]&0x12 == 0x12 {
				return true
			}
		case <-timeout:
			return false
		}
	}
}

func arpReplyFrame(srcMAC, dstMAC net.HardwareAddr, senderIP, targetIP netip.Addr) []byte {
	var b bytes.Buffer
	b.Write(dstMAC)
	b.Write(srcMAC)
	_ = binary.Write(&b, binary.BigEndian, uint16(unix.ETH_P_ARP))
	_ = binary.Write(&b, binary.BigEndian, []uint16{1, unix.ETH_P_IP})
	b.Write([]byte{6, 4, 0, 2})
	s, tg := senderIP.As4(), targetIP.As4()
	b.Write(srcMAC)
	b.Write(s[:])
	b.Write(dstMAC)
	b.Write(tg[:])
	return b.Bytes()
}

// ipv4Frame is an Ethernet frame of an IPv4 packet of protocol proto carrying l4.
func ipv4Frame(srcMAC, dstMAC net.HardwareAddr, src, dst netip.Addr, proto byte, l4 []byte) []byte {
	var b bytes.Buffer
	b.Write(dstMAC)
	b.Write(srcMAC)
	_ = binary.Write(&b, binary.BigEndian, uint16(unix.ETH_P_IP))
	ip := []byte{0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, proto, 0, 0}
	binary.BigEndian.PutUint16(ip[2:], uint16(20+len(l4)))
	s, d := src.As4(), dst.As4()
	ip = append(append(ip, s[:]...), d[:]...)
	binary.BigEndian.PutUint16(ip[10:], checksum(ip))
	b.Write(ip)
	b.Write(l4)
	return b.Bytes()
}

// udp is a UDP datagram without a checksum (IPv4 allows that).
func udp(sport, dport uint16, payload []byte) []byte {
	h := make([]byte, 8)
	binary.BigEndian.PutUint16(h[0:], sport)
	binary.BigEndian.PutUint16(h[2:], dport)
	binary.BigEndian.PutUint16(h[4:], uint16(8+len(payload)))
	return append(h, payload...)
}

// tcpSYN is a TCP SYN segment with its checksum.
func tcpSYN(src, dst netip.Addr, sport, dport uint16) []byte {
	h := make([]byte, 20)
	binary.BigEndian.PutUint16(h[0:], sport)
	binary.BigEndian.PutUint16(h[2:], dport)
	binary.BigEndian.PutUint32(h[4:], 0x01020304)
	h[12] = 5 << 4
	h[13] = 0x02 // SYN
	binary.BigEndian.PutUint16(h[14:], 65535)
	s, d := src.As4(), dst.As4()
	pseudo := append(append(append([]byte{}, s[:]...), d[:]...), 0, unix.IPPROTO_TCP, 0, 20)
	binary.BigEndian.PutUint16(h[16:], checksum(append(pseudo, h...)))
	return h
}

func checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}
