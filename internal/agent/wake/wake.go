// Package wake stands in for a VM suspended because it was idle, on its network, until it is
// woken: it holds the VM's tap (which its VMM let go of), answers ARP for the VM's address with
// the VM's MAC as the guest would, and keeps what arrives for the VM — the frames the network
// delivered to the tap, after every rule of the network passed them — in a bounded queue. The
// first such frame asks for the VM to be woken; once its VMM holds the tap again the frames are
// sent to the tap anew (Tap.Replay), and reach the guest as if they had only been slow: a TCP
// connection's SYN, a UDP datagram, the next segment of a connection the guest already had. Nothing is proxied and nothing answered in the guest's place (a VM that cannot
// be woken has its held connections refused: TCP reset, ICMP port unreachable).
//
// See docs/suspend.md ("Idle VMs").
package wake

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"
)

// Limits bound what a stand-in holds for its VM; frames beyond them are dropped (a client
// retransmits), so a flood costs the node at most this much per suspended VM.
type Limits struct {
	// Frames is how many frames are held (default 1024).
	Frames int
	// Bytes is how many bytes of frames are held (default 4 MiB).
	Bytes int
	// Node, when set, bounds what every stand-in of the node holds together.
	Node *Budget
	// Counted, when set, is told of frames as they are dropped over the limits ("dropped")
	// or refused ("refused").
	Counted func(fate string, n int)
}

func (l Limits) count(fate string, n int) {
	if l.Counted != nil && n > 0 {
		l.Counted(fate, n)
	}
}

// Budget is what the stand-ins of a node may hold together, in bytes.
type Budget struct {
	mu   sync.Mutex
	left int64
}

// NewBudget is a budget of n bytes.
func NewBudget(n int64) *Budget { return &Budget{left: n} }

