package hostnet

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// space is one network's namespace on the node, pinned by a bind mount at path.
type space struct {
	id   string // the network's id: the suffix of its namespace's and links' names
	path string
	ns   netns.NsHandle
	nl   *netlink.Handle
	nft  *nftables.Conn
	// brnf: bridged frames pass the IP hooks here (bridgeToIP).
	brnf bool
}

func (s *space) close() {
	if s.nl != nil {
		s.nl.Close()
	}
	if s.nft != nil {
		_ = s.nft.CloseLasting()
	}
	s.ns.Close()
}

func (h *Host) spacePath(id string) string { return filepath.Join(h.opts.NSDir, nsPrefix+id) }

// pinned says whether path is a network namespace's bind mount; an empty file is what a
// reboot or an interrupted creation leaves.
func pinned(path string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, fmt.Errorf("inspecting %s: %w", path, err)
	}
	return st.Type == unix.NSFS_MAGIC, nil
}

// openSpace opens the namespace of the network with id, or returns nil when there is none.
func (h *Host) openSpace(id string) (*space, error) {
	if s := h.spaces[id]; s != nil {
		return s, nil
	}
	path := h.spacePath(id)
	ok, err := pinned(path)
	if err != nil || !ok {
		return nil, err
	}
	s := &space{id: id, path: path}
	if s.ns, err = netns.GetFromPath(path); err != nil {
		return nil, fmt.Errorf("opening network namespace %s: %w", path, err)
	}
	if s.nl, err = netlink.NewHandleAt(s.ns); err != nil {
		s.ns.Close()
		return nil, fmt.Errorf("opening netlink in %s: %w", path, err)
	}
	if s.nft, err = nftables.New(nftables.WithNetNSFd(int(s.ns))); err != nil {
		s.close()
		return nil, fmt.Errorf("opening nftables in %s: %w", path, err)
	}
	h.spaces[id] = s
	return s, nil
}

// ErrNotOnNode: the network has no namespace on the node (no VM of it is attached here).
var ErrNotOnNode = errors.New("the network is not on the node: attach a VM first")

// plumbed opens n's namespace, which must be there. Called with h.mu held.
func (h *Host) plumbed(n Network) (*space, error) {
	s, err := h.openSpace(n.id())
	if err == nil && s == nil {
		err = fmt.Errorf("network %s: %w", n.Key(), ErrNotOnNode)
	}
	return s, err
}

// openSpaces opens every network namespace pinned on the node, removing what is left of
// namespaces that are not (a file whose mount is gone).
func (h *Host) openSpaces() ([]*space, error) {
	ids, err := h.spaceIDs()
	if err != nil {
		return nil, err
	}
	var spaces []*space
	for _, id := range ids {
		s, err := h.openSpace(id)
		if err != nil {
			return nil, err
		}
		if s == nil {
			if err := os.Remove(h.spacePath(id)); err != nil && !os.IsNotExist(err) {
				return nil, fmt.Errorf("removing the stale %s: %w", h.spacePath(id), err)
			}
			continue
		}
		spaces = append(spaces, s)
	}
	return spaces, nil
}

// spaceIDs are the ids of the networks whose namespaces are pinned (or left) in NSDir.
func (h *Host) spaceIDs() ([]string, error) {
	entries, err := os.ReadDir(h.opts.NSDir)
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", h.opts.NSDir, err)
	}
	var ids []string
	for _, e := range entries {
		if id, ok := strings.CutPrefix(e.Name(), nsPrefix); ok {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// ensureSpace opens the namespace of the network with id, creating and pinning it when
// missing: loopback up, IPv6 off (ImpNetworks are IPv4), IPv4 forwarding on.
func (h *Host) ensureSpace(id string) (*space, error) {
	s, err := h.openSpace(id)
	if err != nil || s != nil {
		return s, err
	}
	path := h.spacePath(id)
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("removing the stale %s: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return nil, fmt.Errorf("creating %s: %w", path, err)
	}
	f.Close()
	err = runIn(h.ns, func() error {
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("creating a network namespace: %w", err)
		}
		self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		if err := unix.Mount(self, path, "none", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("pinning the network namespace at %s: %w", path, err)
		}
		for knob, v := range map[string]string{
			"/proc/sys/net/ipv6/conf/all/disable_ipv6":     "1",
			"/proc/sys/net/ipv6/conf/default/disable_ipv6": "1",
			"/proc/sys/net/ipv4/ip_forward":                "1",
		} {
			if err := os.WriteFile(knob, []byte(v), 0o644); err != nil && !(os.IsNotExist(err) && strings.Contains(knob, "ipv6")) {
				return fmt.Errorf("setting %s: %w", knob, err)
			}
		}
		return nil
	})
	if err != nil {
		_ = unix.Unmount(path, unix.MNT_DETACH)
		_ = os.Remove(path)
		return nil, err
	}
	if s, err = h.openSpace(id); err != nil {
		return nil, err
	}
	lo, err := s.nl.LinkByName("lo")
	if err == nil {
		err = s.nl.LinkSetUp(lo)
	}
	if err != nil {
		return nil, fmt.Errorf("bringing up lo in %s: %w", path, err)
	}
	return s, nil
}

// removeSpace removes a network's namespace, with it everything in it, its transit link and
// the overlay's admission of its peers; with the last network, the node's rules go too.
func (h *Host) removeSpace(s *space) error {
	if l, err := s.nl.LinkByName(vxlanPrefix + s.id); err == nil {
		if vx, ok := l.(*netlink.Vxlan); ok {
			if err := h.syncPeers(uint32(vx.VxlanId), nil); err != nil {
				return err
			}
		}
	}
	if err := h.removeTransit(s.id); err != nil {
		return err
	}
	s.close()
	delete(h.spaces, s.id)
	if err := unix.Unmount(s.path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("unpinning %s: %w", s.path, err)
	}
	if err := os.Remove(s.path); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("removing %s: %w", s.path, err)
	}
	return h.cleanNode()
}

