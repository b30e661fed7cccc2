package hostnet

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"golang.org/x/sys/unix"
)

// IMP's nftables: two tables of its own, never anyone else's.
//
//	table inet imp   chain forward     isolation of each network's bridge
//	                 chain postrouting masquerade of NAT networks
//	table bridge imp chain prerouting  anti-spoofing on each tap
//	                 chain postrouting keeps each node's gateway off the overlay
//
// Every rule carries a comment "imp:<link>:<hash>": the bridge or tap it belongs to and a hash
// of that link's whole rule set, so a set that is already right is left untouched and one that
// is not is replaced in a single atomic batch.
var (
	inetTable   = &nftables.Table{Family: nftables.TableFamilyINet, Name: "imp"}
	bridgeTable = &nftables.Table{Family: nftables.TableFamilyBridge, Name: "imp"}
	accept      = nftables.ChainPolicyAccept
	fwdChain    = &nftables.Chain{Name: "forward", Table: inetTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accept}
	natChain = &nftables.Chain{Name: "postrouting", Table: inetTable, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource, Policy: &accept}
	brPreChain = &nftables.Chain{Name: "prerouting", Table: bridgeTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRef(-200), Policy: &accept}
	brPostChain = &nftables.Chain{Name: "postrouting", Table: bridgeTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityFilter, Policy: &accept}
	chains = []*nftables.Chain{fwdChain, natChain, brPreChain, brPostChain}
)

// rule is one rule: where, what (in nft's syntax, for the hash and for people), how.
type rule struct {
	chain *nftables.Chain
	text  string
	exprs []expr.Any
}

