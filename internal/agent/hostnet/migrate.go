package hostnet

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// migrate moves the networks an agent of the earlier layout kept in the node's namespace (a
// bridge per network with the gateway address, the VMs' taps on it, every rule in the node's
// tables) into namespaces of their own. A running VM keeps its tap, and so its address and
// MAC: the tap moves into the network's namespace, onto a new bridge with the same gateway
// address and MAC, with its anti-spoofing rules, read back from the rules the earlier agent
// wrote. The network's NAT and overlay come back at its next Sync.
func (h *Host) migrate() error {
	links, err := h.nl.LinkList()
	if err != nil {
		return fmt.Errorf("listing links: %w", err)
	}
	ips, err := h.legacyTapAddrs()
	if err != nil {
		return err
	}
	var errs []error
	for _, br := range links {
		a := br.Attrs()
		key, ok := strings.CutPrefix(a.Alias, netAlias)
		if !ok || !strings.HasPrefix(a.Name, bridgePrefix) {
			continue
		}
		errs = append(errs, h.migrateNetwork(br, key, links, ips))
	}
	// What is left, taps on no bridge and VXLAN devices of networks moved, nothing running
	// uses.
	if links, err = h.nl.LinkList(); err != nil {
		return fmt.Errorf("listing links: %w", err)
	}
	for _, l := range links {
		a := l.Attrs()
		if (strings.HasPrefix(a.Name, tapPrefix) && strings.HasPrefix(a.Alias, vmAlias)) ||
			(strings.HasPrefix(a.Name, vxlanPrefix) && strings.HasPrefix(a.Alias, netAlias)) {
			if err := h.nl.LinkDel(l); err != nil {
				errs = append(errs, fmt.Errorf("removing %s: %w", a.Name, err))
			}
		}
	}
	errs = append(errs, h.pruneLegacyRules())
	return errors.Join(errs...)
}

func (h *Host) migrateNetwork(old netlink.Link, key string, links []netlink.Link, ips map[string]netip.Addr) error {
	addrs, err := h.nl.AddrList(old, unix.AF_INET)
	if err != nil || len(addrs) == 0 {
		return errors.Join(err, h.nl.LinkDel(old)) // a bridge without its gateway carried nothing
	}
	ns, name, _ := strings.Cut(key, "/")
	gw, _ := netip.AddrFromSlice(addrs[0].IP.To4())
	bits, _ := addrs[0].Mask.Size()
	n := Network{Namespace: ns, Name: name, Prefix: netip.PrefixFrom(gw, bits).Masked(), Gateway: gw}
	s, err := h.ensureSpace(strings.TrimPrefix(old.Attrs().Name, bridgePrefix))
	if err != nil {
		return err
	}
	br, err := s.ensureBridge(n, h.opts.MTU)
	if err != nil {
		return err
	}
	if err := s.replaceRules(spaceChains, "net", networkRules(s.id, n, false)); err != nil {
		return err
	}
	var errs []error
	for _, l := range links {
		a := l.Attrs()
		uid, ok := strings.CutPrefix(a.Alias, vmAlias)
		if !ok || a.MasterIndex != old.Attrs().Index {
			continue
		}
		if err := h.nl.LinkSetNsFd(l, int(s.ns)); err != nil {
			errs = append(errs, fmt.Errorf("moving tap %s into %s: %w", a.Name, s.path, err))
			continue
		}
		if err := s.configureTap(a.Name, uid, br, h.opts.MTU); err != nil {
			errs = append(errs, err)
			continue
		}
		// Without its address, the tap stays without a chain: it carries nothing, rather
		// than anything.
		if ip, ok := ips[a.Name]; ok {
			errs = append(errs, s.ensureTapRules(a.Name, ip))
		}
	}
	if err := h.nl.LinkDel(old); err != nil {
		errs = append(errs, fmt.Errorf("removing the earlier bridge %s: %w", old.Attrs().Name, err))
	}
	return errors.Join(errs...)
}

// legacyTapAddrs reads each tap's address from the anti-spoofing rules the earlier layout kept
// in the node's bridge table ("ip saddr != A drop").
func (h *Host) legacyTapAddrs() (map[string]netip.Addr, error) {
	rs, err := getRules(h.nft, brPreChain)
	if err != nil {
		return nil, err
	}
	ips := map[string]netip.Addr{}
	for _, r := range rs {
		tap, _, _ := strings.Cut(strings.TrimPrefix(comment(r), "imp:"), ":")
		if !strings.HasPrefix(tap, tapPrefix) {
			continue
		}
		for i := 0; i+1 < len(r.Exprs); i++ {
			p, ok := r.Exprs[i].(*expr.Payload)
			c, ok2 := r.Exprs[i+1].(*expr.Cmp)
			if ok && ok2 && p.Base == expr.PayloadBaseNetworkHeader && p.Offset == 12 && p.Len == 4 && len(c.Data) == 4 {
				ips[tap] = netip.AddrFrom4([4]byte(c.Data))
			}
		}
	}
	return ips, nil
}
