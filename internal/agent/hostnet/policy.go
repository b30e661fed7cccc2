package hostnet

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	mnl "github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// NetworkPolicy on a VM is enforced in its network's namespace, at the forward hook, where
// every path into and out of a VM passes: frames bridged between VMs of the network (local
// taps and the overlay; br_netfilter shows them to the IP hooks, turned on in every network's
// namespace), connections from the transit link to the VM (pods, the node, anything the node
// routes to its endpoint address, after the DNAT and before the source becomes the gateway),
// and the VM's NAT egress. The first packet of each connection (conntrack's new) is looked up
// by its destination in the map polin and by its source in polout; a VM that policies isolate
// has an entry there jumping to its chain, ing-<id> or egr-<id>, which returns what some rule
// allows and drops the rest. Nothing of this ever accepts: what passes still meets the
// network's and the node's rules (anti-spoofing before, egress and the node's drops after).
// Replies, and packets of connections already allowed, are not looked at again.

var (
	// polInMap and polOutMap send a new connection to the chain of the VM it goes to (by
	// destination address) and of the VM it comes from (by source address).
	polInMap  = &nftables.Set{Table: inetTable, Name: "polin", IsMap: true, KeyType: nftables.TypeIPAddr, DataType: nftables.TypeVerdict}
	polOutMap = &nftables.Set{Table: inetTable, Name: "polout", IsMap: true, KeyType: nftables.TypeIPAddr, DataType: nftables.TypeVerdict}
)

// Policy is what the NetworkPolicies that select a VM let reach it (Ingress) and leave it
// (Egress). A nil side is not isolated: everything passes, as for a pod no policy selects.
// An empty, non-nil side allows nothing.
type Policy struct {
	Ingress, Egress []Allow
}

// Allow is one thing a policy allows: peers, on each side of the network's namespace, and
// ports.
type Allow struct {
	// Network are peers on the network's own segment: its VMs, here and on other nodes.
	Network []netip.Prefix
	// Outside are peers beyond the network's transit link: pods, nodes, anything routed.
	Outside []netip.Prefix
	// Ports, when empty, is every protocol and port.
	Ports []PortRange
}

// polSide is one direction of a VM's policy: its chain, its map, and how a packet names the
// peer (the source coming in, the destination going out).
type polSide struct {
	word   string // "ing" or "egr"
	m      *nftables.Set
	peerAt uint32 // the peer's address in the IPv4 header: 12 (source) or 16 (destination)
	peer   string // "saddr" or "daddr"
}

var (
	ingress = polSide{"ing", polInMap, 12, "saddr"}
	egress  = polSide{"egr", polOutMap, 16, "daddr"}
)

// polPreChain looks a VM's new connections up in polout as they arrive from its tap, before
// any DNAT of the network's namespace (the domain egress proxy's redirect): a VM's egress is
// checked against the destination it named.
var polPreChain = &nftables.Chain{Name: "polpre", Table: inetTable, Type: nftables.ChainTypeFilter,
	Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRef(-150), Policy: &accept}

// polPath tells the two sides of the network's namespace a peer can be on: on the network's
// segment (its VMs) or beyond its transit link. Coming in, the input device says it; going out,
// before routing, the destination does (the network's prefix is its segment).
type polPath struct {
	segment bool
	text    string
	exprs   func() []expr.Any
}

func ingressPaths(br, up string) (seg, out polPath) {
	return polPath{true, fmt.Sprintf("iifname %q", br), func() []expr.Any { return ifname(expr.MetaKeyIIFNAME, br, true) }},
		polPath{false, fmt.Sprintf("iifname %q", up), func() []expr.Any { return ifname(expr.MetaKeyIIFNAME, up, true) }}
}

func egressPaths(p netip.Prefix) (seg, out polPath) {
	p = p.Masked()
	return polPath{true, fmt.Sprintf("ip daddr %s", p), func() []expr.Any { return prefixCmp(16, p, expr.CmpOpEq) }},
		polPath{false, fmt.Sprintf("ip daddr != %s", p), func() []expr.Any { return prefixCmp(16, p, expr.CmpOpNeq) }}
}

