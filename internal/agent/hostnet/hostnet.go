// Package hostnet is the node side of ImpNetworks. Each network a node's VMs use gets a network
// namespace of its own, pinned under Options.NSDir: in it a bridge holding the gateway address,
// the VMs' taps, the network's rules (isolation, anti-spoofing, the gateway answering ICMP and
// ARP only) and, when the node takes part in the overlay, a VXLAN device whose UDP socket stays
// in the node's namespace. A network with NAT also gets a veth pair to the node's namespace,
// over which its traffic leaves twice masqueraded: to the network's transit address inside, to
// the node's address outside. A tenant's CIDR never reaches the node's routing table, and
// networks with the same CIDR live side by side.
//
// In the node's namespace IMP keeps one table, inet imp: nothing from a network reaches the
// node itself, egress goes only outside (never link-local or the denied CIDRs), and the overlay
// port accepts VXLAN only from the nodes that take part in each network.
//
// Every operation measures first and changes only what differs, so running it again on a
// healthy host does nothing. Links carry an alias naming what they belong to, which is how a
// restarted agent finds them again.
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

// Names and aliases of IMP's links and namespaces. Interface names are at most 15 bytes.
const (
	nsPrefix     = "impn"     // a network's namespace, under Options.NSDir
	bridgePrefix = "impb"     // in the network's namespace
	vxlanPrefix  = "impx"     // in the network's namespace; its socket in the node's
	tapPrefix    = "impt"     // in the network's namespace
	egressPrefix = "impe"     // the node's end of a NAT network's transit link
	uplinkPrefix = "impu"     // the network's end of it
	netAlias     = "imp-net:" // + namespace/name
	vmAlias      = "imp-vm:"  // + VM UID
	// DefaultVXLANPort is the overlay's UDP port: not 4789 (IANA; Calico, Antrea, NSX) nor
	// 8472 (Linux's default; flannel, Cilium), so IMP's overlay coexists with the cluster's CNI.
	DefaultVXLANPort = 4792
	// DefaultMTU leaves room for VXLAN's 50 bytes on a 1500-byte underlay.
	DefaultMTU = 1450
	// DefaultNSDir is where network namespaces are pinned: a tmpfs, gone with a reboot as the
	// namespaces are.
	DefaultNSDir = "/run/imp/netns"
)

// DefaultTransitCIDR holds the transit addresses of NAT networks: the first host address is
// the next hop every network's namespace routes egress to (it exists only as a static
// neighbour), the others one per NAT network on a node, each a /32 route in the node's table.
var DefaultTransitCIDR = netip.MustParsePrefix("169.254.210.0/24")

// Network is one ImpNetwork as a node plumbs it.
type Network struct {
	Namespace, Name string
	// UID names the network's namespace and links, so a network deleted and created again
	// gets new ones.
	UID string
	// VNI is the overlay's VXLAN network identifier; 0 until the operator assigns one.
	VNI     uint32
	Prefix  netip.Prefix
	Gateway netip.Addr
	NAT     bool
	// Egress is where NAT egress may go (the zero value: nowhere; PublicEgress: public
	// addresses only).
	Egress Egress
}

// Key is "namespace/name".
func (n Network) Key() string { return n.Namespace + "/" + n.Name }

func shortID(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:5])
}

func (n Network) id() string { return shortID(n.UID) }

// BridgeName is the name of the network's bridge, in its namespace, on every node.
func (n Network) BridgeName() string { return bridgePrefix + n.id() }

// VXLANName is the name of the network's VXLAN device, in its namespace, on every node.
func (n Network) VXLANName() string { return vxlanPrefix + n.id() }

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
	// NetNS is the path of the node's network namespace (tests simulate nodes this way);
	// empty is the agent's own.
	NetNS string
	// NSDir is where the networks' namespaces are pinned (DefaultNSDir when empty). It must
	// outlive the agent: a hostPath with bidirectional mount propagation in a pod.
	NSDir string
	// VTEP is this node's underlay address for the overlay; invalid means no overlay.
	VTEP netip.Addr
	// VXLANPort is the overlay's UDP port (DefaultVXLANPort when 0).
	VXLANPort int
	// MTU of taps, VXLAN devices and guests (DefaultMTU when 0).
	MTU int
	// TransitCIDR holds NAT networks' transit addresses (DefaultTransitCIDR when invalid).
	TransitCIDR netip.Prefix
	// DeniedEgress are destinations NAT egress never reaches, beyond the node itself and
	// link-local addresses: the cluster's pod and service ranges, say.
	DeniedEgress []netip.Prefix
	// StateDir holds what the host remembers across restarts (whether it enabled forwarding).
	StateDir string
	// BootID identifies the running boot of the node (default: the kernel's
	// /proc/sys/kernel/random/boot_id). What StateDir remembers of the node's kernel settings
	// holds only within the boot that wrote it.
	BootID string
}

