// Package hostnet is the node side of ImpNetworks: per network a bridge holding the gateway
// address and, when the node takes part in the overlay, a VXLAN device on that bridge whose
// forwarding entries point at the other nodes' VMs; per VM a tap on the bridge; and nftables
// rules in tables IMP owns (inet imp, bridge imp) for isolation, anti-spoofing and NAT egress.
//
// Every operation measures the host first and changes only what differs, so running it again
// on a healthy host does nothing. Links carry an alias naming what they belong to, which is
// how a restarted agent finds them again.
package hostnet

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Names and aliases of IMP's links. Interface names are at most 15 bytes.
const (
	bridgePrefix = "impb"
	vxlanPrefix  = "impx"
	tapPrefix    = "impt"
	netAlias     = "imp-net:" // + namespace/name
	vmAlias      = "imp-vm:"  // + VM UID
	// DefaultVXLANPort is the overlay's UDP port: not 4789 (IANA; Calico, Antrea, NSX) nor
	// 8472 (Linux's default; flannel, Cilium), so IMP's overlay coexists with the cluster's CNI.
	DefaultVXLANPort = 4792
	// DefaultMTU leaves room for VXLAN's 50 bytes on a 1500-byte underlay.
	DefaultMTU = 1450
)

// Network is one ImpNetwork as a node plumbs it.
type Network struct {
	Namespace, Name string
	// UID names the network's links, so a network deleted and created again gets new ones.
	UID string
	// VNI is the overlay's VXLAN network identifier; 0 until the operator assigns one.
	VNI     uint32
	Prefix  netip.Prefix
	Gateway netip.Addr
	NAT     bool
}

// Key is "namespace/name".
func (n Network) Key() string { return n.Namespace + "/" + n.Name }

func shortID(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:5])
}

// BridgeName is the name of the network's bridge on every node.
func (n Network) BridgeName() string { return bridgePrefix + shortID(n.UID) }

// VXLANName is the name of the network's VXLAN device on every node.
func (n Network) VXLANName() string { return vxlanPrefix + shortID(n.UID) }

// TapName is the name of a VM's tap.
func TapName(vmUID string) string { return tapPrefix + shortID(vmUID) }

// MAC is the hardware address of ip on its network: 0a:58 and the address's four bytes. An
// address is unique in its network, so is the MAC, and every node computes it alike. The
// gateway's MAC, which every node's bridge holds, follows the same rule.
func MAC(ip netip.Addr) net.HardwareAddr {
	a := ip.As4()
	return net.HardwareAddr{0x0a, 0x58, a[0], a[1], a[2], a[3]}
}

// Peer is a VM of a network on another node.
type Peer struct {
	IP netip.Addr
	// VTEP is the underlay address of the peer's node.
	VTEP netip.Addr
}

// Options configure a Host.
type Options struct {
	// NetNS is the path of the network namespace holding the node's VM networking (tests
	// simulate nodes this way); empty is the agent's own.
	NetNS string
	// VTEP is this node's underlay address for the overlay; invalid means no overlay.
	VTEP netip.Addr
	// VXLANPort is the overlay's UDP port (DefaultVXLANPort when 0).
	VXLANPort int
	// MTU of taps, VXLAN devices and guests (DefaultMTU when 0).
	MTU int
	// StateDir holds what the host remembers across restarts (whether it enabled forwarding).
	StateDir string
	// BootID identifies the running boot of the node (default: the kernel's
	// /proc/sys/kernel/random/boot_id). What StateDir remembers of the node's kernel settings
	// holds only within the boot that wrote it.
	BootID string
}

// Host plumbs ImpNetworks into one network namespace. Its methods are safe for concurrent use.
type Host struct {
	opts Options
	ns   netns.NsHandle
	nl   *netlink.Handle
	nft  *nftables.Conn
	mu   sync.Mutex
}

// Open returns a Host for opts.NetNS.
func Open(opts Options) (*Host, error) {
	if opts.VXLANPort == 0 {
		opts.VXLANPort = DefaultVXLANPort
	}
	if opts.MTU == 0 {
		opts.MTU = DefaultMTU
	}
	if opts.BootID == "" {
		id, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
		if err != nil {
			return nil, fmt.Errorf("reading the boot id: %w", err)
		}
		opts.BootID = strings.TrimSpace(string(id))
	}
	h := &Host{opts: opts}
	var err error
	if opts.NetNS == "" {
		h.ns, err = netns.Get()
	} else {
		h.ns, err = netns.GetFromPath(opts.NetNS)
	}
	if err != nil {
		return nil, fmt.Errorf("opening network namespace %q: %w", opts.NetNS, err)
	}
	if h.nl, err = netlink.NewHandleAt(h.ns); err != nil {
		h.ns.Close()
		return nil, fmt.Errorf("opening netlink: %w", err)
	}
	if h.nft, err = nftables.New(nftables.WithNetNSFd(int(h.ns))); err != nil {
		h.Close()
		return nil, fmt.Errorf("opening nftables: %w", err)
	}
	return h, nil
}