func (p polSide) chain(id string) *nftables.Chain {
	return &nftables.Chain{Name: p.word + "-" + id, Table: inetTable}
}

// policyDispatch sends a new connection out of the bridge to the chain of the VM it is from
// (in prerouting, before any DNAT), and one into the bridge to the chain of the VM it is for
// (the forward chain's first rule, after the DNAT to a VM). The maps are keyed by the VM's
// address, which only a local VM of the network has: a packet coming in over the transit link
// is never taken for a VM's own.
func policyDispatch(br string) []rule {
	vmap := func(dev expr.MetaKey, at uint32, m *nftables.Set) []expr.Any {
		return cat(ifname(dev, br, true), ctNewOrInvalid(), ipv4(), []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: at, Len: 4},
			&expr.Lookup{SourceRegister: 1, DestRegister: 0, IsDestRegSet: true, SetName: m.Name},
		})
	}
	return []rule{
		{polPreChain, fmt.Sprintf("iifname %q ct state new,invalid ip saddr vmap @polout", br), vmap(expr.MetaKeyIIFNAME, 12, polOutMap)},
		{spaceForward, fmt.Sprintf("oifname %q ct state new,invalid ip daddr vmap @polin", br), vmap(expr.MetaKeyOIFNAME, 16, polInMap)},
	}
}

// ctNewOrInvalid matches a connection's first packet, and packets conntrack calls invalid
// (no connection of theirs, such as a lone FIN): those would otherwise pass as bridged frames
// without any policy seeing them.
func ctNewOrInvalid() []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: nativeU32(expr.CtStateBitNEW | expr.CtStateBitINVALID), Xor: nativeU32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: nativeU32(0)},
	}
}

// polGroup is the peers of one side of the namespace that a VM's policy allows on one port
// range (or on every port): one set and one rule.
type polGroup struct {
	path  polPath
	ports *PortRange
	peers []netip.Prefix
}

func (g polGroup) key() string {
	if g.ports == nil {
		return g.path.text + " all"
	}
	return fmt.Sprintf("%s %d %d-%d", g.path.text, g.ports.Protocol, g.ports.From, g.ports.To)
}

// polGroups gathers allows into groups, one per side and port range, their peers merged.
func polGroups(seg, out polPath, allows []Allow) []polGroup {
	by := map[string]*polGroup{}
	add := func(path polPath, ports *PortRange, peers []netip.Prefix) {
		if len(peers) == 0 {
			return
		}
		g := polGroup{path: path, ports: ports}
		if have := by[g.key()]; have != nil {
			have.peers = append(have.peers, peers...)
			return
		}
		g.peers = slices.Clone(peers)
		by[g.key()] = &g
	}
	for _, a := range allows {
		if len(a.Ports) == 0 {
			add(seg, nil, a.Network)
			add(out, nil, a.Outside)
			continue
		}
		for i := range a.Ports {
			p := a.Ports[i]
			add(seg, &p, a.Network)
			add(out, &p, a.Outside)
		}
	}
	groups := make([]polGroup, 0, len(by))
	for _, g := range by {
		groups = append(groups, *g)
	}
	slices.SortFunc(groups, func(a, b polGroup) int { return strings.Compare(a.key(), b.key()) })
	return groups
}

// polSet is one of a VM's sets: its name and its address ranges, merged.
type polSet struct {
	name   string
	ranges [][2]uint32 // first and last address, inclusive, ascending and apart
}

// policyRules are the chain of one side of a VM's policy and the sets its rules look up: per
// group, the peers' addresses (and the port range) return; everything else is counted and
// dropped.
func policyRules(side polSide, id string, seg, out polPath, allows []Allow) ([]rule, []polSet) {
	c := side.chain(id)
	var rs []rule
	var sets []polSet
	for i, g := range polGroups(seg, out, allows) {
		s := polSet{name: fmt.Sprintf("%s-%s-%d", side.word, id, i), ranges: mergeRanges(g.peers)}
		sets = append(sets, s)
		text := fmt.Sprintf("%s ip %s @%s", g.path.text, side.peer, s.name)
		e := cat(g.path.exprs(), []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: side.peerAt, Len: 4},
			&expr.Lookup{SourceRegister: 1, SetName: s.name},
		})
		if g.ports != nil {
			text += fmt.Sprintf(" meta l4proto %d th dport %d-%d", g.ports.Protocol, g.ports.From, g.ports.To)
			e = cat(e, l4proto(g.ports.Protocol), dportRange(g.ports.From, g.ports.To))
		}
		rs = append(rs, rule{c, text + " return", cat(e, verdict(expr.VerdictReturn))})
	}
	rs = append(rs, rule{c, "counter drop", drop()})
	return rs, sets
}

