package hostnet

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"golang.org/x/sys/unix"
)

// IMP's nftables, in tables of its own and never anyone else's.
//
// In the node's namespace:
//
//	table inet imp   chain input       nothing from a network's transit link; VXLAN only from peers
//	                 chain forward     egress never to another network, link-local or denied CIDRs
//	                 chain postrouting masquerade of the transit addresses to the node's
//	                 set vxlan-peers   (peer node address . VNI) that may send the overlay's packets
//	                 set vxlan-vms     (peer node address . VNI . VM address): the sources their
//	                                   frames may carry, the VMs placed on them
//
// In each network's namespace, which IMP owns whole (input and forward drop by default):
//
//	table inet imp   chain input       the gateway answers ICMP, and replies; nothing else
//	                 chain forward     bridged frames; egress to the transit link with NAT; replies;
//	                                   first, a new connection to a VM to its policy (map polin)
//	                 chain polpre      a VM's new connection to its policy (map polout), before DNAT
//	                 chain postrouting masquerade to the network's transit address
//	table bridge imp chain prerouting  each tap to its own chain (map taps), other taps dropped
//	                 chain tap-<tap>   anti-spoofing of one tap; counts what passed (its VM's traffic out)
//	                 chain postrouting keeps each node's gateway off the overlay; each tap's frames
//	                                   to its in- chain (map tapsin)
//	                 chain in-<tap>    counts the frames delivered to the tap's VM (its MAC)
//
// Every rule carries a comment "imp:<owner>:<hash>": what it belongs to (the node, the network,
// a tap) and a hash of that owner's whole rule set, so a set that is already right is left
// untouched and one that is not is replaced in a single atomic batch.
var (
	inetTable   = &nftables.Table{Family: nftables.TableFamilyINet, Name: "imp"}
	bridgeTable = &nftables.Table{Family: nftables.TableFamilyBridge, Name: "imp"}
	accept      = nftables.ChainPolicyAccept
	dropPolicy  = nftables.ChainPolicyDrop

	nodeInput = &nftables.Chain{Name: "input", Table: inetTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &accept}
	nodeForward = &nftables.Chain{Name: "forward", Table: inetTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accept}
	natChain = &nftables.Chain{Name: "postrouting", Table: inetTable, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource, Policy: &accept}
	// nodeChains are the node's; legacyChains those an agent of the earlier layout left there.
	nodeChains   = []*nftables.Chain{nodeInput, nodeForward, natChain}
	legacyChains = []*nftables.Chain{nodeForward, natChain, brPreChain, brPostChain}

	spaceInput = &nftables.Chain{Name: "input", Table: inetTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &dropPolicy}
	spaceForward = &nftables.Chain{Name: "forward", Table: inetTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &dropPolicy}
	brPreChain = &nftables.Chain{Name: "prerouting", Table: bridgeTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRef(-200), Policy: &accept}
	brPostChain = &nftables.Chain{Name: "postrouting", Table: bridgeTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityFilter, Policy: &accept}
	spaceChains = []*nftables.Chain{spaceInput, spaceForward, natChain, dnatChain, brPreChain, brPostChain, polPreChain}

	// tapsMap sends each tap's frames to its chain.
	tapsMap = &nftables.Set{Table: bridgeTable, Name: "taps", IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
	// tapsInMap sends the frames leaving the bridge through each tap (to its VM) to the tap's
	// in- chain, which counts those for the VM's MAC (TapCounters).
	tapsInMap = &nftables.Set{Table: bridgeTable, Name: "tapsin", IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
)

// linkLocal is where cloud metadata services answer; egress never reaches it.
var linkLocal = netip.MustParsePrefix("169.254.0.0/16")

// rule is one rule: where, what (in nft's syntax, for the hash and for people), how.
type rule struct {
	chain *nftables.Chain
	text  string
	exprs []expr.Any
}

// networkRules are the rules of the namespace of n, whose id is id: the gateway answers ICMP only; frames bridged
// within the network pass; with NAT, traffic leaves over the transit link masqueraded, and only
// replies come back; with the overlay, the gateway (the same address and MAC on every node)
// stays off the VXLAN device. Each tap goes to its own chain, and a tap without one carries
// nothing.
func networkRules(id string, n Network, overlay bool) []rule {
	br, vx, up := bridgePrefix+id, vxlanPrefix+id, uplinkPrefix+id
	rs := []rule{
		{spaceInput, "ct state established,related accept", cat(ctEstablished(), verdict(expr.VerdictAccept))},
		{spaceInput, `iifname "lo" accept`, cat(ifname(expr.MetaKeyIIFNAME, "lo", true), verdict(expr.VerdictAccept))},
		{spaceInput, fmt.Sprintf("iifname %q meta l4proto icmp accept", br),
			cat(ifname(expr.MetaKeyIIFNAME, br, true), l4proto(unix.IPPROTO_ICMP), verdict(expr.VerdictAccept))},
	}
	if n.NAT && n.Egress.Proxy {
		rs = append(rs, proxyInput(br))
		rs = append(rs, proxyRules(br, n)...)
	}
	rs = append(rs, rule{spaceInput, "counter drop", drop()})
	rs = append(rs, policyDispatch(br)...)
	rs = append(rs, []rule{
		// Frames bridged within the network, locally or over the overlay, pass the forward
		// hook too where br_netfilter is on: in and out are the bridge itself.
		{spaceForward, fmt.Sprintf("iifname %q oifname %q accept", br, br),
			cat(ifname(expr.MetaKeyIIFNAME, br, true), ifname(expr.MetaKeyOIFNAME, br, true), verdict(expr.VerdictAccept))},
		{spaceForward, fmt.Sprintf("oifname %q ct state established,related accept", br),
			cat(ifname(expr.MetaKeyOIFNAME, br, true), ctEstablished(), verdict(expr.VerdictAccept))},
	}...)
	rs = append(rs, exposedRules(br, up)...) // before egress: replies to any client pass
	if n.NAT {
		rs = append(rs, egressRules(br, up, n.Egress)...)
		rs = append(rs, rule{natChain, fmt.Sprintf("oifname %q counter masquerade", up),
			cat(ifname(expr.MetaKeyOIFNAME, up, true), []expr.Any{&expr.Counter{}, &expr.Masq{}})})
	}
	rs = append(rs,
		rule{spaceForward, "counter drop", drop()},
		rule{brPreChain, "iifname vmap @taps", []expr.Any{
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
			&expr.Lookup{SourceRegister: 1, DestRegister: 0, IsDestRegSet: true, SetName: tapsMap.Name},
		}},
		rule{brPreChain, fmt.Sprintf("iifname \"%s*\" counter drop", tapPrefix), cat(ifname(expr.MetaKeyIIFNAME, tapPrefix, false), drop())},
	)
	if overlay {
		gw := n.Gateway.As4()
		rs = append(rs,
			rule{brPostChain, fmt.Sprintf("oifname %q ether saddr %s drop", vx, MAC(n.Gateway)),
				cat(ifname(expr.MetaKeyOIFNAME, vx, true), payload(expr.PayloadBaseLLHeader, 6, MAC(n.Gateway), expr.CmpOpEq), drop())},
			rule{brPostChain, fmt.Sprintf("oifname %q arp daddr ip %s drop", vx, n.Gateway),
				cat(ifname(expr.MetaKeyOIFNAME, vx, true), etherType(unix.ETH_P_ARP), payload(expr.PayloadBaseNetworkHeader, 24, gw[:], expr.CmpOpEq), drop())},
		)
	}
	return append(rs, rule{brPostChain, "oifname vmap @tapsin", []expr.Any{
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Lookup{SourceRegister: 1, DestRegister: 0, IsDestRegSet: true, SetName: tapsInMap.Name},
	}})
}

// nodeRules are the node's: nothing arriving over a transit link reaches the node; egress
// reaches neither another network, nor link-local addresses, nor the denied CIDRs, nor any
// overlay port (IMP's and the usual CNIs': a node's address is what their peers trust); transit
// addresses leave masqueraded to the node's. With an overlay, the VXLAN port takes packets
// only from the nodes of each network (set vxlan-peers), and from each only frames of the VMs
// placed on it (set vxlan-vms): a compromised node sends as no other node's VM.
func (h *Host) nodeRules() []rule {
	from := func() []expr.Any { return ifname(expr.MetaKeyIIFNAME, egressPrefix, false) }
	egress := fmt.Sprintf("iifname \"%s*\"", egressPrefix)
	rs := []rule{
		// Replies, and only replies, to connections the node or its pods made to a VM's
		// endpoint address: established, in the reply direction, from an address of the
		// endpoints set. Nothing a guest forges (an ICMP error "related" to a node's
		// connection, a packet from another source) passes before the drops below.
		{nodeInput, egress + " ct state established ct direction reply ip saddr @endpoints accept", endpointReplies(from())},
		{nodeInput, egress + " counter drop", cat(from(), drop())},
		{nodeForward, egress + " ct state established ct direction reply ip saddr @endpoints accept", endpointReplies(from())},
		{nodeForward, egress + fmt.Sprintf(" oifname \"%s*\" counter drop", egressPrefix),
			cat(from(), ifname(expr.MetaKeyOIFNAME, egressPrefix, false), drop())},
		{nodeForward, egress + " meta nfproto != ipv4 counter drop",
			cat(from(), []expr.Any{&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}}}, drop())},
	}
	for _, p := range append([]netip.Prefix{linkLocal}, h.opts.DeniedEgress...) {
		p = p.Masked()
		rs = append(rs, rule{nodeForward, fmt.Sprintf("%s ip daddr %s counter drop", egress, p), cat(from(), prefixCmp(16, p, expr.CmpOpEq), drop())})
	}
	ports := OverlayPorts
	if !slices.Contains(ports, uint16(h.opts.VXLANPort)) {
		ports = append(slices.Clone(ports), uint16(h.opts.VXLANPort))
	}
	rs = append(rs, overlayPortRules(from, egress, ports)...)
	t := h.opts.TransitCIDR
	rs = append(rs, rule{natChain, fmt.Sprintf("ip saddr %s oifname != \"%s*\" counter masquerade", t, egressPrefix),
		cat(ipv4(), prefixCmp(12, t, expr.CmpOpEq), []expr.Any{&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte(egressPrefix)}}, []expr.Any{&expr.Counter{}, &expr.Masq{}})})
	if h.opts.VTEP.IsValid() {
		rs = append(rs, rule{nodeInput, fmt.Sprintf("udp dport %d %s . @th,96,32 != @vxlan-peers counter drop", h.opts.VXLANPort, h.peerAddr()),
			cat(h.vxlanFilter(), drop())})
		rs = append(rs, h.vxlanFromVMs()...)
	}
	return rs
}

