package hostnet

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// A VM that serves Services has an endpoint address of its node's block. The node routes it
// over its network's transit link (which every network with an exposed VM has, NAT or not); in
// the network's namespace each declared port of that address is forwarded to the VM's port
// (DNAT), the connection's source becomes the gateway (so the reply needs no route back, and a
// closed network has none), and nothing else of the address answers. A tenant's CIDR still
// never reaches the node's routes: the endpoint address does, for the VM's declared ports.

// rtprotEndpoint marks the node's routes to VMs' endpoint addresses.
const rtprotEndpoint netlink.RouteProtocol = 0x4a

// endpointsSet holds the node's exposed endpoint addresses: the node's rules let replies from
// them, and only from them, back over transit links.
var endpointsSet = &nftables.Set{Table: inetTable, Name: "endpoints", KeyType: nftables.TypeIPAddr}

// dnatChain forwards the endpoint addresses' declared ports, in a network's namespace.
var dnatChain = &nftables.Chain{Name: "prerouting", Table: inetTable, Type: nftables.ChainTypeNAT,
	Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest, Policy: &accept}

// Port is a declared port of a VM.
type Port struct {
	Protocol byte // unix.IPPROTO_TCP or unix.IPPROTO_UDP
	Port     uint16
}

// Exposure is what of a VM Services reach: its endpoint address and its declared ports.
type Exposure struct {
	Endpoint netip.Addr
	Ports    []Port
}

// exposeOwner names the exposure rules of the VM whose short id (its tap's suffix) is id.
func exposeOwner(id string) string { return "exp-" + id }

// exposeRules forward e's ports arriving over up to the VM at ip.
func exposeRules(up string, ip netip.Addr, e Exposure) []rule {
	var rs []rule
	dst, to := e.Endpoint.As4(), ip.As4()
	for _, p := range e.Ports {
		rs = append(rs, rule{dnatChain, fmt.Sprintf("iifname %q ip daddr %s %s dport %d dnat ip to %s", up, e.Endpoint, protoName(p.Protocol), p.Port, ip),
			cat(ifname(expr.MetaKeyIIFNAME, up, true), ipv4(), payload(expr.PayloadBaseNetworkHeader, 16, dst[:], expr.CmpOpEq),
				l4proto(p.Protocol), dportRange(p.Port, p.Port),
				[]expr.Any{
					&expr.Immediate{Register: 1, Data: to[:]},
					&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1},
				})})
	}
	return rs
}

// exposedRules are a network's rules for its exposed VMs, whether or not it has any: a
// connection the DNAT made passes between the transit link and the bridge, and leaves towards
// the VM from the gateway's address.
func exposedRules(br, up string) []rule {
	dnat := func() []expr.Any {
		return []expr.Any{
			&expr.Ct{Register: 1, Key: expr.CtKeySTATUS},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: nativeU32(0x20), Xor: nativeU32(0)},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: nativeU32(0)},
		}
	}
	return []rule{
		{spaceForward, fmt.Sprintf("iifname %q oifname %q ct status dnat accept", up, br),
			cat(ifname(expr.MetaKeyIIFNAME, up, true), ifname(expr.MetaKeyOIFNAME, br, true), dnat(), verdict(expr.VerdictAccept))},
		{spaceForward, fmt.Sprintf("iifname %q oifname %q ct status dnat accept", br, up),
			cat(ifname(expr.MetaKeyIIFNAME, br, true), ifname(expr.MetaKeyOIFNAME, up, true), dnat(), verdict(expr.VerdictAccept))},
		{natChain, fmt.Sprintf("oifname %q ct status dnat counter masquerade", br),
			cat(ifname(expr.MetaKeyOIFNAME, br, true), dnat(), []expr.Any{&expr.Counter{}, &expr.Masq{}})},
	}
}

// nativeU32 is v in the host's byte order, as the kernel keeps conntrack's status.
func nativeU32(v uint32) []byte { return binaryutil.NativeEndian.PutUint32(v) }