// mergeRanges turns prefixes into ascending address ranges that neither overlap nor touch.
func mergeRanges(ps []netip.Prefix) [][2]uint32 {
	var rs [][2]uint32
	for _, p := range ps {
		if !p.Addr().Is4() {
			continue
		}
		p = p.Masked()
		a := p.Addr().As4()
		first := binary.BigEndian.Uint32(a[:])
		last := first | uint32(uint64(1)<<(32-p.Bits())-1)
		rs = append(rs, [2]uint32{first, last})
	}
	slices.SortFunc(rs, func(a, b [2]uint32) int { return cmp.Compare(a[0], b[0]) })
	var out [][2]uint32
	for _, r := range rs {
		if n := len(out); n > 0 && uint64(r[0]) <= uint64(out[n-1][1])+1 {
			out[n-1][1] = max(out[n-1][1], r[1])
			continue
		}
		out = append(out, r)
	}
	return out
}

// elements are s's ranges as an interval set's elements: each range's first address, and the
// address after its last as the interval's end (none after 255.255.255.255).
func (s polSet) elements() []nftables.SetElement {
	var es []nftables.SetElement
	for _, r := range s.ranges {
		es = append(es, nftables.SetElement{Key: binary.BigEndian.AppendUint32(nil, r[0])})
		if r[1] != ^uint32(0) {
			es = append(es, nftables.SetElement{Key: binary.BigEndian.AppendUint32(nil, r[1]+1), IntervalEnd: true})
		}
	}
	return es
}

func (s polSet) set() *nftables.Set {
	return &nftables.Set{Table: inetTable, Name: s.name, KeyType: nftables.TypeIPAddr, Interval: true}
}

// policyTag is the comment of a side's rules: a hash of the rules and of their sets' contents,
// so that a chain already right (peers included) is left alone.
func policyTag(id string, rs []rule, sets []polSet) string {
	sum := sha256.New()
	for _, r := range rs {
		fmt.Fprintln(sum, r.chain.Name, r.text)
	}
	for _, s := range sets {
		fmt.Fprintln(sum, s.name, s.ranges)
	}
	return "imp:pol-" + id + ":" + hex.EncodeToString(sum.Sum(nil))[:12]
}

// SetPolicy makes the VM vmUID of n, attached at ip, subject to p: what NetworkPolicies let
// reach it and leave it. A side already as p says is left alone; one that is not is replaced,
// chain, sets and map entry, in one atomic batch. It needs the VM attached.
func (h *Host) SetPolicy(n Network, vmUID string, ip netip.Addr, p Policy) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	s, err := h.plumbed(n)
	if err != nil {
		return err
	}
	if !n.Prefix.Contains(ip) {
		return fmt.Errorf("address %s is not of network %s", ip, n.Key())
	}
	if p.Ingress != nil || p.Egress != nil {
		if err := s.bridgeToIP(); err != nil {
			return err
		}
	}
	id := shortID(vmUID)
	for _, side := range []struct {
		polSide
		allows []Allow
	}{{ingress, p.Ingress}, {egress, p.Egress}} {
		if side.allows == nil {
			if err := s.removePolicySide(side.polSide, id); err != nil {
				return err
			}
			continue
		}
		seg, out := ingressPaths(bridgePrefix+s.id, uplinkPrefix+s.id)
		if side.word == egress.word {
			seg, out = egressPaths(n.Prefix)
		}
		if err := s.setPolicySide(side.polSide, id, seg, out, ip, side.allows); err != nil {
			return fmt.Errorf("policy of VM %s: %w", vmUID, err)
		}
	}
	return nil
}