// tapRules let a VM's tap carry only frames from its own MAC and IPv4 address.
func tapRules(tap string, ip netip.Addr) []rule {
	mac, a := MAC(ip), ip.As4()
	in := func() []expr.Any { return ifname(expr.MetaKeyIIFNAME, tap, true) }
	return []rule{
		{brPreChain, fmt.Sprintf("iifname %q ether saddr != %s counter drop", tap, mac),
			cat(in(), payload(expr.PayloadBaseLLHeader, 6, mac, expr.CmpOpNeq), drop())},
		{brPreChain, fmt.Sprintf("iifname %q arp saddr ether != %s counter drop", tap, mac),
			cat(in(), etherType(unix.ETH_P_ARP), payload(expr.PayloadBaseNetworkHeader, 8, mac, expr.CmpOpNeq), drop())},
		{brPreChain, fmt.Sprintf("iifname %q arp saddr ip != %s counter drop", tap, ip),
			cat(in(), etherType(unix.ETH_P_ARP), payload(expr.PayloadBaseNetworkHeader, 14, a[:], expr.CmpOpNeq), drop())},
		{brPreChain, fmt.Sprintf("iifname %q ip saddr != %s counter drop", tap, ip),
			cat(in(), etherType(unix.ETH_P_IP), payload(expr.PayloadBaseNetworkHeader, 12, a[:], expr.CmpOpNeq), drop())},
		{brPreChain, fmt.Sprintf("iifname %q ether type ip6 counter drop", tap),
			cat(in(), etherType(unix.ETH_P_IPV6), drop())},
		{brPreChain, fmt.Sprintf("iifname %q counter", tap), cat(in(), []expr.Any{&expr.Counter{}})},
	}
}