// ensureBridge makes the namespace's bridge for n: the gateway's MAC and address, the network's alias, up.
func (s *space) ensureBridge(n Network, mtu int) (netlink.Link, error) {
	name := bridgePrefix + s.id
	br, err := s.nl.LinkByName(name)
	if isNotFound(err) {
		br = &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name, MTU: mtu, HardwareAddr: MAC(n.Gateway)}}
		if err := s.nl.LinkAdd(br); err != nil {
			return nil, fmt.Errorf("creating bridge %s: %w", name, err)
		}
		br, err = s.nl.LinkByName(name)
	}
	if err != nil {
		return nil, fmt.Errorf("looking up bridge %s: %w", name, err)
	}
	a := br.Attrs()
	if a.Alias != netAlias+n.Key() {
		if err := s.nl.LinkSetAlias(br, netAlias+n.Key()); err != nil {
			return nil, fmt.Errorf("naming bridge %s: %w", name, err)
		}
	}
	if a.HardwareAddr.String() != MAC(n.Gateway).String() {
		if err := s.nl.LinkSetHardwareAddr(br, MAC(n.Gateway)); err != nil {
			return nil, fmt.Errorf("setting the address of bridge %s: %w", name, err)
		}
	}
	want := &netlink.Addr{IPNet: &net.IPNet{IP: n.Gateway.AsSlice(), Mask: net.CIDRMask(n.Prefix.Bits(), 32)}}
	addrs, err := s.nl.AddrList(br, unix.AF_INET)
	if err != nil {
		return nil, fmt.Errorf("listing addresses of %s: %w", name, err)
	}
	found := false
	for _, ad := range addrs {
		if ad.IPNet.String() == want.IPNet.String() {
			found = true
			continue
		}
		if err := s.nl.AddrDel(br, &ad); err != nil { // a gateway of an earlier spec
			return nil, fmt.Errorf("removing %s from %s: %w", ad.IPNet, name, err)
		}
	}
	if !found {
		if err := s.nl.AddrAdd(br, want); err != nil {
			return nil, fmt.Errorf("adding %s to %s: %w", want.IPNet, name, err)
		}
	}
	if a.Flags&net.FlagUp == 0 {
		if err := s.nl.LinkSetUp(br); err != nil {
			return nil, fmt.Errorf("bringing up %s: %w", name, err)
		}
	}
	return br, nil
}

// openTap opens (creating when missing) the persistent tap name in the network's namespace.
// A tap belongs to the namespace /dev/net/tun was opened in, so the open happens on a thread
// that has entered it.
func (s *space) openTap(name string) (*os.File, error) {
	var f *os.File
	err := runIn(s.ns, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("opening /dev/net/tun: %w", err)
		}
		ifr, err := unix.NewIfreq(name)
		if err != nil {
			unix.Close(fd)
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("attaching to tap %s: %w", name, err)
		}
		if err := unix.IoctlSetInt(fd, unix.TUNSETPERSIST, 1); err != nil {
			unix.Close(fd)
			return fmt.Errorf("making tap %s persistent: %w", name, err)
		}
		// Non-blocking, so reads can have deadlines; QEMU sets the same flag itself.
		if err := unix.SetNonblock(fd, true); err != nil {
			unix.Close(fd)
			return err
		}
		f = os.NewFile(uintptr(fd), "/dev/net/tun:"+name)
		return nil
	})
	return f, err
}

func (s *space) configureTap(name, vmUID string, br netlink.Link, mtu int) error {
	tap, err := s.nl.LinkByName(name)
	if err != nil {
		return fmt.Errorf("looking up tap %s: %w", name, err)
	}
	a := tap.Attrs()
	if a.Alias != vmAlias+vmUID {
		if err := s.nl.LinkSetAlias(tap, vmAlias+vmUID); err != nil {
			return fmt.Errorf("naming tap %s: %w", name, err)
		}
	}
	if a.MTU != mtu {
		if err := s.nl.LinkSetMTU(tap, mtu); err != nil {
			return fmt.Errorf("setting the MTU of %s: %w", name, err)
		}
	}
	if a.MasterIndex != br.Attrs().Index {
		if err := s.nl.LinkSetMasterByIndex(tap, br.Attrs().Index); err != nil {
			return fmt.Errorf("putting tap %s on bridge %s: %w", name, br.Attrs().Name, err)
		}
	}
	if a.Flags&net.FlagUp == 0 {
		if err := s.nl.LinkSetUp(tap); err != nil {
			return fmt.Errorf("bringing up %s: %w", name, err)
		}
	}
	return nil
}

// taps lists the VM taps in the namespace.
func (s *space) taps() ([]string, error) {
	links, err := s.nl.LinkList()
	if err != nil {
		return nil, fmt.Errorf("listing links of %s: %w", s.path, err)
	}
	var taps []string
	for _, l := range links {
		if a := l.Attrs(); strings.HasPrefix(a.Name, tapPrefix) {
			taps = append(taps, a.Name)
		}
	}
	return taps, nil
}

// removeLink removes the link name from the namespace, if there.
func (s *space) removeLink(name string) error {
	l, err := s.nl.LinkByName(name)
	if isNotFound(err) {
		return nil
	} else if err != nil {
		return fmt.Errorf("looking up %s: %w", name, err)
	}
	if err := s.nl.LinkDel(l); err != nil {
		return fmt.Errorf("removing %s: %w", name, err)
	}
	return nil
}
