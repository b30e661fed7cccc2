package fctest

import (
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// GuestFramesFile is the file, at the jail's root, where the fake's guest notes each frame its
// network interface received while the VM ran: the Ethernet frame in hex, one per line.
const GuestFramesFile = "guest-frames"

// openTap opens interface id's tap name as Firecracker does (Tap::open_named: /dev/net/tun,
// TUNSETIFF with IFF_TAP|IFF_NO_PI|IFF_VNET_HDR, then a 12-byte virtio-net header), holding it
// in place of the interface's earlier one; like Firecracker it fails on a tap another
// descriptor holds (EBUSY: IMP's taps are not multi-queue). Its frames are read while the VM
// runs and noted in GuestFramesFile. Only with a Root (a jailed fake).
func (s *Server) openTap(id, name string) error {
	if s.Root == "" || name == "" {
		return nil
	}
	fd, err := unix.Open(filepath.Join(s.Root, "dev/net/tun"), unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("Open tap device failed: Couldn't open /dev/net/tun: %v", err)
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return errors.New("Open tap device failed: Invalid interface name")
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return fmt.Errorf("Open tap device failed: Error while creating ifreq structure: %v. Invalid TUN/TAP Backend provided by %s. Check our documentation on setting up the network devices.", err, name)
	}
	if err := unix.IoctlSetPointerInt(fd, unix.TUNSETVNETHDRSZ, 12); err != nil {
		unix.Close(fd)
		return fmt.Errorf("Setting vnet header size failed: Error while setting size of the vnet header: %v", err)
	}
	f := os.NewFile(uintptr(fd), "tap:"+name)
	if s.taps == nil {
		s.taps = map[string]*os.File{}
	}
	if old := s.taps[id]; old != nil {
		old.Close()
	}
	s.taps[id] = f
	go s.receive(f)
	return nil
}

// receive notes the frames the tap f delivers while the VM runs; while it is paused (or not
// started) they wait in the tap's queue, as a paused Firecracker's do.
func (s *Server) receive(f *os.File) {
	buf := make([]byte, 12+65536)
	for {
		s.Lock()
		running := s.Started && !s.Paused
		s.Unlock()
		if !running {
			time.Sleep(5 * time.Millisecond)
			if _, err := f.Stat(); err != nil {
				return // closed
			}
			continue
		}
		_ = f.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		n, err := f.Read(buf)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		} else if err != nil {
			return
		}
		if n <= 12 {
			continue
		}
		out, err := os.OpenFile(filepath.Join(s.Root, GuestFramesFile), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		if err != nil {
			continue
		}
		_, _ = out.WriteString(hex.EncodeToString(buf[12:n]) + "\n")
		out.Close()
	}
}