// Host plumbs ImpNetworks on one node. Its methods are safe for concurrent use.
type Host struct {
	opts Options
	ns   netns.NsHandle // the node's namespace
	nl   *netlink.Handle
	nft  *nftables.Conn
	mu   sync.Mutex
	// spaces are the networks' namespaces opened so far, by network id.
	spaces map[string]*space
}

// Open returns a Host for opts.NetNS, after moving networks an agent of the earlier layout
// left in the node's namespace into namespaces of their own.
func Open(opts Options) (*Host, error) {
	if opts.VXLANPort == 0 {
		opts.VXLANPort = DefaultVXLANPort
	}
	if opts.MTU == 0 {
		opts.MTU = DefaultMTU
	}
	if opts.NSDir == "" {
		opts.NSDir = DefaultNSDir
	}
	if !opts.TransitCIDR.IsValid() {
		opts.TransitCIDR = DefaultTransitCIDR
	}
	if !opts.TransitCIDR.Addr().Is4() || opts.TransitCIDR.Bits() > 30 {
		return nil, fmt.Errorf("transit CIDR %s: want an IPv4 range of at least 4 addresses", opts.TransitCIDR)
	}
	opts.TransitCIDR = opts.TransitCIDR.Masked()
	for _, p := range opts.DeniedEgress {
		if !p.Addr().Is4() {
			return nil, fmt.Errorf("denied egress CIDR %s: only IPv4 ranges apply to ImpNetworks", p)
		}
	}
	if opts.BootID == "" {
		id, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
		if err != nil {
			return nil, fmt.Errorf("reading the boot id: %w", err)
		}
		opts.BootID = strings.TrimSpace(string(id))
	}
	if err := os.MkdirAll(opts.NSDir, 0o755); err != nil {
		return nil, fmt.Errorf("creating %s: %w", opts.NSDir, err)
	}
	h := &Host{opts: opts, spaces: map[string]*space{}}
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
	if err := h.migrate(); err != nil {
		h.Close()
		return nil, fmt.Errorf("moving networks of the earlier layout into namespaces: %w", err)
	}
	return h, nil
}

// MTU is the MTU guests get.
func (h *Host) MTU() int { return h.opts.MTU }

// Close releases the Host's handles; namespaces, links and rules stay.
func (h *Host) Close() {
	for _, s := range h.spaces {
		s.close()
	}
	if h.nl != nil {
		h.nl.Close()
	}
	if h.nft != nil {
		_ = h.nft.CloseLasting()
	}
	h.ns.Close()
}

// Attachment is a VM's place on its network: its tap, open for the VMM (the caller closes it
// once the VMM holds it), and the network namespace the tap lives in, which a VMM that opens
// the tap by name (Firecracker) joins.
type Attachment struct {
	Tap   *os.File
	NetNS string
	// Network is the network the VM is attached to, and IP its address there.
	Network Network
	IP      netip.Addr
}