// networkRules isolate n's bridge: nothing is routed into it but replies; out of it only to
// the uplink, and only when NAT is on, masqueraded. With the overlay, the gateway (the same
// address and MAC on every node) stays off the VXLAN device.
func networkRules(n Network, overlay bool) []rule {
	br, vx := n.BridgeName(), n.VXLANName()
	rs := []rule{
		// Frames bridged within the network, locally or over the overlay, pass the forward
		// hook too on hosts with br_netfilter (as Kubernetes nodes have it): in and out
		// are the bridge itself.
		{fwdChain, fmt.Sprintf("iifname %q oifname %q accept", br, br),
			cat(ifname(expr.MetaKeyIIFNAME, br, true), ifname(expr.MetaKeyOIFNAME, br, true), verdict(expr.VerdictAccept))},
		{fwdChain, fmt.Sprintf("oifname %q ct state established,related accept", br),
			cat(ifname(expr.MetaKeyOIFNAME, br, true), ctEstablished(), verdict(expr.VerdictAccept))},
		{fwdChain, fmt.Sprintf("oifname %q counter drop", br),
			cat(ifname(expr.MetaKeyOIFNAME, br, true), drop())},
	}
	if n.NAT {
		p := n.Prefix
		rs = append(rs,
			rule{fwdChain, fmt.Sprintf("iifname %q oifname \"%s*\" counter drop", br, bridgePrefix),
				cat(ifname(expr.MetaKeyIIFNAME, br, true), ifname(expr.MetaKeyOIFNAME, bridgePrefix, false), drop())},
			rule{fwdChain, fmt.Sprintf("iifname %q accept", br),
				cat(ifname(expr.MetaKeyIIFNAME, br, true), verdict(expr.VerdictAccept))},
			rule{natChain, fmt.Sprintf("ip saddr %s ip daddr != %s counter masquerade", p, p),
				cat(ipv4(), prefixCmp(12, p, expr.CmpOpEq), prefixCmp(16, p, expr.CmpOpNeq), []expr.Any{&expr.Counter{}, &expr.Masq{}})},
		)
	} else {
		rs = append(rs, rule{fwdChain, fmt.Sprintf("iifname %q counter drop", br),
			cat(ifname(expr.MetaKeyIIFNAME, br, true), drop())})
	}
	if overlay {
		gw := n.Gateway.As4()
		rs = append(rs,
			rule{brPostChain, fmt.Sprintf("oifname %q ether saddr %s drop", vx, MAC(n.Gateway)),
				cat(ifname(expr.MetaKeyOIFNAME, vx, true), payload(expr.PayloadBaseLLHeader, 6, MAC(n.Gateway), expr.CmpOpEq), drop())},
			rule{brPostChain, fmt.Sprintf("oifname %q arp daddr ip %s drop", vx, n.Gateway),
				cat(ifname(expr.MetaKeyOIFNAME, vx, true), etherType(unix.ETH_P_ARP), payload(expr.PayloadBaseNetworkHeader, 24, gw[:], expr.CmpOpEq), drop())},
		)
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
	}
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

func (h *Host) ensureRules(n Network, overlay bool) error {
	if err := h.replaceRules(n.BridgeName(), networkRules(n, overlay)); err != nil {
		return fmt.Errorf("rules of network %s: %w", n.Key(), err)
	}
	return h.syncForwarding()
}

func comment(r *nftables.Rule) string {
	s, _ := userdata.GetString(r.UserData, userdata.TypeComment)
	return s
}

// ensureTables creates IMP's tables and chains when missing.
func (h *Host) ensureTables() error {
	have := map[string]bool{}
	cs, err := h.nft.ListChains()
	if err != nil {
		return fmt.Errorf("listing nftables chains: %w", err)
	}
	for _, c := range cs {
		have[fmt.Sprint(c.Table.Family, c.Table.Name, c.Name)] = true
	}
	missing := false
	for _, c := range chains {
		if !have[fmt.Sprint(c.Table.Family, c.Table.Name, c.Name)] {
			missing = true
		}
	}
	if !missing {
		return nil
	}
	h.nft.AddTable(inetTable)
	h.nft.AddTable(bridgeTable)
	for _, c := range chains {
		h.nft.AddChain(c)
	}
	if err := h.nft.Flush(); err != nil {
		return fmt.Errorf("creating IMP's nftables tables: %w", err)
	}
	return nil
}

// replaceRules makes the rules tagged for link exactly want, in one batch, unless they already
// are.
func (h *Host) replaceRules(link string, want []rule) error {
	if len(want) > 0 {
		if err := h.ensureTables(); err != nil {
			return err
		}
	}
	sum := sha256.New()
	for _, r := range want {
		fmt.Fprintln(sum, r.chain.Table.Family, r.chain.Name, r.text)
	}
	tag := "imp:" + link + ":" + hex.EncodeToString(sum.Sum(nil))[:12]
	var mine []*nftables.Rule
	current := 0
	for _, c := range chains {
		rs, err := h.getRules(c)
		if err != nil {
			return err
		}
		for _, r := range rs {
			if cm := comment(r); strings.HasPrefix(cm, "imp:"+link+":") {
				mine = append(mine, r)
				if cm == tag {
					current++
				}
			}
		}
	}
	if current == len(want) && len(mine) == current {
		return nil
	}
	for _, r := range mine {
		if err := h.nft.DelRule(r); err != nil {
			return err
		}
	}
	for _, r := range want {
		h.nft.AddRule(&nftables.Rule{Table: r.chain.Table, Chain: r.chain, Exprs: r.exprs,
			UserData: userdata.AppendString(nil, userdata.TypeComment, tag)})
	}
	if err := h.nft.Flush(); err != nil {
		return fmt.Errorf("replacing the rules of %s: %w", link, err)
	}
	if len(want) == 0 {
		return h.dropEmptyTables()
	}
	return nil
}

// getRules lists a chain's rules; a missing table or chain has none.
func (h *Host) getRules(c *nftables.Chain) ([]*nftables.Rule, error) {
	rs, err := h.nft.GetRules(c.Table, c)
	var errno unix.Errno
	if errors.As(err, &errno) && errno == unix.ENOENT {
		return nil, nil
	} else if err != nil {
		return nil, fmt.Errorf("listing rules of %s: %w", c.Name, err)
	}
	return rs, nil
}

// pruneRules removes IMP rules whose link is not in live.
func (h *Host) pruneRules(live map[string]bool) error {
	n := 0
	for _, c := range chains {
		rs, err := h.getRules(c)
		if err != nil {
			return err
		}
		for _, r := range rs {
			link, _, _ := strings.Cut(strings.TrimPrefix(comment(r), "imp:"), ":")
			if !live[link] {
				if err := h.nft.DelRule(r); err != nil {
					return err
				}
				// Flush in batches: the kernel acknowledges each message, and a socket
				// buffer holds a few hundred acknowledgements.
				if n++; n%100 == 0 {
					if err := h.nft.Flush(); err != nil {
						return fmt.Errorf("removing stale rules: %w", err)
					}
				}
			}
		}
	}
	if n > 0 {
		if err := h.nft.Flush(); err != nil {
			return fmt.Errorf("removing stale rules: %w", err)
		}
	}
	return h.dropEmptyTables()
}

// dropEmptyTables removes IMP's tables when no rule is left in them.
func (h *Host) dropEmptyTables() error {
	rules, err := h.Rules()
	if err != nil || len(rules) > 0 {
		return err
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
	if n == 0 {
		return nil
	}
	if err := h.nft.Flush(); err != nil {
		return fmt.Errorf("removing IMP's empty nftables tables: %w", err)
	}
	return nil
}

// natPresent says whether any network's masquerade rule is in place.
func (h *Host) natPresent() (bool, error) {
	rs, err := h.getRules(natChain)
	return len(rs) > 0, err
}

// Rules lists IMP's rules as nft prints their comments, for tests and diagnostics.
func (h *Host) Rules() ([]string, error) {
	var out []string
	for _, c := range chains {
		rs, err := h.getRules(c)
		if err != nil {
			return nil, err
		}
		for _, r := range rs {
			out = append(out, c.Name+" "+comment(r))
		}
	}
	return out, nil
}
