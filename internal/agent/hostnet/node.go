package hostnet

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// rtprotIMP marks the node's routes to transit addresses as IMP's.
const rtprotIMP netlink.RouteProtocol = 0x49

// vxlanPeers admits (peer node address . VNI) to the overlay's port.
func (h *Host) vxlanPeers() *nftables.Set {
	return &nftables.Set{Table: inetTable, Name: "vxlan-peers", Concatenation: true,
		KeyType: nftables.MustConcatSetType(h.vtepType(), nftables.TypeInteger)}
}

// vxlanVMs admits (peer node address . VNI . VM address): the VMs of a network placed on a
// peer node, the only sources its frames on that network's overlay may carry.
func (h *Host) vxlanVMs() *nftables.Set {
	return &nftables.Set{Table: inetTable, Name: "vxlan-vms", Concatenation: true,
		KeyType: nftables.MustConcatSetType(h.vtepType(), nftables.TypeInteger, nftables.TypeIPAddr)}
}

func (h *Host) vtepType() nftables.SetDatatype {
	if h.opts.VTEP.Is6() {
		return nftables.TypeIP6Addr
	}
	return nftables.TypeIPAddr
}

func (h *Host) peerAddr() string {
	if h.opts.VTEP.Is6() {
		return "ip6 saddr"
	}
	return "ip saddr"
}

// vxlanPort matches UDP to the overlay's port.
func (h *Host) vxlanPort() []expr.Any {
	proto := byte(unix.NFPROTO_IPV4)
	if h.opts.VTEP.Is6() {
		proto = unix.NFPROTO_IPV6
	}
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_UDP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(uint16(h.opts.VXLANPort))},
	}
}

// vxlanLookup looks (source . VNI[ . the 4 bytes at inner, from the UDP header]) up in set. The
// VNI is the first three bytes of the VXLAN header's second word, whose last byte is reserved
// (zero): the word as a whole is the key's second part. A packet too short to hold what is
// looked up matches no lookup, inverted or not.
func (h *Host) vxlanLookup(set string, inner uint32, invert bool) []expr.Any {
	off, size, vniReg := uint32(12), uint32(4), uint32(9) // NFT_REG32_01
	if h.opts.VTEP.Is6() {
		off, size, vniReg = 8, 16, 12 // NFT_REG32_04
	}
	e := []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: size},
		&expr.Payload{DestRegister: vniReg, Base: expr.PayloadBaseTransportHeader, Offset: 12, Len: 4},
	}
	if inner > 0 {
		e = append(e, &expr.Payload{DestRegister: vniReg + 1, Base: expr.PayloadBaseTransportHeader, Offset: inner, Len: 4})
	}
	return append(e, &expr.Lookup{SourceRegister: 1, SetName: set, Invert: invert})
}

// vxlanFilter matches UDP to the overlay's port whose (source . VNI) is not in vxlan-peers.
func (h *Host) vxlanFilter() []expr.Any {
	return cat(h.vxlanPort(), h.vxlanLookup("vxlan-peers", 0, true))
}

// Where a VXLAN packet's inner frame lies, in bytes from its UDP header (8 bytes) and VXLAN
// header (8): the Ethernet source MAC, the EtherType, an IPv4 header's source, an ARP
// packet's sender MAC and sender address.
const (
	innerSrcMAC    = 16 + 6
	innerType      = 16 + 12
	innerIPSrc     = 16 + 14 + 12
	innerARPSender = 16 + 14 + 8
	innerARPAddr   = 16 + 14 + 14
)