// setPolicySide makes side's chain of the VM with id, its sets and its map entry those of
// allows, in one batch, unless they already are.
func (s *space) setPolicySide(side polSide, id string, seg, out polPath, ip netip.Addr, allows []Allow) error {
	c := side.chain(id)
	rs, sets := policyRules(side, id, seg, out, allows)
	t := policyTag(id, rs, sets)
	have, err := getRules(s.nft, c)
	if err != nil {
		have = nil // no chain yet
	}
	entries := s.mapEntries(side.m)
	if len(have) == len(rs) && slices.IndexFunc(have, func(r *nftables.Rule) bool { return comment(r) != t }) < 0 &&
		entries[ip] == c.Name {
		return nil
	}
	s.createTables()
	s.nft.AddChain(c)
	s.nft.FlushChain(c)
	for _, old := range setsOf(have) {
		s.nft.DelSet(&nftables.Set{Table: inetTable, Name: old})
	}
	for _, ps := range sets {
		if err := s.nft.AddSet(ps.set(), ps.elements()); err != nil {
			return fmt.Errorf("set %s: %w", ps.name, err)
		}
	}
	for _, r := range rs {
		s.nft.AddRule(&nftables.Rule{Table: inetTable, Chain: c, Exprs: r.exprs, UserData: userdata.AppendString(nil, userdata.TypeComment, t)})
	}
	key := ip.As4()
	el := []nftables.SetElement{{Key: key[:], VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: c.Name}}}
	// The map's entries go first, in the batch: those for the chain under another address (a
	// warm member's, readdressed to its claim's), and the one of this address for another
	// chain (a VM gone whose address this one took). Deleting an absent element fails the
	// batch, so only what is there goes.
	if err := s.unmapChain(side.m, c, entries); err != nil {
		return err
	}
	if cur := entries[ip]; cur != "" && cur != c.Name {
		if err := s.nft.SetDeleteElements(side.m, []nftables.SetElement{{Key: key[:], VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: cur}}}); err != nil {
			return err
		}
	}
	if err := s.nft.SetAddElements(side.m, el); err != nil {
		return err
	}
	if err := s.nft.Flush(); err != nil {
		return fmt.Errorf("replacing the %s policy: %w", side.word, err)
	}
	return nil
}

// setsOf are the sets rules look up.
func setsOf(rs []*nftables.Rule) []string {
	var out []string
	for _, r := range rs {
		for _, e := range r.Exprs {
			if l, ok := e.(*expr.Lookup); ok && l.SetName != "" && !slices.Contains(out, l.SetName) {
				out = append(out, l.SetName)
			}
		}
	}
	return out
}

// mapEntries are the chains m sends each address to, read in one dump (none when there is no
// map yet).
func (s *space) mapEntries(m *nftables.Set) map[netip.Addr]string {
	out := map[netip.Addr]string{}
	es, err := s.nft.GetSetElements(m)
	if err != nil {
		return out
	}
	for _, e := range es {
		if a, ok := netip.AddrFromSlice(e.Key); ok {
			out[a] = verdictChain(e.Val)
		}
	}
	return out
}

// verdictChain is the chain a map element's verdict jumps to, read from its data as the
// kernel gives it (the library keeps a verdict's attributes undecoded in Val).
func verdictChain(val []byte) string {
	ad, err := mnl.NewAttributeDecoder(val)
	if err != nil {
		return ""
	}
	for ad.Next() {
		if ad.Type() == unix.NFTA_VERDICT_CHAIN {
			return ad.String()
		}
	}
	return ""
}

// removePolicySide removes side's chain of the VM with id, its sets, and the map's entries
// that jump to it.
func (s *space) removePolicySide(side polSide, id string) error {
	c := side.chain(id)
	if _, err := s.nft.ListChain(c.Table, c.Name); err != nil {
		return nil // no such chain: nothing to remove
	}
	have, err := getRules(s.nft, c)
	if err != nil {
		return err
	}
	if err := s.unmapChain(side.m, c, s.mapEntries(side.m)); err != nil {
		return err
	}
	s.nft.FlushChain(c)
	for _, old := range setsOf(have) {
		s.nft.DelSet(&nftables.Set{Table: inetTable, Name: old})
	}
	s.nft.DelChain(c)
	if err := s.nft.Flush(); err != nil {
		return fmt.Errorf("removing the %s policy of %s: %w", side.word, id, err)
	}
	return nil
}