// Expose makes the VM vmUID of n, attached at ip, reachable at e's endpoint address on e's
// ports and nothing else; an empty e.Ports removes its exposure. It needs the VM attached.
func (h *Host) Expose(n Network, vmUID string, ip netip.Addr, e Exposure) error {
	if len(e.Ports) == 0 {
		return h.Unexpose(vmUID)
	}
	if !e.Endpoint.Is4() || n.Prefix.Contains(e.Endpoint) {
		return fmt.Errorf("endpoint address %s: want an IPv4 address outside the network %s", e.Endpoint, n.Prefix)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	s, err := h.plumbed(n)
	if err != nil {
		return err
	}
	// A route of someone else's (the CNI's pod ranges, the node's own subnets) that holds the
	// address wins: a /32 of IMP's would take its traffic.
	if err := h.foreignRoute(netip.PrefixFrom(e.Endpoint, 32)); err != nil {
		return err
	}
	// Another network's endpoint address is never taken over: a route to it elsewhere stays,
	// and so do this VM's rules.
	cur, err := h.endpointRoute(e.Endpoint)
	if err != nil {
		return err
	}
	if cur != nil {
		if l, err := h.nl.LinkByName(egressPrefix + s.id); err != nil || l.Attrs().Index != cur.LinkIndex {
			return fmt.Errorf("endpoint address %s is routed to another network's link", e.Endpoint)
		}
	}
	// A VM whose address changed (its record lost): its old address goes first.
	exposed, err := s.exposures()
	if err != nil {
		return err
	}
	if prev := exposed[shortID(vmUID)]; prev.IsValid() && prev != e.Endpoint {
		if err := h.unexposeIn(s, shortID(vmUID)); err != nil {
			return err
		}
	}
	if err := s.replaceRules([]*nftables.Chain{dnatChain}, exposeOwner(shortID(vmUID)), exposeRules(uplinkPrefix+s.id, ip, e)); err != nil {
		return fmt.Errorf("exposing VM %s: %w", vmUID, err)
	}
	// The transit link, for a closed network too, and the routes of its exposed VMs: this
	// one's among them.
	if err := h.ensureNetwork(s, n, false); err != nil {
		return err
	}
	h.createNodeTables()
	if err := h.nft.SetAddElements(endpointsSet, []nftables.SetElement{{Key: e.Endpoint.AsSlice()}}); err != nil {
		return err
	}
	if err := h.nft.Flush(); err != nil {
		return fmt.Errorf("admitting replies from endpoint address %s: %w", e.Endpoint, err)
	}
	return nil
}

// routeEndpoints routes each endpoint address exposed in s to s's transit link: a link made
// anew (its pair lost) has none of the routes the one before had.
func (h *Host) routeEndpoints(s *space, n Network, exposed map[string]netip.Addr) error {
	if len(exposed) == 0 {
		return nil
	}
	l, err := h.nl.LinkByName(egressPrefix + s.id)
	if err != nil {
		return fmt.Errorf("the transit link of %s: %w", n.Key(), err)
	}
	t, err := h.transitAddr(l.Attrs().Index)
	if err != nil {
		return err
	}
	for _, a := range exposed {
		route := &netlink.Route{LinkIndex: l.Attrs().Index, Dst: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(32, 32)},
			Gw: t.AsSlice(), Protocol: rtprotEndpoint}
		if err := h.nl.RouteReplace(route); err != nil {
			return fmt.Errorf("routing endpoint address %s to %s: %w", a, n.Key(), err)
		}
	}
	return nil
}

// exposures are the VMs exposed in s (by short id) and their endpoint addresses, read from
// the DNAT rules' comments and destinations. A chain not made yet exposes nothing; a chain that
// could not be read is an error, never "nothing": what is removed on that answer (a closed
// network's transit link, and with it every endpoint's route) would stay removed.
func (s *space) exposures() (map[string]netip.Addr, error) {
	out := map[string]netip.Addr{}
	rs, err := getRules(s.nft, dnatChain)
	if errors.Is(err, unix.ENOENT) {
		return out, nil // no such chain yet: nothing exposed
	}
	if err != nil {
		return nil, fmt.Errorf("reading the exposed VMs: %w", err)
	}
	for _, r := range rs {
		rest, ok := strings.CutPrefix(comment(r), "imp:exp-")
		if !ok {
			continue
		}
		id, _, _ := strings.Cut(rest, ":")
		out[id] = endpointOf(r)
	}
	return out, nil
}

// foreignRoute fails when a route of the node's that IMP did not make (neither a transit, an
// endpoint nor a block route; the default route aside) overlaps p: the endpoint range collides
// with a range the node uses.
func (h *Host) foreignRoute(p netip.Prefix) error {
	rs, err := h.nl.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("listing the node's routes: %w", err)
	}
	for _, r := range rs {
		if r.Dst == nil || r.Protocol == rtprotIMP || r.Protocol == rtprotEndpoint || r.Protocol == rtprotBlock {
			continue
		}
		ones, _ := r.Dst.Mask.Size()
		a, ok := netip.AddrFromSlice(r.Dst.IP.To4())
		if !ok || ones == 0 {
			continue
		}
		if q := netip.PrefixFrom(a, ones); q.Overlaps(p) {
			return fmt.Errorf("endpoint range %s overlaps the node's route to %s: set network.endpointCIDR to a range the cluster does not use", p, q)
		}
	}
	return nil
}