// MTU is the MTU guests get.
func (h *Host) MTU() int { return h.opts.MTU }

// Close releases the Host's handles; the host's links and rules stay.
func (h *Host) Close() {
	if h.nl != nil {
		h.nl.Close()
	}
	if h.nft != nil {
		_ = h.nft.CloseLasting()
	}
	h.ns.Close()
}

// Attach gives a VM with address ip a tap on n's bridge, creating the bridge and the
// network's rules when missing, and returns the tap opened for the VMM (the caller closes
// it once the VMM holds it).
func (h *Host) Attach(n Network, vmUID string, ip netip.Addr) (*os.File, error) {
	if !n.Prefix.Contains(ip) || ip == n.Gateway {
		return nil, fmt.Errorf("address %s is not a host address of %s", ip, n.Prefix)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	br, err := h.ensureBridge(n)
	if err != nil {
		return nil, err
	}
	tapName := TapName(vmUID)
	f, err := h.openTap(tapName)
	if err != nil {
		return nil, err
	}
	if err := h.configureTap(tapName, vmUID, br); err != nil {
		f.Close()
		return nil, err
	}
	if err := h.ensureRules(n, h.opts.VTEP.IsValid() && n.VNI != 0); err != nil {
		f.Close()
		return nil, err
	}
	if err := h.replaceRules(tapName, tapRules(tapName, ip)); err != nil {
		f.Close()
		return nil, fmt.Errorf("anti-spoofing rules of %s: %w", tapName, err)
	}
	return f, nil
}

// Detach removes a VM's tap and its rules. The network's bridge stays until Sync finds it
// unused.
func (h *Host) Detach(vmUID string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.removeTap(TapName(vmUID))
}

func (h *Host) removeTap(name string) error {
	if l, err := h.nl.LinkByName(name); err == nil {
		if err := h.nl.LinkDel(l); err != nil {
			return fmt.Errorf("removing tap %s: %w", name, err)
		}
	} else if !isNotFound(err) {
		return fmt.Errorf("looking up tap %s: %w", name, err)
	}
	return h.replaceRules(name, nil)
}

// Sync makes n's node side match: with VMs attached, the bridge's rules, NAT, and the overlay
// device with a forwarding entry per peer (and one per peer node for broadcasts such as ARP);
// with none, nothing of n at all. It reports whether n is present on the node afterwards.
func (h *Host) Sync(n Network, peers []Peer) (present bool, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	br, err := h.nl.LinkByName(n.BridgeName())
	if isNotFound(err) {
		return false, h.removeNetwork(n.BridgeName(), n.VXLANName())
	} else if err != nil {
		return false, fmt.Errorf("looking up bridge %s: %w", n.BridgeName(), err)
	}
	taps, err := h.taps(br.Attrs().Index)
	if err != nil {
		return true, err
	}
	if len(taps) == 0 {
		return false, h.removeNetwork(n.BridgeName(), n.VXLANName())
	}
	if _, err := h.ensureBridge(n); err != nil {
		return true, err
	}
	overlay := h.opts.VTEP.IsValid() && n.VNI != 0
	if overlay {
		if err := h.ensureVXLAN(n, br.Attrs().Index, peers); err != nil {
			return true, err
		}
	}
	return true, h.ensureRules(n, overlay)
}

// Present lists the networks with a bridge on the node, as "namespace/name".
func (h *Host) Present() ([]string, error) {
	links, err := h.nl.LinkList()
	if err != nil {
		return nil, fmt.Errorf("listing links: %w", err)
	}
	var keys []string
	for _, l := range links {
		if key, ok := strings.CutPrefix(l.Attrs().Alias, netAlias); ok && strings.HasPrefix(l.Attrs().Name, bridgePrefix) {
			keys = append(keys, key)
		}
	}
	return keys, nil
}

// Prune removes the taps of VMs for which keep is false, then every network left without a
// tap, and every IMP rule whose link is gone. An agent calls it at start and periodically, to
// remove what it created for VMs that went while it was not looking.
func (h *Host) Prune(keep func(vmUID string) bool) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	links, err := h.nl.LinkList()
	if err != nil {
		return fmt.Errorf("listing links: %w", err)
	}
	var errs []error
	live := map[string]bool{}
	for _, l := range links {
		a := l.Attrs()
		if uid, ok := strings.CutPrefix(a.Alias, vmAlias); ok && strings.HasPrefix(a.Name, tapPrefix) && !keep(uid) {
			if err := h.nl.LinkDel(l); err != nil {
				errs = append(errs, fmt.Errorf("removing tap %s: %w", a.Name, err))
			}
			continue // its rules go with pruneRules, in one batch
		}
		live[a.Name] = true
	}
	for _, l := range links {
		a := l.Attrs()
		if !strings.HasPrefix(a.Name, bridgePrefix) || !strings.HasPrefix(a.Alias, netAlias) {
			continue
		}
		taps, err := h.taps(a.Index)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if len(taps) == 0 {
			vx := vxlanPrefix + strings.TrimPrefix(a.Name, bridgePrefix)
			for _, name := range []string{vx, a.Name} {
				if l, err := h.nl.LinkByName(name); err == nil {
					if err := h.nl.LinkDel(l); err != nil {
						errs = append(errs, fmt.Errorf("removing %s: %w", name, err))
					}
				}
			}
			delete(live, a.Name)
		}
	}
	errs = append(errs, h.pruneRules(live), h.syncForwarding())
	return errors.Join(errs...)
}

