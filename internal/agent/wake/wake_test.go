package wake_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/wake"
	"github.com/syscode-labs/imp/internal/testnetns"
)

var (
	vmIP  = netip.MustParseAddr("192.168.77.10")
	vmMAC = net.HardwareAddr{0x0a, 0x58, 192, 168, 77, 10}
)

// network is a namespace with a bridge, a suspended VM's persistent tap on it, and a client
// namespace joined to the bridge by a veth.
type network struct {
	ns, client string
}

func newNetwork(t *testing.T) network {
	t.Helper()
	id := fmt.Sprintf("%d", time.Now().UnixNano()%100000)
	n := network{ns: testnetns.New(t, "impwake-n"+id), client: testnetns.New(t, "impwake-c"+id)}
	h := testnetns.Handle(t, n.ns)
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}
	if err := h.LinkAdd(br); err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("192.168.77.1/24")
	if err := h.AddrAdd(br, addr); err != nil {
		t.Fatal(err)
	}
	// A tap belongs to the namespace /dev/net/tun is opened in: made on a thread in it.
	if err := testnetns.Do(n.ns, func() error {
		tap := &netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{Name: "tapvm"}, Mode: netlink.TUNTAP_MODE_TAP,
			Flags: netlink.TUNTAP_NO_PI | netlink.TUNTAP_VNET_HDR, Queues: 1}
		if err := netlink.LinkAdd(tap); err != nil {
			return err
		}
		for _, f := range tap.Fds {
			f.Close()
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	testnetns.Link(t, n.client, "c0", "192.168.77.20/24", n.ns, "cpeer", "")
	for _, name := range []string{"tapvm", "cpeer"} {
		l, err := h.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		if err := h.LinkSetMaster(l, br); err != nil {
			t.Fatal(err)
		}
		if err := h.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.LinkSetUp(br); err != nil {
		t.Fatal(err)
	}
	return n
}

// openTap opens the tap as a VMM does (IFF_VNET_HDR, non-blocking).
func (n network) openTap(t *testing.T) *os.File {
	t.Helper()
	var f *os.File
	if err := testnetns.Do(n.ns, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		ifr, _ := unix.NewIfreq("tapvm")
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return err
		}
		// 12-byte headers and checksum and segmentation offloads, as QEMU and Firecracker
		// set them on the taps they hold: then the kernel leaves the checksums of what it
		// sends to the tap to the device (the guest), and the header says so.
		if err := unix.IoctlSetPointerInt(fd, unix.TUNSETVNETHDRSZ, 12); err != nil {
			return err
		}
		if err := unix.IoctlSetInt(fd, unix.TUNSETOFFLOAD, unix.TUN_F_CSUM|unix.TUN_F_TSO4|unix.TUN_F_TSO6|unix.TUN_F_TSO_ECN); err != nil {
			return err
		}
		if err := unix.SetNonblock(fd, true); err != nil {
			return err
		}
		f = os.NewFile(uintptr(fd), "tapvm")
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return f
}

// stand stands in on the tap, with its header size as the tap says it.
func (n network) stand(t *testing.T, ip netip.Addr, mac net.HardwareAddr, lim wake.Limits, woken func()) *wake.StandIn {
	t.Helper()
	tap := n.openTap(t)
	hdr, err := wake.VnetHdrLen(tap)
	if err != nil || hdr != 12 {
		t.Fatalf("the tap's virtio-net header: %d, %v; want 12", hdr, err)
	}
	return wake.Stand(tap, hdr, ip, mac, lim, woken)
}

// dial connects from the client to addr over network ("tcp" or "udp"), on its own goroutine.
func (n network) dial(network, addr string, timeout time.Duration) <-chan error {
	return n.dialFrom(n.client, network, addr, timeout)
}

// dialFrom is dial from the namespace at from: the client's, or the bridge's own (the
// network's gateway, whose kernel leaves its checksums to the device).
func (n network) dialFrom(from, network, addr string, timeout time.Duration) <-chan error {
	errc := make(chan error, 1)
	go func() {
		errc <- testnetns.Do(from, func() error {
			c, err := net.DialTimeout(network, addr, timeout)
			if err != nil {
				return err
			}
			defer c.Close()
			if network == "udp" {
				_, err = c.Write([]byte("hello"))
			}
			return err
		})
	}()
	return errc
}

// TestHeldUntilWoken: the stand-in answers the client's ARP for the VM with the VM's MAC, holds
// the client's TCP SYN and UDP datagram, asks for a wake once, and once stopped the frames it
// held, sent to the tap again, reach the VMM's descriptor as they were sent.
func TestHeldUntilWoken(t *testing.T) {
	n := newNetwork(t)
	var wakes atomic.Int32
	woken := make(chan struct{}, 8)
	s := n.stand(t, vmIP, vmMAC, wake.Limits{}, func() { wakes.Add(1); woken <- struct{}{} })
	tcp := n.dial("tcp", "192.168.77.10:8080", 30*time.Second)
	select {
	case <-woken:
	case err := <-tcp:
		t.Fatalf("the connection ended before any wake: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("no wake: the client's SYN was not held (its ARP unanswered?)")
	}
	if err := <-n.dialFrom(n.ns, "udp", "192.168.77.10:9000", time.Second); err != nil {
		t.Fatal(err)
	}
	waitHeld(t, s, 2)
	neighs, err := testnetns.Handle(t, n.client).NeighList(0, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	arp := ""
	for _, nb := range neighs {
		if nb.IP.Equal(vmIP.AsSlice()) {
			arp = nb.HardwareAddr.String()
		}
	}
	if arp != vmMAC.String() {
		t.Errorf("the client resolved %s to %q; want the VM's MAC %s", vmIP, arp, vmMAC)
	}

	frames := s.Stop()
	vmm := n.openTap(t) // the VMM holds the tap again
	defer vmm.Close()
	if err := (wake.Tap{NetNS: n.ns, Name: "tapvm"}).Replay(frames); err != nil {
		t.Fatal(err)
	}
	var syn, udp bool
	buf := make([]byte, 70000)
	_ = vmm.SetReadDeadline(time.Now().Add(10 * time.Second))
	for !(syn && udp) {
		k, err := vmm.Read(buf)
		if err != nil {
			t.Fatalf("the VMM read %v (SYN %v, UDP %v)", err, syn, udp)
		}
		f := buf[12:k]
		if len(f) < 14+20 || binary.BigEndian.Uint16(f[12:14]) != 0x0800 || string(f[0:6]) != string(vmMAC) {
			continue
		}
		ip := f[14:]
		l4 := ip[int(ip[0]&0x0f)*4 : binary.BigEndian.Uint16(ip[2:4])]
		// A checksum the sender's kernel left to the device is still to be finished by the
		// guest's (the header says so); any other must be whole, or the guest drops the frame.
		if buf[0]&1 == 0 && transportSum(ip, l4) != 0 {
			t.Fatalf("a replayed frame reached the VMM with a bad checksum (header %x): %x", buf[:12], f)
		}
		switch {
		case ip[9] == 6 && binary.BigEndian.Uint16(l4[2:4]) == 8080 && l4[13]&0x02 != 0:
			syn = true
		case ip[9] == 17 && binary.BigEndian.Uint16(l4[2:4]) == 9000 && strings.HasSuffix(string(l4[8:]), "hello"):
			udp = true
		}
	}
	// The wake is asked from the stand-in's own goroutine: waited for, not assumed done when
	// the last frame is counted.
	for deadline := time.Now().Add(10 * time.Second); wakes.Load() == 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if w := wakes.Load(); w != 1 {
		t.Errorf("%d wakes; want one", w)
	}
}

// TestRefusedWhenItCannotWake: a stand-in told its VM cannot be woken refuses what it held and
// what comes after: the client's connection is refused (a reset), not left to time out.
func TestRefusedWhenItCannotWake(t *testing.T) {
	n := newNetwork(t)
	woken := make(chan struct{}, 8)
	s := n.stand(t, vmIP, vmMAC, wake.Limits{}, func() { woken <- struct{}{} })
	defer s.Stop()
	tcp := n.dial("tcp", "192.168.77.10:8080", 30*time.Second)
	select {
	case <-woken:
	case <-time.After(20 * time.Second):
		t.Fatal("no wake")
	}
	began := time.Now()
	s.Refuse()
	select {
	case err := <-tcp:
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("the held connection ended with %v; want connection refused", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the held connection was not refused")
	}
	// And a new one at once.
	if err := <-n.dial("tcp", "192.168.77.10:8081", 10*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("a new connection: %v; want connection refused", err)
	}
	t.Logf("refused %v after Refuse", time.Since(began).Round(time.Millisecond))
}

// TestAFloodIsBounded: what is held stays within the limits however much arrives, and the
// flood asks for one wake.
func TestAFloodIsBounded(t *testing.T) {
	n := newNetwork(t)
	var wakes atomic.Int32
	s := n.stand(t, vmIP, vmMAC, wake.Limits{Frames: 10}, func() { wakes.Add(1) })
	defer s.Stop()
	if err := testnetns.Do(n.client, func() error {
		c, err := net.Dial("udp", "192.168.77.10:9000")
		if err != nil {
			return err
		}
		defer c.Close()
		for range 200 {
			if _, err := c.Write([]byte("flood")); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		held, dropped := s.Held()
		if held+dropped >= 200 || time.Now().After(deadline) {
			if held != 10 || dropped < 180 {
				t.Errorf("held %d, dropped %d of 200; want 10 held", held, dropped)
			}
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The wake is asked from the stand-in's own goroutine: waited for, not assumed done when
	// the last frame is counted.
	for deadline := time.Now().Add(10 * time.Second); wakes.Load() == 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if w := wakes.Load(); w != 1 {
		t.Errorf("%d wakes; want one", w)
	}
}

// transportSum is the Internet checksum of the TCP or UDP segment l4 of IPv4 header ip, with its
// pseudo-header: 0 when the segment's checksum is right.
func transportSum(ip, l4 []byte) uint16 {
	sum := uint32(ip[9]) + uint32(len(l4))
	for _, b := range [][]byte{ip[12:20], l4} {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
		if len(b)%2 == 1 {
			sum += uint32(b[len(b)-1]) << 8
		}
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

func waitHeld(t *testing.T, s *wake.StandIn, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if held, _ := s.Held(); held >= n {
			return
		}
		if time.Now().After(deadline) {
			held, dropped := s.Held()
			t.Fatalf("held %d (dropped %d); want %d", held, dropped, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestAHostileHeaderSizeIsNotTrusted: a VMM that left its tap a header size of a GiB (the
// kernel takes any from 10 up) does not size the stand-in's buffers: it reads 12, set back.
func TestAHostileHeaderSizeIsNotTrusted(t *testing.T) {
	n := newNetwork(t)
	tap := n.openTap(t)
	defer tap.Close()
	raw, _ := tap.SyscallConn()
	var ierr error
	_ = raw.Control(func(fd uintptr) { ierr = unix.IoctlSetPointerInt(int(fd), unix.TUNSETVNETHDRSZ, 1<<30) })
	if ierr != nil {
		t.Fatal(ierr)
	}
	if hdr, err := wake.VnetHdrLen(tap); err != nil || hdr != 12 {
		t.Errorf("header size %d, %v; want 12", hdr, err)
	}
}