// tapInRules count the frames the bridge delivers through tap to the VM of address ip: those
// for its MAC (not broadcasts, nor another's), which are what an idle VM's activity is.
func tapInRules(tap string, ip netip.Addr) []rule {
	mac := MAC(ip)
	return []rule{{tapInChain(tap), fmt.Sprintf("ether daddr %s counter", mac),
		cat(payload(expr.PayloadBaseLLHeader, 0, mac, expr.CmpOpEq), []expr.Any{&expr.Counter{}})}}
}

func cat(parts ...[]expr.Any) []expr.Any {
	var all []expr.Any
	for _, p := range parts {
		all = append(all, p...)
	}
	return all
}

// ifname matches an interface name: exactly, or as a prefix (nft's "name*").
func ifname(key expr.MetaKey, name string, exact bool) []expr.Any {
	data := []byte(name)
	if exact {
		data = make([]byte, unix.IFNAMSIZ)
		copy(data, name)
	}
	return []expr.Any{&expr.Meta{Key: key, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: data}}
}

func ctEstablished() []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED), Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)},
	}
}

// endpointReplies matches, after from, the reply packets of established connections whose
// source is in the endpoints set, and accepts them.
func endpointReplies(from []expr.Any) []expr.Any {
	return cat(from, []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED), Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)},
		&expr.Ct{Register: 1, Key: expr.CtKeyDIRECTION},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{1}}, // IP_CT_DIR_REPLY
	}, ipv4(), []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
		&expr.Lookup{SourceRegister: 1, SetName: endpointsSet.Name},
	}, verdict(expr.VerdictAccept))
}