// Attach gives a VM with address ip a tap on n's bridge, creating the network's namespace,
// bridge and rules when missing.
func (h *Host) Attach(n Network, vmUID string, ip netip.Addr) (Attachment, error) {
	if !n.Prefix.Contains(ip) || ip == n.Gateway {
		return Attachment{}, fmt.Errorf("address %s is not a host address of %s", ip, n.Prefix)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	s, err := h.ensureSpace(n.id())
	if err != nil {
		return Attachment{}, err
	}
	br, err := s.ensureBridge(n, h.opts.MTU)
	if err != nil {
		return Attachment{}, err
	}
	if err := h.ensureNetwork(s, n, false); err != nil {
		return Attachment{}, err
	}
	tapName := TapName(vmUID)
	f, err := s.openTap(tapName)
	if err != nil {
		return Attachment{}, err
	}
	if err := s.configureTap(tapName, vmUID, br, h.opts.MTU); err != nil {
		f.Close()
		return Attachment{}, err
	}
	if err := s.ensureTapRules(tapName, ip); err != nil {
		f.Close()
		return Attachment{}, fmt.Errorf("anti-spoofing rules of %s: %w", tapName, err)
	}
	return Attachment{Tap: f, NetNS: s.path, Network: n, IP: ip}, nil
}

// Readdress moves the anti-spoofing rules of the tap of the VM kept under vmUID, which a
// running VMM holds, to address ip (and its MAC): from then on what the guest sends from its
// former address or MAC is dropped. The tap is not opened (its VMM holds it): the returned
// attachment has none.
func (h *Host) Readdress(n Network, vmUID string, ip netip.Addr) (Attachment, error) {
	if !n.Prefix.Contains(ip) || ip == n.Gateway {
		return Attachment{}, fmt.Errorf("address %s is not a host address of %s", ip, n.Prefix)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	s, tapName, err := h.existingTap(n, vmUID)
	if err != nil {
		return Attachment{}, err
	}
	prev := s.tapAddr(tapName)
	if err := s.ensureTapRules(tapName, ip); err != nil {
		return Attachment{}, fmt.Errorf("anti-spoofing rules of %s: %w", tapName, err)
	}
	if prev.IsValid() && prev != ip { // a run adopted at its own address keeps its connections
		if err := s.forgetFlows(prev); err != nil {
			return Attachment{}, err
		}
	}
	return Attachment{NetNS: s.path, Network: n, IP: ip}, nil
}

// OpenTap opens the tap of the VM kept under vmUID on n, which must exist, as its VMM does: for
// what stands in for the VM while no VMM holds it (package wake). It fails while a VMM holds it.
func (h *Host) OpenTap(n Network, vmUID string) (Attachment, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	s, tapName, err := h.existingTap(n, vmUID)
	if err != nil {
		return Attachment{}, err
	}
	f, err := s.openTap(tapName)
	if err != nil {
		return Attachment{}, err
	}
	return Attachment{Tap: f, NetNS: s.path, Network: n}, nil
}

// existingTap is n's namespace and the name of the tap of the VM kept under vmUID there, which
// must exist. h.mu is held.
func (h *Host) existingTap(n Network, vmUID string) (*space, string, error) {
	s, err := h.openSpace(n.id())
	if err != nil {
		return nil, "", err
	}
	tapName := TapName(vmUID)
	if s == nil {
		return nil, "", fmt.Errorf("network %s has no namespace on the node for tap %s", n.Key(), tapName)
	}
	if _, err := s.nl.LinkByName(tapName); err != nil {
		return nil, "", fmt.Errorf("looking up tap %s: %w", tapName, err)
	}
	return s, tapName, nil
}

// InNamespace runs f on an OS thread that has entered the network namespace at path: sockets f
// opens stay in it.
func InNamespace(path string, f func() error) error {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("opening network namespace %s: %w", path, err)
	}
	defer ns.Close()
	return runIn(ns, f)
}

// ensureNetwork makes n's transit link and rules, and the node's rules, match n. The
// overlay's device is Sync's: its rules stay while the device is there.
func (h *Host) ensureNetwork(s *space, n Network, overlay bool) error {
	if !overlay {
		_, err := s.nl.LinkByName(n.VXLANName())
		overlay = err == nil
	}
	exposed, err := s.exposures()
	if err != nil {
		return fmt.Errorf("network %s: %w", n.Key(), err)
	}
	if n.NAT || len(exposed) > 0 {
		if err := h.ensureTransit(s, n); err != nil {
			return err
		}
		if err := h.routeEndpoints(s, n, exposed); err != nil {
			return err
		}
	} else if err := h.removeTransit(n.id()); err != nil {
		return err
	}
	if err := s.replaceRules(spaceChains, "net", networkRules(s.id, n, overlay)); err != nil {
		return fmt.Errorf("rules of network %s: %w", n.Key(), err)
	}
	if err := h.ensureNodeRules(); err != nil {
		return err
	}
	return h.syncForwarding()
}

// Detach removes a VM's tap and its rules. The network's namespace stays until Sync finds it
// unused.
func (h *Host) Detach(vmUID string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	name := TapName(vmUID)
	spaces, err := h.openSpaces()
	if err != nil {
		return err
	}
	for _, s := range spaces {
		l, err := s.nl.LinkByName(name)
		if isNotFound(err) {
			continue
		} else if err != nil {
			return fmt.Errorf("looking up tap %s: %w", name, err)
		}
		if err := s.nl.LinkDel(l); err != nil {
			return fmt.Errorf("removing tap %s: %w", name, err)
		}
		return errors.Join(s.removeTapRules(name), h.unexposeIn(s, shortID(vmUID)))
	}
	return nil
}

// Sync makes n's node side match: with VMs attached, its namespace's bridge, rules, transit
// link, and the overlay device with a forwarding entry per peer (and one per peer node for
// broadcasts such as ARP), whose nodes alone may send the node n's VXLAN packets; with none,
// nothing of n at all. It reports whether n is present on the node afterwards.
func (h *Host) Sync(n Network, peers []Peer) (present bool, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	s, err := h.openSpace(n.id())
	if err != nil {
		return false, err
	}
	if s == nil {
		return false, h.cleanNode()
	}
	taps, err := s.taps()
	if err != nil {
		return true, err
	}
	if len(taps) == 0 {
		return false, h.removeSpace(s)
	}
	br, err := s.ensureBridge(n, h.opts.MTU)
	if err != nil {
		return true, err
	}
	overlay := h.opts.VTEP.IsValid() && n.VNI != 0
	var admitted []Peer
	if overlay {
		if err := h.ensureVXLAN(s, n, br.Attrs().Index, peers); err != nil {
			return true, err
		}
		admitted = peers
	} else if err := s.removeLink(n.VXLANName()); err != nil {
		return true, err
	}
	if err := h.ensureNetwork(s, n, overlay); err != nil {
		return true, err
	}
	return true, h.syncPeers(n.VNI, admitted)
}

// Present lists the networks with a namespace on the node, as "namespace/name".
func (h *Host) Present() ([]string, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	spaces, err := h.openSpaces()
	if err != nil {
		return nil, err
	}
	var keys []string
	for _, s := range spaces {
		if l, err := s.nl.LinkByName(bridgePrefix + s.id); err == nil {
			if key, ok := strings.CutPrefix(l.Attrs().Alias, netAlias); ok {
				keys = append(keys, key)
			}
		}
	}
	return keys, nil
}

// Prune removes the taps of VMs for which keep is false, then every network left without a
// tap, and what the node's namespace holds for networks that are gone. An agent calls it at
// start and periodically, to remove what it created for VMs that went while it was not
// looking.
func (h *Host) Prune(keep func(vmUID string) bool) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	spaces, err := h.openSpaces()
	if err != nil {
		return err
	}
	var errs []error
	for _, s := range spaces {
		links, err := s.nl.LinkList()
		if err != nil {
			errs = append(errs, fmt.Errorf("listing links of %s: %w", s.path, err))
			continue
		}
		left := 0
		for _, l := range links {
			a := l.Attrs()
			if !strings.HasPrefix(a.Name, tapPrefix) {
				continue
			}
			if uid, ok := strings.CutPrefix(a.Alias, vmAlias); ok && keep(uid) {
				left++
				continue
			}
			if err := s.nl.LinkDel(l); err != nil {
				errs = append(errs, fmt.Errorf("removing tap %s: %w", a.Name, err))
				left++
				continue
			}
			errs = append(errs, s.removeTapRules(a.Name))
		}
		if left == 0 {
			errs = append(errs, h.removeSpace(s))
		} else {
			errs = append(errs, s.pruneTapChains(), s.prunePolicies(), h.pruneExposures(s))
		}
	}
	errs = append(errs, h.pruneNode(), h.cleanNode())
	return errors.Join(errs...)
}