// endpointRoute is the node's route to endpoint address a, if any.
func (h *Host) endpointRoute(a netip.Addr) (*netlink.Route, error) {
	rs, err := h.nl.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Protocol: rtprotEndpoint}, netlink.RT_FILTER_PROTOCOL)
	if err != nil {
		return nil, fmt.Errorf("listing endpoint routes: %w", err)
	}
	for i := range rs {
		if rs[i].Dst != nil && rs[i].Dst.IP.Equal(a.AsSlice()) {
			return &rs[i], nil
		}
	}
	return nil, nil
}

// Unexpose removes the VM's exposure: its rules in its network's namespace and the node's
// route to its endpoint address.
func (h *Host) Unexpose(vmUID string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.unexpose(vmUID)
}

func (h *Host) unexpose(vmUID string) error {
	spaces, err := h.openSpaces()
	if err != nil {
		return err
	}
	for _, s := range spaces {
		if err := h.unexposeIn(s, shortID(vmUID)); err != nil {
			return fmt.Errorf("removing the exposure of VM %s: %w", vmUID, err)
		}
	}
	return nil
}

// unexposeIn removes the exposure of the VM with short id from s, and the node's route to
// its endpoint address when it leads to s.
func (h *Host) unexposeIn(s *space, id string) error {
	exposed, err := s.exposures()
	if err != nil {
		return err
	}
	a, ok := exposed[id]
	if !ok {
		return nil
	}
	owner := exposeOwner(id)
	if err := s.replaceRules([]*nftables.Chain{dnatChain}, owner, nil); err != nil {
		return err
	}
	if l, err := h.nl.LinkByName(egressPrefix + s.id); err == nil { // no transit link: no route either
		if r, err := h.endpointRoute(a); err == nil && r != nil && r.LinkIndex == l.Attrs().Index {
			if err := h.nl.RouteDel(r); err != nil {
				return fmt.Errorf("removing the route to endpoint address %s: %w", a, err)
			}
		}
	}
	if err := h.nft.SetDeleteElements(endpointsSet, []nftables.SetElement{{Key: a.AsSlice()}}); err == nil {
		_ = h.nft.Flush() // an element already gone: nothing to do
	}
	return nil
}

// pruneExposures removes the exposures of s's VMs whose tap is gone.
func (h *Host) pruneExposures(s *space) error {
	exposed, err := s.exposures()
	if err != nil {
		return err
	}
	var errs []error
	for id := range exposed {
		if _, err := s.nl.LinkByName(tapPrefix + id); isNotFound(err) {
			errs = append(errs, h.unexposeIn(s, id))
		}
	}
	return errors.Join(errs...)
}

// endpointOf reads the endpoint address a DNAT rule matches (its destination comparison).
func endpointOf(r *nftables.Rule) netip.Addr {
	for i, e := range r.Exprs {
		p, ok := e.(*expr.Payload)
		if !ok || p.Base != expr.PayloadBaseNetworkHeader || p.Offset != 16 || i+1 >= len(r.Exprs) {
			continue
		}
		if c, ok := r.Exprs[i+1].(*expr.Cmp); ok && len(c.Data) == 4 {
			return netip.AddrFrom4([4]byte(c.Data))
		}
	}
	return netip.Addr{}
}

// rtprotBlock marks the node's routes to other nodes' endpoint blocks.
const rtprotBlock netlink.RouteProtocol = 0x4b

// SyncBlocks makes the node's routes to other nodes' endpoint blocks exactly blocks (each
// block via that node's address, as a CNI routes other nodes' pod CIDRs), so that the node and
// its pods reach VMs of every node. It returns the blocks it could not route (their node not
// on a directly reachable network), with why.
func (h *Host) SyncBlocks(blocks map[netip.Prefix]netip.Addr) (map[netip.Prefix]error, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	have, err := h.nl.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Protocol: rtprotBlock}, netlink.RT_FILTER_PROTOCOL)
	if err != nil {
		return nil, fmt.Errorf("listing endpoint block routes: %w", err)
	}
	for i := range have {
		r := &have[i]
		if r.Dst == nil {
			continue
		}
		ones, _ := r.Dst.Mask.Size()
		p := netip.PrefixFrom(netip.AddrFrom4([4]byte(r.Dst.IP.To4())), ones)
		via, ok := blocks[p]
		if ok && r.Gw != nil && r.Gw.Equal(via.AsSlice()) {
			continue
		}
		if err := h.nl.RouteDel(r); err != nil {
			return nil, fmt.Errorf("removing the route to endpoint block %s: %w", p, err)
		}
	}
	failed := map[netip.Prefix]error{}
	for p, via := range blocks {
		if err := h.foreignRoute(p); err != nil {
			failed[p] = err
			continue
		}
		r := &netlink.Route{Dst: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), 32)}, Gw: via.AsSlice(), Protocol: rtprotBlock}
		if err := h.nl.RouteReplace(r); err != nil {
			failed[p] = fmt.Errorf("routing endpoint block %s via %s: %w", p, via, err)
		}
	}
	return failed, nil
}