func (h *Host) ensureBridge(n Network) (netlink.Link, error) {
	name := n.BridgeName()
	br, err := h.nl.LinkByName(name)
	if isNotFound(err) {
		br = &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name, MTU: h.opts.MTU, HardwareAddr: MAC(n.Gateway)}}
		if err := h.nl.LinkAdd(br); err != nil {
			return nil, fmt.Errorf("creating bridge %s: %w", name, err)
		}
		br, err = h.nl.LinkByName(name)
	}
	if err != nil {
		return nil, fmt.Errorf("looking up bridge %s: %w", name, err)
	}
	a := br.Attrs()
	if a.Alias != netAlias+n.Key() {
		if err := h.nl.LinkSetAlias(br, netAlias+n.Key()); err != nil {
			return nil, fmt.Errorf("naming bridge %s: %w", name, err)
		}
	}
	if a.HardwareAddr.String() != MAC(n.Gateway).String() {
		if err := h.nl.LinkSetHardwareAddr(br, MAC(n.Gateway)); err != nil {
			return nil, fmt.Errorf("setting the address of bridge %s: %w", name, err)
		}
	}
	want := &netlink.Addr{IPNet: &net.IPNet{IP: n.Gateway.AsSlice(), Mask: net.CIDRMask(n.Prefix.Bits(), 32)}}
	addrs, err := h.nl.AddrList(br, unix.AF_INET)
	if err != nil {
		return nil, fmt.Errorf("listing addresses of %s: %w", name, err)
	}
	found := false
	for _, ad := range addrs {
		if ad.IPNet.String() == want.IPNet.String() {
			found = true
			continue
		}
		if err := h.nl.AddrDel(br, &ad); err != nil { // a gateway of an earlier spec
			return nil, fmt.Errorf("removing %s from %s: %w", ad.IPNet, name, err)
		}
	}
	if !found {
		if err := h.nl.AddrAdd(br, want); err != nil {
			return nil, fmt.Errorf("adding %s to %s: %w", want.IPNet, name, err)
		}
	}
	if a.OperState != netlink.OperUp && a.Flags&net.FlagUp == 0 {
		if err := h.nl.LinkSetUp(br); err != nil {
			return nil, fmt.Errorf("bringing up %s: %w", name, err)
		}
	}
	return br, nil
}