// ensureVXLAN makes n's VXLAN device, created from the node's namespace so that its socket
// stays on the underlay, and its forwarding entries match peers.
func (h *Host) ensureVXLAN(s *space, n Network, br int, peers []Peer) error {
	name := n.VXLANName()
	want := &netlink.Vxlan{
		LinkAttrs: netlink.LinkAttrs{Name: name, MTU: h.opts.MTU, Namespace: netlink.NsFd(int(s.ns))},
		VxlanId:   int(n.VNI), SrcAddr: h.opts.VTEP.AsSlice(), Port: h.opts.VXLANPort, Learning: false,
	}
	l, err := s.nl.LinkByName(name)
	if err == nil {
		cur, ok := l.(*netlink.Vxlan)
		if !ok || cur.VxlanId != want.VxlanId || !cur.SrcAddr.Equal(want.SrcAddr) || cur.Port != want.Port || cur.Learning {
			if err := s.nl.LinkDel(l); err != nil {
				return fmt.Errorf("replacing %s: %w", name, err)
			}
			err = errNotFound
		}
	}
	if isNotFound(err) {
		if err := h.nl.LinkAdd(want); err != nil {
			return fmt.Errorf("creating VXLAN device %s (VNI %d, port %d): %w", name, n.VNI, h.opts.VXLANPort, err)
		}
		l, err = s.nl.LinkByName(name)
	}
	if err != nil {
		return fmt.Errorf("looking up %s: %w", name, err)
	}
	if l.Attrs().Alias != netAlias+n.Key() {
		if err := s.nl.LinkSetAlias(l, netAlias+n.Key()); err != nil {
			return fmt.Errorf("naming %s: %w", name, err)
		}
	}
	if l.Attrs().MasterIndex != br {
		if err := s.nl.LinkSetMasterByIndex(l, br); err != nil {
			return fmt.Errorf("putting %s on its bridge: %w", name, err)
		}
	}
	if l.Attrs().Flags&net.FlagUp == 0 {
		if err := s.nl.LinkSetUp(l); err != nil {
			return fmt.Errorf("bringing up %s: %w", name, err)
		}
	}
	return s.syncFDB(l.Attrs().Index, peers, h.opts.VTEP)
}