// vxlanFromVMs are the rules that let a peer's packet on a network's overlay pass only with a
// frame from a VM placed on that peer: Ethernet source one of their MACs (0a:58 and the VM's
// address), IPv4 with one of their addresses as source or ARP with one of their MACs and
// addresses as sender, nothing else (no other EtherType, no VLAN tag, nothing too short to
// tell). The receiving node's own VMs, the gateway and other nodes' VMs are none of them.
func (h *Host) vxlanFromVMs() []rule {
	src, port := h.peerAddr(), h.opts.VXLANPort
	macOf := func(off uint32) []expr.Any {
		return cat(payload(expr.PayloadBaseTransportHeader, off, []byte{0x0a, 0x58}, expr.CmpOpEq), h.vxlanLookup("vxlan-vms", off+2, false))
	}
	typeIs := func(t uint16) []expr.Any {
		return payload(expr.PayloadBaseTransportHeader, innerType, binaryutil.BigEndian.PutUint16(t), expr.CmpOpEq)
	}
	return []rule{
		{nodeInput, fmt.Sprintf("udp dport %d @th,176,16 0x0a58 %[2]s . @th,96,32 . @th,192,32 @vxlan-vms @th,224,16 0x0800 %[2]s . @th,96,32 . @th,336,32 @vxlan-vms accept", port, src),
			cat(h.vxlanPort(), macOf(innerSrcMAC), typeIs(unix.ETH_P_IP), h.vxlanLookup("vxlan-vms", innerIPSrc, false), verdict(expr.VerdictAccept))},
		{nodeInput, fmt.Sprintf("udp dport %d @th,176,16 0x0a58 %[2]s . @th,96,32 . @th,192,32 @vxlan-vms @th,224,16 0x0806 @th,304,16 0x0a58 %[2]s . @th,96,32 . @th,320,32 @vxlan-vms %[2]s . @th,96,32 . @th,352,32 @vxlan-vms accept", port, src),
			cat(h.vxlanPort(), macOf(innerSrcMAC), typeIs(unix.ETH_P_ARP), macOf(innerARPSender), h.vxlanLookup("vxlan-vms", innerARPAddr, false), verdict(expr.VerdictAccept))},
		{nodeInput, fmt.Sprintf("udp dport %d counter drop", port), cat(h.vxlanPort(), drop())},
	}
}

func peerKey(vtep netip.Addr, vni uint32) []byte {
	return binary.BigEndian.AppendUint32(vtep.AsSlice(), vni<<8)
}

func vmKey(vtep netip.Addr, vni uint32, vm netip.Addr) []byte {
	a := vm.As4()
	return append(peerKey(vtep, vni), a[:]...)
}

// createNodeTables adds the node's table, chains and sets to the next batch.
func (h *Host) createNodeTables() {
	h.nft.AddTable(inetTable)
	for _, c := range nodeChains {
		h.nft.AddChain(c)
	}
	if h.opts.VTEP.IsValid() {
		_ = h.nft.AddSet(h.vxlanPeers(), nil)
		_ = h.nft.AddSet(h.vxlanVMs(), nil)
	}
	_ = h.nft.AddSet(endpointsSet, nil)
}

// ensureNodeRules makes the node's rules current.
func (h *Host) ensureNodeRules() error {
	if err := replaceRules(h.nft, nodeChains, h.createNodeTables, "node", h.nodeRules()); err != nil {
		return fmt.Errorf("the node's rules: %w", err)
	}
	return nil
}

// syncPeers makes what the overlay of vni admits exactly peers: their nodes, and from each
// node the VMs placed on it.
func (h *Host) syncPeers(vni uint32, peers []Peer) error {
	if !h.opts.VTEP.IsValid() || vni == 0 {
		return nil
	}
	nodes, vms := map[string]bool{}, map[string]bool{}
	for _, p := range peers {
		if p.VTEP.Is4() == h.opts.VTEP.Is4() && p.VTEP != h.opts.VTEP && p.IP.Is4() {
			nodes[string(peerKey(p.VTEP, vni))] = true
			vms[string(vmKey(p.VTEP, vni, p.IP))] = true
		}
	}
	for _, s := range []struct {
		set  *nftables.Set
		want map[string]bool
	}{{h.vxlanPeers(), nodes}, {h.vxlanVMs(), vms}} {
		if err := h.syncVNI(s.set, vni, s.want); err != nil {
			return err
		}
	}
	return nil
}

// syncVNI makes set's elements of vni (keys: address . VNI word[ . more]) exactly want.
func (h *Host) syncVNI(set *nftables.Set, vni uint32, want map[string]bool) error {
	cur, err := h.nft.GetSetElements(set)
	if err != nil {
		if _, err2 := h.nft.GetSetByName(set.Table, set.Name); err2 == nil {
			return fmt.Errorf("listing set %s: %w", set.Name, err)
		}
		// No set: nothing to remove, and the node's rules make it.
		if len(want) == 0 {
			return nil
		}
		if err := h.ensureNodeRules(); err != nil {
			return err
		}
		cur = nil
	}
	at, word := h.opts.VTEP.BitLen()/8, binary.BigEndian.AppendUint32(nil, vni<<8)
	var del []nftables.SetElement
	for _, e := range cur {
		if len(e.Key) < at+4 || !bytes.Equal(e.Key[at:at+4], word) {
			continue
		}
		if want[string(e.Key)] {
			delete(want, string(e.Key))
		} else {
			del = append(del, nftables.SetElement{Key: e.Key})
		}
	}
	if len(del) == 0 && len(want) == 0 {
		return nil
	}
	if len(del) > 0 {
		if err := h.nft.SetDeleteElements(set, del); err != nil {
			return err
		}
	}
	var add []nftables.SetElement
	for k := range want {
		add = append(add, nftables.SetElement{Key: []byte(k)})
	}
	if len(add) > 0 {
		if err := h.nft.SetAddElements(set, add); err != nil {
			return err
		}
	}
	if err := h.nft.Flush(); err != nil {
		return fmt.Errorf("updating set %s of VNI %d: %w", set.Name, vni, err)
	}
	return nil
}

