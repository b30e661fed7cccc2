package wake

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
)

// Tap sends held frames to the VM through its tap, as the host side of the tap transmits: they
// go to the descriptor its VMM holds again, and nowhere else (not onto the bridge, whose other
// ports would get what it floods while it has not learned the VM's MAC again).
type Tap struct {
	// NetNS is the path of the network's namespace; Name the tap's.
	NetNS, Name string
}

// Replay sends frames (each behind its virtio-net header, as StandIn.Stop returns them), in
// order. The socket takes the headers (PACKET_VNET_HDR): a checksum the sender's kernel left to
// the device stays marked so, a segmentation is done, as if the frames had gone to the tap at
// once. A frame the socket refuses is skipped; the error of the first is returned.
func (t Tap) Replay(frames [][]byte) error {
	if len(frames) == 0 {
		return nil
	}
	return hostnet.InNamespace(t.NetNS, func() error {
		ifi, err := net.InterfaceByName(t.Name)
		if err != nil {
			return fmt.Errorf("looking up tap %s: %w", t.Name, err)
		}
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0) // sends only
		if err != nil {
			return fmt.Errorf("opening a packet socket on %s: %w", t.Name, err)
		}
		defer unix.Close(fd)
		if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_VNET_HDR, 1); err != nil {
			return fmt.Errorf("a packet socket on %s with virtio-net headers: %w", t.Name, err)
		}
		var first error
		for _, f := range frames {
			if len(f) < virtioNetHdrLen+ethHdrLen {
				continue
			}
			sa := &unix.SockaddrLinklayer{Ifindex: ifi.Index, Halen: 6, Protocol: htons(etherTypeIPv4)}
			copy(sa.Addr[:], f[virtioNetHdrLen:virtioNetHdrLen+6])
			if err := unix.Sendto(fd, f, 0, sa); err != nil && first == nil {
				first = fmt.Errorf("sending a held frame to %s: %w", t.Name, err)
			}
		}
		return first
	})
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// VnetHdrLen is the length of the virtio-net header of the frames read from and written to
// the tap open as f (TUNGETVNETHDRSZ): the last VMM to hold the tap may have set it. A VMM sets
// 10 or 12; anything else (a hostile VMM's: the kernel takes any size from 10 up) is set back
// to 12 on f, never trusted for a buffer's size.
func VnetHdrLen(f *os.File) (int, error) {
	raw, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	n, ierr := 0, error(nil)
	if err := raw.Control(func(fd uintptr) {
		if n, ierr = unix.IoctlGetInt(int(fd), unix.TUNGETVNETHDRSZ); ierr == nil && n != 10 && n != 12 {
			n, ierr = 12, unix.IoctlSetPointerInt(int(fd), unix.TUNSETVNETHDRSZ, 12)
		}
	}); err != nil {
		return 0, err
	}
	if ierr != nil {
		return 0, fmt.Errorf("the tap's virtio-net header size: %w", ierr)
	}
	return n, nil
}