type fdbKey struct{ mac, dst string }

// syncFDB makes the VXLAN device's forwarding entries exactly: each peer's MAC to its node,
// and the zero MAC to every peer node, which sends broadcasts (ARP) to each of them.
func (s *space) syncFDB(vx int, peers []Peer, self netip.Addr) error {
	zero := net.HardwareAddr{0, 0, 0, 0, 0, 0}
	want := map[fdbKey]bool{}
	for _, p := range peers {
		if p.VTEP == self {
			continue
		}
		want[fdbKey{MAC(p.IP).String(), p.VTEP.String()}] = true
		want[fdbKey{zero.String(), p.VTEP.String()}] = true
	}
	cur, err := s.nl.NeighList(vx, unix.AF_BRIDGE)
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
		if err := s.nl.NeighDel(&e); err != nil {
			return fmt.Errorf("removing forwarding entry %s via %s: %w", k.mac, k.dst, err)
		}
	}
	for k := range want {
		mac, _ := net.ParseMAC(k.mac)
		e := &netlink.Neigh{LinkIndex: vx, Family: unix.AF_BRIDGE, State: netlink.NUD_PERMANENT, Flags: netlink.NTF_SELF,
			HardwareAddr: mac, IP: net.ParseIP(k.dst)}
		if err := s.nl.NeighAppend(e); err != nil {
			return fmt.Errorf("adding forwarding entry %s via %s: %w", k.mac, k.dst, err)
		}
	}
	return nil
}

var errNotFound = errors.New("not found")

func isNotFound(err error) bool {
	var lnf netlink.LinkNotFoundError
	return errors.As(err, &lnf) || errors.Is(err, errNotFound)
}

// runIn runs f on an OS thread that has entered ns.
func runIn(ns netns.NsHandle, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		// The thread is never unlocked: it dies with the goroutine rather than return to the
		// scheduler in another namespace.
		runtime.LockOSThread()
		if err := netns.Set(ns); err != nil {
			errc <- fmt.Errorf("entering a network namespace: %w", err)
			return
		}
		errc <- f()
	}()
	return <-errc
}

// syncForwarding turns IPv4 forwarding in the node's namespace on while a NAT network is
// present and back off when none is, but only when it was IMP that turned it on in this
// boot: the marker holds the boot id, so after a reboot, where the node's own configuration
// may have turned forwarding on, an old marker means nothing.
func (h *Host) syncForwarding() error {
	need, err := h.natPresent()
	if err != nil {
		return err
	}
	marker := filepath.Join(h.opts.StateDir, "ip_forward-enabled-by-imp")
	return runIn(h.ns, func() error {
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

// natPresent says whether a NAT network's transit link is in the node's namespace.
func (h *Host) natPresent() (bool, error) {
	links, err := h.nl.LinkList()
	if err != nil {
		return false, fmt.Errorf("listing links: %w", err)
	}
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, egressPrefix) {
			return true, nil
		}
	}
	return false, nil
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