// ensureTransit makes n's transit link: a veth pair between the node's namespace (impe…, no
// address) and n's (impu…, the network's transit address T/32). n's namespace routes
// everything else to the transit range's first host address, a next hop that exists only as
// a static neighbour entry for the node's end; the node routes T to its end, with a static
// neighbour entry too, so no ARP ever crosses the link.
func (h *Host) ensureTransit(s *space, n Network) error {
	hostName, upName := egressPrefix+s.id, uplinkPrefix+s.id
	l, err := h.nl.LinkByName(hostName)
	if isNotFound(err) {
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostName}, PeerName: upName, PeerNamespace: netlink.NsFd(int(s.ns))}
		if err := h.nl.LinkAdd(veth); err != nil {
			return fmt.Errorf("creating the transit link of %s: %w", n.Key(), err)
		}
		l, err = h.nl.LinkByName(hostName)
	}
	if err != nil {
		return fmt.Errorf("looking up %s: %w", hostName, err)
	}
	up, err := s.nl.LinkByName(upName)
	if isNotFound(err) { // half a pair cannot be: the other half was another's
		_ = h.nl.LinkDel(l)
		return fmt.Errorf("the transit link of %s has no end in its namespace: %w", n.Key(), err)
	}
	if err != nil { // not known: the link and its endpoint routes stay
		return fmt.Errorf("looking up %s in the namespace of %s: %w", upName, n.Key(), err)
	}
	t, err := h.transitAddr(l.Attrs().Index)
	if err != nil {
		return err
	}
	hop := h.opts.TransitCIDR.Addr().Next()
	host32 := func(a netip.Addr) *net.IPNet { return &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(32, 32)} }
	steps := []struct {
		what string
		do   func() error
	}{
		{"addressing", func() error { return s.nl.AddrReplace(up, &netlink.Addr{IPNet: host32(t)}) }},
		{"bringing up", func() error { return s.nl.LinkSetUp(up) }},
		{"routing to the next hop", func() error {
			return s.nl.RouteReplace(&netlink.Route{LinkIndex: up.Attrs().Index, Dst: host32(hop), Scope: netlink.SCOPE_LINK})
		}},
		{"routing egress", func() error {
			return s.nl.RouteReplace(&netlink.Route{LinkIndex: up.Attrs().Index, Gw: hop.AsSlice()})
		}},
		{"naming the next hop", func() error {
			return s.nl.NeighSet(&netlink.Neigh{LinkIndex: up.Attrs().Index, Family: unix.AF_INET, State: netlink.NUD_PERMANENT,
				IP: hop.AsSlice(), HardwareAddr: l.Attrs().HardwareAddr})
		}},
		{"naming", func() error {
			if l.Attrs().Alias == netAlias+n.Key() {
				return nil
			}
			return h.nl.LinkSetAlias(l, netAlias+n.Key())
		}},
		{"bringing up the node's end", func() error { return h.nl.LinkSetUp(l) }},
		{"routing to the network", func() error {
			return h.nl.RouteReplace(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: host32(t), Scope: netlink.SCOPE_LINK, Protocol: rtprotIMP})
		}},
		{"naming the network's end", func() error {
			return h.nl.NeighSet(&netlink.Neigh{LinkIndex: l.Attrs().Index, Family: unix.AF_INET, State: netlink.NUD_PERMANENT,
				IP: t.AsSlice(), HardwareAddr: up.Attrs().HardwareAddr})
		}},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			return fmt.Errorf("transit link of %s: %s: %w", n.Key(), st.what, err)
		}
	}
	return nil
}