func ipv4() []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}}}
}

func etherType(t uint16) []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyPROTOCOL, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(t)}}
}

func payload(base expr.PayloadBase, offset uint32, data []byte, op expr.CmpOp) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: base, Offset: offset, Len: uint32(len(data))},
		&expr.Cmp{Op: op, Register: 1, Data: data},
	}
}

// prefixCmp compares the IPv4 address at offset of the network header with p.
func prefixCmp(offset uint32, p netip.Prefix, op expr.CmpOp) []expr.Any {
	addr := p.Addr().As4()
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: net.CIDRMask(p.Bits(), 32), Xor: make([]byte, 4)},
		&expr.Cmp{Op: op, Register: 1, Data: addr[:]},
	}
}

func drop() []expr.Any {
	return []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop}}
}

func verdict(k expr.VerdictKind) []expr.Any { return []expr.Any{&expr.Verdict{Kind: k}} }

func l4proto(p byte) []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}}}
}

func comment(r *nftables.Rule) string {
	s, _ := userdata.GetString(r.UserData, userdata.TypeComment)
	return s
}

// tag is the comment of owner's rules when they are want.
func tag(owner string, want []rule) string {
	sum := sha256.New()
	for _, r := range want {
		fmt.Fprintln(sum, r.chain.Table.Family, r.chain.Name, r.text)
	}
	return "imp:" + owner + ":" + hex.EncodeToString(sum.Sum(nil))[:12]
}

// getRules lists a chain's rules; a missing table or chain has none. (The kernel answers
// with a dump filtered by table and chain.)
func getRules(conn *nftables.Conn, c *nftables.Chain) ([]*nftables.Rule, error) {
	rs, err := conn.GetRules(c.Table, c)
	if err != nil {
		return nil, fmt.Errorf("listing rules of %s: %w", c.Name, err)
	}
	return rs, nil
}

// replaceRules makes the rules of owner in chains exactly want, in one batch, unless they
// already are. The batch first adds the tables and chains (create), which leaves those that
// exist as they are.
func replaceRules(conn *nftables.Conn, chains []*nftables.Chain, create func(), owner string, want []rule) error {
	t := tag(owner, want)
	var mine []*nftables.Rule
	current := 0
	for _, c := range chains {
		rs, err := getRules(conn, c)
		if err != nil {
			return err
		}
		for _, r := range rs {
			if cm := comment(r); strings.HasPrefix(cm, "imp:"+owner+":") {
				mine = append(mine, r)
				if cm == t {
					current++
				}
			}
		}
	}
	if current == len(want) && len(mine) == current {
		return nil
	}
	if len(want) > 0 {
		create()
	}
	for _, r := range mine {
		if err := conn.DelRule(r); err != nil {
			return err
		}
	}
	for _, r := range want {
		conn.AddRule(&nftables.Rule{Table: r.chain.Table, Chain: r.chain, Exprs: r.exprs,
			UserData: userdata.AppendString(nil, userdata.TypeComment, t)})
	}
	if err := conn.Flush(); err != nil {
		return fmt.Errorf("replacing the rules of %s: %w", owner, err)
	}
	return nil
}