// unmapChain adds to the batch the removal of m's entries (as entries read them) that jump
// to c.
func (s *space) unmapChain(m *nftables.Set, c *nftables.Chain, entries map[netip.Addr]string) error {
	var gone []nftables.SetElement
	for a, chain := range entries {
		if chain == c.Name {
			key := a.As4()
			gone = append(gone, nftables.SetElement{Key: key[:], VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: c.Name}})
		}
	}
	if len(gone) == 0 {
		return nil
	}
	return s.nft.SetDeleteElements(m, gone)
}

// removePolicy removes both sides of the policy of the VM with id.
func (s *space) removePolicy(id string) error {
	return errors.Join(s.removePolicySide(ingress, id), s.removePolicySide(egress, id))
}

// prunePolicies removes the policies of VMs whose tap is gone.
func (s *space) prunePolicies() error {
	chains, err := s.nft.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return fmt.Errorf("listing chains of %s: %w", s.path, err)
	}
	var errs []error
	for _, c := range chains {
		if c.Table.Name != inetTable.Name {
			continue
		}
		for _, side := range []polSide{ingress, egress} {
			if id, ok := strings.CutPrefix(c.Name, side.word+"-"); ok {
				if _, err := s.nl.LinkByName(tapPrefix + id); isNotFound(err) {
					errs = append(errs, s.removePolicySide(side, id))
				}
			}
		}
	}
	return errors.Join(errs...)
}

// forgetFlows removes the namespace's connections of address ip, as the VM that held it lets
// it go (its tap removed, or a warm member readdressed): they would otherwise carry on for the
// address's next VM past the policies, which look only at a connection's first packet. A VM
// suspended and resumed keeps its tap, and its connections (held ones included).
func (s *space) forgetFlows(ip netip.Addr) error {
	var filters []netlink.CustomConntrackFilter
	for _, tp := range []netlink.ConntrackFilterType{netlink.ConntrackOrigSrcIP, netlink.ConntrackOrigDstIP, netlink.ConntrackReplyAnyIP} {
		f := &netlink.ConntrackFilter{}
		if err := f.AddIP(tp, ip.AsSlice()); err != nil {
			return err
		}
		filters = append(filters, f)
	}
	if _, err := s.nl.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, filters...); err != nil {
		return fmt.Errorf("forgetting the connections of %s: %w", ip, err)
	}
	return nil
}

// tapAddr is the address tap's anti-spoofing rules hold, if any.
func (s *space) tapAddr(tap string) netip.Addr {
	rs, err := getRules(s.nft, tapChain(tap))
	if err != nil {
		return netip.Addr{}
	}
	for _, r := range rs {
		for i, e := range r.Exprs {
			p, ok := e.(*expr.Payload)
			if !ok || p.Base != expr.PayloadBaseNetworkHeader || p.Offset != 12 || p.Len != 4 || i+1 >= len(r.Exprs) {
				continue
			}
			if c, ok := r.Exprs[i+1].(*expr.Cmp); ok && len(c.Data) == 4 {
				return netip.AddrFrom4([4]byte(c.Data))
			}
		}
	}
	return netip.Addr{}
}

// errNoBridgeNetfilter: the kernel does not show bridged frames to the IP hooks, so no
// policy between VMs of a network could be enforced.
var errNoBridgeNetfilter = errors.New("the kernel does not pass bridged frames through nftables' IP hooks (br_netfilter): NetworkPolicy between VMs of a network cannot be enforced; load the br_netfilter module")

// bridgeToIP has the namespace show bridged frames to the IP hooks (br_netfilter's
// bridge-nf-call-iptables, per namespace), where policy is enforced.
func (s *space) bridgeToIP() error {
	if s.brnf {
		return nil
	}
	err := runIn(s.ns, func() error {
		const knob = "/proc/sys/net/bridge/bridge-nf-call-iptables"
		if err := os.WriteFile(knob, []byte("1"), 0o644); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return errNoBridgeNetfilter
			}
			return fmt.Errorf("setting %s: %w", knob, err)
		}
		return nil
	})
	s.brnf = err == nil
	return err
}