func (b *Budget) take(n int) bool {
	if b == nil {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.left < int64(n) {
		return false
	}
	b.left -= int64(n)
	return true
}

func (b *Budget) give(n int) {
	if b == nil {
		return
	}
	b.mu.Lock()
	b.left += int64(n)
	b.mu.Unlock()
}

func (l Limits) orDefault() Limits {
	if l.Frames <= 0 {
		l.Frames = 1024
	}
	if l.Bytes <= 0 {
		l.Bytes = 4 << 20
	}
	return l
}

// DefaultVnetHdrLen is the virtio-net header every frame on an IMP tap carries (IFF_VNET_HDR)
// unless a VMM set another size (QEMU and Firecracker set 12): VnetHdrLen reads it.
const DefaultVnetHdrLen = 10

const (
	etherTypeIPv4 = 0x0800
	etherTypeARP  = 0x0806
	ethHdrLen     = 14
)

// StandIn holds one suspended VM's tap.
type StandIn struct {
	tap  io.ReadWriteCloser
	hdr  int // the virtio-net header's length
	ip   netip.Addr
	mac  net.HardwareAddr
	lim  Limits
	wake func()

	mu       sync.Mutex
	held     [][]byte // Ethernet frames, as they arrived
	bytes    int
	dropped  int
	woken    bool
	refusing bool
	done     chan struct{}
}

// Stand begins standing in for the VM of address ip and MAC mac on tap (opened as the VM's
// VMM opens it, IFF_VNET_HDR, with virtio-net headers of hdr bytes: VnetHdrLen). wake is
// called once, on its own goroutine, when the first frame for the VM arrives.
func Stand(tap io.ReadWriteCloser, hdr int, ip netip.Addr, mac net.HardwareAddr, lim Limits, wake func()) *StandIn {
	s := &StandIn{tap: tap, hdr: hdr, ip: ip, mac: mac, lim: lim.orDefault(), wake: wake, done: make(chan struct{})}
	go s.read()
	return s
}

func (s *StandIn) read() {
	defer close(s.done)
	buf := make([]byte, s.hdr+ethHdrLen+65536) // the largest frame a tap gives, behind its header
	for {
		n, err := s.tap.Read(buf)
		if err != nil {
			if errors.Is(err, os.ErrClosed) || errors.Is(err, io.EOF) {
				return
			}
			// The device gone under the descriptor (EBADFD, EIO, ...): nothing more comes. A
			// pause keeps any other error from spinning.
			if errors.Is(err, syscall.EBADFD) || errors.Is(err, syscall.EIO) || errors.Is(err, syscall.ENODEV) || errors.Is(err, syscall.EFAULT) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if n <= s.hdr+ethHdrLen {
			continue
		}
		s.frame(buf[:virtioNetHdrLen], buf[s.hdr:n])
	}
}

// virtioNetHdrLen is struct virtio_net_hdr's length: the start of every tap header (a 12-byte
// one adds num_buffers), and what a packet socket with PACKET_VNET_HDR takes.
const virtioNetHdrLen = 10

// frame handles one frame the network delivered to the VM's tap, with its virtio-net header
// (hdr: the kernel's offloads — a checksum it left to finish, a segmentation it left to do).
func (s *StandIn) frame(hdr, f []byte) {
	switch binary.BigEndian.Uint16(f[12:14]) {
	case etherTypeARP:
		if reply := arpReply(f, s.ip, s.mac); reply != nil {
			_, _ = s.tap.Write(append(make([]byte, s.hdr, s.hdr+len(reply)), reply...))
		}
	case etherTypeIPv4:
		if !macEqual(f[0:6], s.mac) || len(f) < ethHdrLen+20 || netip.AddrFrom4([4]byte(f[ethHdrLen+16:ethHdrLen+20])) != s.ip {
			return // not the VM's: broadcast, multicast, another address
		}
		s.hold(hdr, f)
	}
}

func (s *StandIn) hold(hdr, f []byte) {
	s.mu.Lock()
	if s.refusing {
		s.mu.Unlock()
		s.lim.count("refused", 1)
		s.refuse(f)
		return
	}
	dropped := len(s.held) >= s.lim.Frames || s.bytes+len(f) > s.lim.Bytes || !s.lim.Node.take(len(f))
	if dropped {
		s.dropped++
	} else {
		s.held = append(s.held, append(append(make([]byte, 0, len(hdr)+len(f)), hdr...), f...))
		s.bytes += len(f)
	}
	first := !s.woken
	s.woken = true
	s.mu.Unlock()
	if dropped {
		s.lim.count("dropped", 1)
	}
	if first {
		go s.wake()
	}
}

// Held is how many frames are held, and how many were dropped over the limits.
func (s *StandIn) Held() (held, dropped int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.held), s.dropped
}

// Stop lets go of the tap, for the VM's VMM to open, and returns the frames held, oldest first,
// each behind its virtio-net header (10 bytes), for Tap.Replay.
func (s *StandIn) Stop() [][]byte {
	_ = s.tap.Close()
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	held := s.held
	s.lim.Node.give(s.bytes)
	s.held, s.bytes = nil, 0
	return held
}

// Refuse answers what is held, and whatever arrives from now on, as a host with nothing
// listening would: a TCP segment with a reset, a UDP datagram with ICMP port unreachable
// (other packets are dropped). For a VM that cannot be woken: its clients learn it at once
// instead of waiting out their timeouts.
func (s *StandIn) Refuse() {
	s.mu.Lock()
	held := s.held
	s.lim.Node.give(s.bytes)
	s.held, s.bytes, s.refusing = nil, 0, true
	s.mu.Unlock()
	s.lim.count("refused", len(held))
	for _, f := range held {
		s.refuse(f[virtioNetHdrLen:])
	}
}

// Rearm ends a refusal: what arrives from now on is held again, and asks for a wake again.
func (s *StandIn) Rearm() {
	s.mu.Lock()
	s.refusing, s.woken = false, false
	s.mu.Unlock()
}

func (s *StandIn) refuse(f []byte) {
	if reply := refusal(f); reply != nil {
		_, _ = s.tap.Write(append(make([]byte, s.hdr, s.hdr+len(reply)), reply...))
	}
}

func macEqual(a []byte, b net.HardwareAddr) bool {
	return len(b) == 6 && string(a) == string(b)
}