// createTables adds the namespace's tables, chains and map to conn's next batch (a table or
// chain that exists is left as it is).
func (s *space) createTables() {
	s.nft.AddTable(inetTable)
	s.nft.AddTable(bridgeTable)
	for _, c := range spaceChains {
		s.nft.AddChain(c)
	}
	_ = s.nft.AddSet(tapsMap, nil)
	_ = s.nft.AddSet(tapsInMap, nil)
	_ = s.nft.AddSet(polInMap, nil)
	_ = s.nft.AddSet(polOutMap, nil)
}

func (s *space) replaceRules(chains []*nftables.Chain, owner string, want []rule) error {
	return replaceRules(s.nft, chains, s.createTables, owner, want)
}

func tapChain(tap string) *nftables.Chain {
	return &nftables.Chain{Name: "tap-" + tap, Table: bridgeTable}
}

func tapInChain(tap string) *nftables.Chain {
	return &nftables.Chain{Name: "in-" + tap, Table: bridgeTable}
}

func ifElement(name string, to *nftables.Chain) nftables.SetElement {
	key := make([]byte, unix.IFNAMSIZ)
	copy(key, name)
	return nftables.SetElement{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictGoto, Chain: to.Name}}
}

// ensureTapRules makes tap's chain hold its anti-spoofing rules and its in- chain its count of
// what the VM receives, and the maps send the tap's frames to them. It reads those chains
// alone, so its cost does not grow with the VMs of the network.
func (s *space) ensureTapRules(tap string, ip netip.Addr) error {
	chains := []struct {
		c    *nftables.Chain
		want []rule
		m    *nftables.Set
	}{{tapChain(tap), tapRules(tap, ip), tapsMap}, {tapInChain(tap), tapInRules(tap, ip), tapsInMap}}
	ok := true
	for _, ch := range chains {
		t := tag(tap, ch.want)
		rs, err := getRules(s.nft, ch.c)
		if err != nil {
			rs = nil // no such chain yet (an agent before the in- chains made none)
		}
		ok = ok && len(rs) == len(ch.want)
		for _, r := range rs {
			ok = ok && comment(r) == t
		}
	}
	if ok {
		return nil
	}
	_ = s.nft.AddSet(tapsInMap, nil) // a network plumbed by an agent before it
	for _, ch := range chains {
		t := tag(tap, ch.want)
		s.nft.AddChain(ch.c)
		s.nft.FlushChain(ch.c)
		for _, r := range ch.want {
			s.nft.AddRule(&nftables.Rule{Table: ch.c.Table, Chain: ch.c, Exprs: r.exprs, UserData: userdata.AppendString(nil, userdata.TypeComment, t)})
		}
		if err := s.nft.SetAddElements(ch.m, []nftables.SetElement{ifElement(tap, ch.c)}); err != nil {
			return err
		}
	}
	if err := s.nft.Flush(); err != nil {
		return fmt.Errorf("replacing the rules of %s: %w", tap, err)
	}
	return nil
}

// TapCounters are the frames the tap of the VM kept under vmUID on n carried: delivered to the
// VM (for its MAC), and sent by it (past its anti-spoofing rules).
func (h *Host) TapCounters(n Network, vmUID string) (in, out uint64, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	s, err := h.openSpace(n.id())
	if err != nil {
		return 0, 0, err
	}
	if s == nil {
		return 0, 0, fmt.Errorf("network %s has no namespace on the node", n.Key())
	}
	tap := TapName(vmUID)
	count := func(c *nftables.Chain) (uint64, error) {
		rs, err := getRules(s.nft, c)
		if err != nil {
			return 0, err
		}
		var packets uint64
		for _, r := range rs {
			for _, e := range r.Exprs {
				if c, ok := e.(*expr.Counter); ok {
					packets += c.Packets
				}
			}
		}
		return packets, nil
	}
	if in, err = count(tapInChain(tap)); err != nil {
		return 0, 0, err
	}
	// Every frame the VM sent passes the tap chain's counters once: dropped (spoofed) or
	// counted by the last rule; the last rule's alone counts what passed.
	rs, err := getRules(s.nft, tapChain(tap))
	if err != nil {
		return 0, 0, err
	}
	if len(rs) > 0 {
		for _, e := range rs[len(rs)-1].Exprs {
			if c, ok := e.(*expr.Counter); ok {
				out = c.Packets
			}
		}
	}
	return in, out, nil
}

