package wake

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"testing"
)

// tapBuf is a tap that records what the stand-in writes.
type tapBuf struct {
	mu      sync.Mutex
	written [][]byte
}

func (b *tapBuf) Read([]byte) (int, error) { select {} }
func (b *tapBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.written = append(b.written, append([]byte(nil), p...))
	return len(p), nil
}
func (b *tapBuf) Close() error { return nil }

var (
	ip    = netip.MustParseAddr("10.1.0.5")
	mac   = net.HardwareAddr{0x0a, 0x58, 10, 1, 0, 5}
	other = net.HardwareAddr{0x0a, 0x58, 10, 1, 0, 9}
)

func ipFrame(dstMAC net.HardwareAddr, dst netip.Addr, proto byte) []byte {
	f := make([]byte, 14+20+20)
	copy(f[0:6], dstMAC)
	copy(f[6:12], other)
	binary.BigEndian.PutUint16(f[12:14], etherTypeIPv4)
	h := f[14:]
	h[0] = 0x45
	binary.BigEndian.PutUint16(h[2:4], 40)
	h[9] = proto
	copy(h[12:16], []byte{10, 1, 0, 9})
	d := dst.As4()
	copy(h[16:20], d[:])
	h[20+13] = 0x02 // SYN
	return f
}

// TestOnlyTheVMsFramesAreHeld: what a tenant sends that is not for the VM — another address, a
// broadcast, a truncated or malformed frame, random bytes — wakes nothing and holds nothing, and
// no frame makes the stand-in fail; ARP is answered only for the VM's address.
func TestOnlyTheVMsFramesAreHeld(t *testing.T) {
	woken := 0
	tap := &tapBuf{}
	s := &StandIn{tap: tap, hdr: DefaultVnetHdrLen, ip: ip, mac: mac, lim: Limits{}.orDefault(), wake: func() {}, done: make(chan struct{})}
	s.wake = func() { woken++ }
	for _, f := range [][]byte{
		ipFrame(mac, netip.MustParseAddr("10.1.0.6"), 6),                      // the VM's MAC, another address
		ipFrame(net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, ip, 17), // broadcast
		ipFrame(other, ip, 6),    // another MAC
		ipFrame(mac, ip, 6)[:30], // truncated
	} {
		s.frame(make([]byte, virtioNetHdrLen), f)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		f := make([]byte, 14+r.IntN(80))
		for i := range f {
			f[i] = byte(r.Uint32())
		}
		if r.IntN(2) == 0 { // often an ARP or IPv4 frame, to reach the parsers
			binary.BigEndian.PutUint16(f[12:14], []uint16{etherTypeARP, etherTypeIPv4}[r.IntN(2)])
		}
		if r.IntN(4) == 0 && len(f) >= 34 {
			copy(f[0:6], mac)
			d := ip.As4()
			copy(f[30:34], d[:]) // for the VM: may be held, must not crash
		}
		_ = refusal(f)
		_ = arpReply(f, ip, mac)
		if !bytes.Equal(f[0:6], mac) {
			s.frame(make([]byte, virtioNetHdrLen), f)
		}
	}
	if held, _ := s.Held(); held != 0 || woken != 0 {
		t.Errorf("held %d frames and woke %d times for frames that were not the VM's", held, woken)
	}
	tap.mu.Lock()
	for _, w := range tap.written {
		f := w[DefaultVnetHdrLen:]
		if binary.BigEndian.Uint16(f[12:14]) != etherTypeARP || !bytes.Equal(f[14+14:14+18], []byte{10, 1, 0, 5}) {
			t.Fatalf("the stand-in wrote a frame that is not an ARP reply for the VM's address: %x", f)
		}
	}
	tap.mu.Unlock()
	s.frame(make([]byte, virtioNetHdrLen), ipFrame(mac, ip, 6))
	if held, _ := s.Held(); held != 1 {
		t.Errorf("the VM's own SYN: held %d", held)
	}
}

// TestRefusalIsWellFormed: the reset answering a SYN acknowledges it, from the VM's address and
// port, with valid checksums; a reset is never answered.
func TestRefusalIsWellFormed(t *testing.T) {
	syn := ipFrame(mac, ip, 6)
	tcp := syn[34:]
	binary.BigEndian.PutUint16(tcp[0:2], 40000)
	binary.BigEndian.PutUint16(tcp[2:4], 8080)
	binary.BigEndian.PutUint32(tcp[4:8], 1000)
	tcp[12] = 5 << 4
	r := refusal(syn)
	if r == nil || !bytes.Equal(r[0:6], other) || !bytes.Equal(r[6:12], mac) {
		t.Fatalf("refusal %x", r)
	}
	h, l4 := r[14:34], r[34:]
	if checksum(h, 0) != 0 || !bytes.Equal(h[12:16], []byte{10, 1, 0, 5}) {
		t.Errorf("IP header %x", h)
	}
	if binary.BigEndian.Uint16(l4[0:2]) != 8080 || binary.BigEndian.Uint16(l4[2:4]) != 40000 || binary.BigEndian.Uint32(l4[8:12]) != 1001 || l4[13] != 0x14 {
		t.Errorf("TCP %x", l4)
	}
	if transportChecksum([4]byte(h[12:16]), [4]byte(h[16:20]), 6, l4) != 0 {
		t.Error("TCP checksum")
	}
	if refusal(r) != nil {
		t.Error("a reset was answered")
	}
}