// transitAddr is the transit address routed to the node's end link of a transit link: the one
// it has, or the first one free.
func (h *Host) transitAddr(link int) (netip.Addr, error) {
	routes, err := h.nl.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Protocol: rtprotIMP}, netlink.RT_FILTER_PROTOCOL)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("listing transit routes: %w", err)
	}
	used := map[netip.Addr]bool{}
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		a, ok := netip.AddrFromSlice(r.Dst.IP.To4())
		if !ok {
			continue
		}
		if r.LinkIndex == link {
			return a, nil
		}
		used[a] = true
	}
	p := h.opts.TransitCIDR
	for a := p.Addr().Next().Next(); p.Contains(a.Next()); a = a.Next() { // not the next hop, not broadcast
		if !used[a] {
			return a, nil
		}
	}
	return netip.Addr{}, fmt.Errorf("no transit address left in %s: at most %d NAT networks fit on a node", p, len(used))
}

// removeTransit removes the transit link of the network with id; its route goes with it.
func (h *Host) removeTransit(id string) error {
	l, err := h.nl.LinkByName(egressPrefix + id)
	if isNotFound(err) {
		return nil
	} else if err != nil {
		return fmt.Errorf("looking up %s: %w", egressPrefix+id, err)
	}
	if err := h.nl.LinkDel(l); err != nil {
		return fmt.Errorf("removing %s: %w", egressPrefix+id, err)
	}
	return nil
}

// cleanNode removes the node's rules when no network is left, and turns off forwarding IMP
// turned on.
func (h *Host) cleanNode() error {
	entries, err := os.ReadDir(h.opts.NSDir)
	if err != nil {
		return fmt.Errorf("listing %s: %w", h.opts.NSDir, err)
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), nsPrefix) {
			return h.syncForwarding()
		}
	}
	tables, err := h.nft.ListTables()
	if err != nil {
		return fmt.Errorf("listing nftables tables: %w", err)
	}
	n := 0
	for _, t := range tables {
		if t.Name == "imp" && (t.Family == inetTable.Family || t.Family == bridgeTable.Family) {
			h.nft.DelTable(t)
			n++
		}
	}
	if n > 0 {
		if err := h.nft.Flush(); err != nil {
			return fmt.Errorf("removing IMP's nftables tables: %w", err)
		}
	}
	return h.syncForwarding()
}

// pruneNode removes from the node's namespace the transit links of networks without a
// namespace and rules that are not the node's (an earlier layout's).
func (h *Host) pruneNode() error {
	links, err := h.nl.LinkList()
	if err != nil {
		return fmt.Errorf("listing links: %w", err)
	}
	var errs []error
	for _, l := range links {
		id, ok := strings.CutPrefix(l.Attrs().Name, egressPrefix)
		if !ok || h.spaces[id] != nil {
			continue
		}
		if err := h.nl.LinkDel(l); err != nil {
			errs = append(errs, fmt.Errorf("removing %s: %w", l.Attrs().Name, err))
		}
	}
	return errors.Join(append(errs, h.pruneLegacyRules())...)
}

// pruneLegacyRules removes IMP rules in the node's namespace that are not the node's: those
// of an agent of the earlier layout, which kept every network's rules there.
func (h *Host) pruneLegacyRules() error {
	n := 0
	for _, c := range legacyChains {
		rs, err := getRules(h.nft, c)
		if err != nil {
			return err
		}
		for _, r := range rs {
			if strings.HasPrefix(comment(r), "imp:node:") {
				continue
			}
			if err := h.nft.DelRule(r); err != nil {
				return err
			}
			// Flush in batches: the kernel acknowledges each message, and a socket buffer
			// holds a few hundred acknowledgements.
			if n++; n%100 == 0 {
				if err := h.nft.Flush(); err != nil {
					return fmt.Errorf("removing the earlier layout's rules: %w", err)
				}
			}
		}
	}
	if n > 0 {
		if err := h.nft.Flush(); err != nil {
			return fmt.Errorf("removing the earlier layout's rules: %w", err)
		}
	}
	tables, err := h.nft.ListTablesOfFamily(nftables.TableFamilyBridge)
	if err != nil {
		return fmt.Errorf("listing nftables tables: %w", err)
	}
	for _, t := range tables {
		if t.Name == bridgeTable.Name {
			h.nft.DelTable(t)
			if err := h.nft.Flush(); err != nil {
				return fmt.Errorf("removing the earlier layout's bridge table: %w", err)
			}
		}
	}
	return nil
}