// removeTapRules removes tap's chains (its anti-spoofing chain, its in- chain, its policy) and
// their entries in the maps, and forgets the connections of its address.
func (s *space) removeTapRules(tap string) error {
	id := strings.TrimPrefix(tap, tapPrefix)
	var forget error
	if ip := s.tapAddr(tap); ip.IsValid() {
		forget = s.forgetFlows(ip) // its connections go with it: the address's next VM gets none
	}
	return errors.Join(forget, s.removeTapChain(tap, tapChain(tap), tapsMap), s.removeTapChain(tap, tapInChain(tap), tapsInMap), s.removePolicy(id))
}

// removeTapChain removes c, one of tap's chains, and its entry in map m, when there.
func (s *space) removeTapChain(tap string, c *nftables.Chain, m *nftables.Set) error {
	if _, err := s.nft.ListChain(c.Table, c.Name); err != nil {
		return nil // no such chain (the library keeps no error number to tell it apart)
	}
	if err := s.nft.SetDeleteElements(m, []nftables.SetElement{ifElement(tap, c)}); err != nil {
		return err
	}
	s.nft.FlushChain(c)
	s.nft.DelChain(c)
	if err := s.nft.Flush(); err != nil {
		// The map entry was already gone: the chain alone.
		s.nft.FlushChain(c)
		s.nft.DelChain(c)
		if err2 := s.nft.Flush(); err2 != nil {
			return fmt.Errorf("removing chain %s of %s: %w", c.Name, tap, errors.Join(err, err2))
		}
	}
	return nil
}

// pruneTapChains removes the chains of taps that are gone.
func (s *space) pruneTapChains() error {
	chains, err := s.nft.ListChainsOfTableFamily(nftables.TableFamilyBridge)
	if err != nil {
		return fmt.Errorf("listing chains of %s: %w", s.path, err)
	}
	var errs []error
	for _, c := range chains {
		tap, ok := strings.CutPrefix(c.Name, "tap-")
		in, isIn := strings.CutPrefix(c.Name, "in-")
		if (!ok && !isIn) || c.Table.Name != bridgeTable.Name {
			continue
		}
		if isIn {
			if _, err := s.nl.LinkByName(in); isNotFound(err) {
				errs = append(errs, s.removeTapChain(in, c, tapsInMap))
			}
			continue
		}
		if _, err := s.nl.LinkByName(tap); isNotFound(err) {
			errs = append(errs, s.removeTapRules(tap))
		}
	}
	return errors.Join(errs...)
}

// Rules lists IMP's rules in the node's namespace and in every network's, as nft prints their
// comments, for tests and diagnostics.
func (h *Host) Rules() ([]string, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	out, err := listRules(h.nft, nodeChains, "node")
	if err != nil {
		return nil, err
	}
	spaces, err := h.openSpaces()
	if err != nil {
		return nil, err
	}
	for _, s := range spaces {
		rs, err := listRules(s.nft, spaceChains, nsPrefix+s.id)
		if err != nil {
			return nil, err
		}
		out = append(out, rs...)
		chains, err := s.nft.ListChainsOfTableFamily(nftables.TableFamilyBridge)
		if err != nil {
			return nil, err
		}
		pol, err := s.nft.ListChainsOfTableFamily(nftables.TableFamilyINet)
		if err != nil {
			return nil, err
		}
		for _, c := range append(chains, pol...) {
			if c.Table.Name != inetTable.Name {
				continue
			}
			if strings.HasPrefix(c.Name, "tap-") || strings.HasPrefix(c.Name, "in-") || strings.HasPrefix(c.Name, "ing-") || strings.HasPrefix(c.Name, "egr-") {
				rs, err := listRules(s.nft, []*nftables.Chain{c}, nsPrefix+s.id)
				if err != nil {
					return nil, err
				}
				out = append(out, rs...)
			}
		}
	}
	return out, nil
}

func listRules(conn *nftables.Conn, chains []*nftables.Chain, where string) ([]string, error) {
	var out []string
	for _, c := range chains {
		rs, err := getRules(conn, c)
		if err != nil {
			return nil, err
		}
		for _, r := range rs {
			out = append(out, where+" "+c.Name+" "+comment(r))
		}
	}
	return out, nil
}