// openTap opens (creating when missing) the persistent tap name in the host's namespace. A tap
// belongs to the namespace /dev/net/tun was opened in, so the open happens on a thread that
// has entered it.
func (h *Host) openTap(name string) (*os.File, error) {
	var f *os.File
	err := h.inNetNS(func() error {
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

func (h *Host) configureTap(name, vmUID string, br netlink.Link) error {
	tap, err := h.nl.LinkByName(name)
	if err != nil {
		return fmt.Errorf("looking up tap %s: %w", name, err)
	}
	a := tap.Attrs()
	if a.Alias != vmAlias+vmUID {
		if err := h.nl.LinkSetAlias(tap, vmAlias+vmUID); err != nil {
			return fmt.Errorf("naming tap %s: %w", name, err)
		}
	}
	if a.MTU != h.opts.MTU {
		if err := h.nl.LinkSetMTU(tap, h.opts.MTU); err != nil {
			return fmt.Errorf("setting the MTU of %s: %w", name, err)
		}
	}
	if a.MasterIndex != br.Attrs().Index {
		if err := h.nl.LinkSetMasterByIndex(tap, br.Attrs().Index); err != nil {
			return fmt.Errorf("putting tap %s on bridge %s: %w", name, br.Attrs().Name, err)
		}
	}
	if a.Flags&net.FlagUp == 0 {
		if err := h.nl.LinkSetUp(tap); err != nil {
			return fmt.Errorf("bringing up %s: %w", name, err)
		}
	}
	return nil
}

// taps lists IMP taps on the bridge with index br.
func (h *Host) taps(br int) ([]string, error) {
	links, err := h.nl.LinkList()
	if err != nil {
		return nil, fmt.Errorf("listing links: %w", err)
	}
	var taps []string
	for _, l := range links {
		if a := l.Attrs(); a.MasterIndex == br && strings.HasPrefix(a.Name, tapPrefix) {
			taps = append(taps, a.Name)
		}
	}
	return taps, nil
}

func (h *Host) ensureVXLAN(n Network, br int, peers []Peer) error {
	name := n.VXLANName()
	want := &netlink.Vxlan{
		LinkAttrs: netlink.LinkAttrs{Name: name, MTU: h.opts.MTU, MasterIndex: br},
		VxlanId:   int(n.VNI), SrcAddr: h.opts.VTEP.AsSlice(), Port: h.opts.VXLANPort, Learning: false,
	}
	l, err := h.nl.LinkByName(name)
	if err == nil {
		cur, ok := l.(*netlink.Vxlan)
		if !ok || cur.VxlanId != want.VxlanId || !cur.SrcAddr.Equal(want.SrcAddr) || cur.Port != want.Port || cur.Learning {
			if err := h.nl.LinkDel(l); err != nil {
				return fmt.Errorf("replacing %s: %w", name, err)
			}
			err = errNotFound
		}
	}
	if isNotFound(err) {
		if err := h.nl.LinkAdd(want); err != nil {
			return fmt.Errorf("creating VXLAN device %s (VNI %d, port %d): %w", name, n.VNI, h.opts.VXLANPort, err)
		}
		l, err = h.nl.LinkByName(name)
	}
	if err != nil {
		return fmt.Errorf("looking up %s: %w", name, err)
	}
	if l.Attrs().Alias != netAlias+n.Key() {
		if err := h.nl.LinkSetAlias(l, netAlias+n.Key()); err != nil {
			return fmt.Errorf("naming %s: %w", name, err)
		}
	}
	if l.Attrs().MasterIndex != br {
		if err := h.nl.LinkSetMasterByIndex(l, br); err != nil {
			return fmt.Errorf("putting %s on its bridge: %w", name, err)
		}
	}
	if l.Attrs().Flags&net.FlagUp == 0 {
		if err := h.nl.LinkSetUp(l); err != nil {
			return fmt.Errorf("bringing up %s: %w", name, err)
		}
	}
	return h.syncFDB(l.Attrs().Index, peers)
}

type fdbKey struct{ mac, dst string }

// syncFDB makes the VXLAN device's forwarding entries exactly: each peer's MAC to its node,
// and the zero MAC to every peer node, which sends broadcasts (ARP) to each of them.
func (h *Host) syncFDB(vx int, peers []Peer) error {
	zero := net.HardwareAddr{0, 0, 0, 0, 0, 0}
	want := map[fdbKey]bool{}
	for _, p := range peers {
		if p.VTEP == h.opts.VTEP {
			continue
		}
		want[fdbKey{MAC(p.IP).String(), p.VTEP.String()}] = true
		want[fdbKey{zero.String(), p.VTEP.String()}] = true
	}
	cur, err := h.nl.NeighList(vx, unix.AF_BRIDGE)
	if err != nil {
		return fmt.Errorf("listing forwarding entries: %w", err)
	}
	for _, e := range cur {
		if e.IP == nil || e.Flags&netlink.NTF_SELF == 0 {
			continue
		}
		k := fdbKey{e.HardwareAddr.String(), e.IP.String()}
		if want[k] {
			delete(want, k)
			continue
		}
		if err := h.nl.NeighDel(&e); err != nil {
			return fmt.Errorf("removing forwarding entry %s via %s: %w", k.mac, k.dst, err)
		}
	}
	for k := range want {
		mac, _ := net.ParseMAC(k.mac)
		e := &netlink.Neigh{LinkIndex: vx, Family: unix.AF_BRIDGE, State: netlink.NUD_PERMANENT, Flags: netlink.NTF_SELF,
			HardwareAddr: mac, IP: net.ParseIP(k.dst)}
		if err := h.nl.NeighAppend(e); err != nil {
			return fmt.Errorf("adding forwarding entry %s via %s: %w", k.mac, k.dst, err)
		}
	}
	return nil
}

// removeNetwork removes a network's VXLAN device, bridge and rules.
func (h *Host) removeNetwork(bridge, vxlan string) error {
	for _, name := range []string{vxlan, bridge} {
		l, err := h.nl.LinkByName(name)
		if isNotFound(err) {
			continue
		} else if err != nil {
			return fmt.Errorf("looking up %s: %w", name, err)
		}
		if err := h.nl.LinkDel(l); err != nil {
			return fmt.Errorf("removing %s: %w", name, err)
		}
	}
	if err := h.replaceRules(bridge, nil); err != nil {
		return err
	}
	return h.syncForwarding()
}

var errNotFound = errors.New("not found")

func isNotFound(err error) bool {
	var lnf netlink.LinkNotFoundError
	return errors.As(err, &lnf) || errors.Is(err, errNotFound)
}

// inNetNS runs f on an OS thread that has entered the host's namespace.
func (h *Host) inNetNS(f func() error) error {
	if h.opts.NetNS == "" {
		return f()
	}
	errc := make(chan error, 1)
	go func() {
		// The thread is never unlocked: it dies with the goroutine rather than return to the
		// scheduler in another namespace.
		runtime.LockOSThread()
		if err := netns.Set(h.ns); err != nil {
			errc <- fmt.Errorf("entering network namespace %s: %w", h.opts.NetNS, err)
			return
		}
		errc <- f()
	}()
	return <-errc
}

// syncForwarding turns IPv4 forwarding on while a NAT network is present and back off when
// none is, but only when it was IMP that turned it on in this boot: the marker holds the boot
// id, so after a reboot, where the node's own configuration may have turned forwarding on, an
// old marker means nothing.
func (h *Host) syncForwarding() error {
	need, err := h.natPresent()
	if err != nil {
		return err
	}
	marker := filepath.Join(h.opts.StateDir, "ip_forward-enabled-by-imp")
	return h.inNetNS(func() error {
		const knob = "/proc/sys/net/ipv4/ip_forward"
		cur, err := os.ReadFile(knob)
		if err != nil {
			return fmt.Errorf("reading %s: %w", knob, err)
		}
		on := strings.TrimSpace(string(cur)) == "1"
		mark, err := os.ReadFile(marker)
		ours := err == nil && strings.TrimSpace(string(mark)) == h.opts.BootID
		if err == nil && !ours {
			if err := os.Remove(marker); err != nil {
				return fmt.Errorf("removing the forwarding marker of an earlier boot: %w", err)
			}
		}
		switch {
		case need && !on:
			if err := os.WriteFile(marker, []byte(h.opts.BootID+"\n"), 0o600); err != nil {
				return err
			}
			if err := os.WriteFile(knob, []byte("1"), 0o644); err != nil {
				return fmt.Errorf("enabling IPv4 forwarding: %w", err)
			}
		case !need && on && ours:
			if err := os.WriteFile(knob, []byte("0"), 0o644); err != nil {
				return fmt.Errorf("disabling IPv4 forwarding: %w", err)
			}
			return os.Remove(marker)
		}
		return nil
	})
}

// SetOwner lets uid open the tap that f is attached to (TUNSETOWNER): an unprivileged VMM,
// such as a jailed Firecracker, opens the persistent tap by name.
func SetOwner(f *os.File, uid int) error {
	raw, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ioErr error
	if err := raw.Control(func(fd uintptr) { ioErr = unix.IoctlSetInt(int(fd), unix.TUNSETOWNER, uid) }); err != nil {
		return err
	}
	if ioErr != nil {
		return fmt.Errorf("giving the tap to uid %d: %w", uid, ioErr)
	}
	return nil
}
