package hostnet

import (
	"fmt"
	"net/netip"
	"os"

	"github.com/google/nftables"
	"github.com/google/nftables/userdata"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// LegacyAttach plumbs a VM the way agents before network namespaces did, in the node's
// namespace at nsPath: the network's bridge with the gateway address, the VM's tap on it (open,
// as a running VMM holds it), and the tap's anti-spoofing rules in the node's bridge table.
func LegacyAttach(nsPath string, n Network, vmUID string, ip netip.Addr) (*os.File, error) {
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return nil, err
	}
	s := &space{id: n.id(), path: nsPath, ns: ns}
	defer s.close()
	if s.nl, err = netlink.NewHandleAt(ns); err != nil {
		return nil, err
	}
	if s.nft, err = nftables.New(nftables.WithNetNSFd(int(ns))); err != nil {
		return nil, err
	}
	br, err := s.ensureBridge(n, DefaultMTU)
	if err != nil {
		return nil, err
	}
	tap := TapName(vmUID)
	f, err := s.openTap(tap)
	if err != nil {
		return nil, err
	}
	if err := s.configureTap(tap, vmUID, br, DefaultMTU); err != nil {
		return nil, err
	}
	s.nft.AddTable(bridgeTable)
	s.nft.AddChain(brPreChain)
	s.nft.AddTable(inetTable)
	s.nft.AddChain(nodeForward)
	for _, r := range tapRules(tap, ip) {
		s.nft.AddRule(&nftables.Rule{Table: bridgeTable, Chain: brPreChain, Exprs: r.exprs,
			UserData: userdata.AppendString(nil, userdata.TypeComment, "imp:"+tap+":0123456789ab")})
	}
	for _, r := range networkRules(n.id(), n, false)[:1] {
		s.nft.AddRule(&nftables.Rule{Table: inetTable, Chain: nodeForward, Exprs: r.exprs,
			UserData: userdata.AppendString(nil, userdata.TypeComment, "imp:"+bridgePrefix+n.id()+":0123456789ab")})
	}
	if err := s.nft.Flush(); err != nil {
		return nil, fmt.Errorf("legacy rules: %w", err)
	}
	return f, nil
}
