package wake

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
)

// Bridge sends held frames onto a network's bridge, as the bridge itself sends: each is
// forwarded by its destination MAC, to the VM's tap, and the bridge learns nothing from it (the
// senders' MACs stay on their own ports).
type Bridge struct {
	// NetNS is the path of the network's namespace; Name the bridge's.
	NetNS, Name string
}

// Replay sends frames (each behind its virtio-net header, as StandIn.Stop returns them), in
// order. The socket takes the headers (PACKET_VNET_HDR): a checksum the sender's kernel left to
// the device is finished, a segmentation done, as if the frames had gone to the tap at once.
func (b Bridge) Replay(frames [][]byte) error {
	if len(frames) == 0 {
		return nil
	}
	return hostnet.InNamespace(b.NetNS, func() error {
		ifi, err := net.InterfaceByName(b.Name)
		if err != nil {
			return fmt.Errorf("looking up bridge %s: %w", b.Name, err)
		}
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0) // sends only
		if err != nil {
			return fmt.Errorf("opening a packet socket on %s: %w", b.Name, err)
		}
		defer unix.Close(fd)
		if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_VNET_HDR, 1); err != nil {
			return fmt.Errorf("a packet socket on %s with virtio-net headers: %w", b.Name, err)
		}
		for _, f := range frames {
			if len(f) < virtioNetHdrLen+ethHdrLen {
				continue
			}
			sa := &unix.SockaddrLinklayer{Ifindex: ifi.Index, Halen: 6, Protocol: htons(etherTypeIPv4)}
			copy(sa.Addr[:], f[virtioNetHdrLen:virtioNetHdrLen+6])
			if err := unix.Sendto(fd, f, 0, sa); err != nil {
				return fmt.Errorf("sending a held frame onto %s: %w", b.Name, err)
			}
		}
		return nil
	})
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// VnetHdrLen is the length of the virtio-net header of the frames read from and written to
// the tap open as f (TUNGETVNETHDRSZ): the last VMM to hold the tap may have set it.
func VnetHdrLen(f *os.File) (int, error) {
	raw, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	n, ierr := 0, error(nil)
	if err := raw.Control(func(fd uintptr) { n, ierr = unix.IoctlGetInt(int(fd), unix.TUNGETVNETHDRSZ) }); err != nil {
		return 0, err
	}
	if ierr != nil {
		return 0, fmt.Errorf("reading the tap's virtio-net header size: %w", ierr)
	}
	return n, nil
}
