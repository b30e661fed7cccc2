package v1alpha1

import (
	"fmt"
	"net/netip"
	"strings"
)

// Prefix parses spec.cidr, which must be a canonical IPv4 prefix from /8 to /30.
func (s *ImpNetworkSpec) Prefix() (netip.Prefix, error) {
	p, err := netip.ParsePrefix(s.CIDR)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("parsing cidr %q: %w", s.CIDR, err)
	}
	switch {
	case !p.Addr().Is4():
		return netip.Prefix{}, fmt.Errorf("cidr %q is not IPv4", s.CIDR)
	case p.Masked() != p:
		return netip.Prefix{}, fmt.Errorf("cidr %q has host bits set (network address is %s)", s.CIDR, p.Masked())
	case p.Bits() < 8 || p.Bits() > 30:
		return netip.Prefix{}, fmt.Errorf("cidr %q: prefix length must be between /8 and /30", s.CIDR)
	}
	return p, nil
}

// Broadcast returns the last address of p.
func Broadcast(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr().As4()
	host := uint32(1)<<(32-p.Bits()) - 1
	v := uint32(a[0])<<24 | uint32(a[1])<<16 | uint32(a[2])<<8 | uint32(a[3]) | host
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// GatewayAddr returns the network's gateway: spec.gateway, or the first host address of the
// CIDR. It refuses a gateway outside the CIDR or on its network or broadcast address.
func (s *ImpNetworkSpec) GatewayAddr() (netip.Addr, error) {
	p, err := s.Prefix()
	if err != nil {
		return netip.Addr{}, err
	}
	if s.Gateway == "" {
		return p.Addr().Next(), nil
	}
	gw, err := netip.ParseAddr(s.Gateway)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("parsing gateway %q: %w", s.Gateway, err)
	}
	switch {
	case !p.Contains(gw):
		return netip.Addr{}, fmt.Errorf("gateway %s is outside cidr %s", gw, p)
	case gw == p.Addr():
		return netip.Addr{}, fmt.Errorf("gateway %s is the network address of %s", gw, p)
	case gw == Broadcast(p):
		return netip.Addr{}, fmt.Errorf("gateway %s is the broadcast address of %s", gw, p)
	}
	return gw, nil
}

// HostCapacity is how many addresses of the network VMs can hold: all but the network,
// broadcast and gateway addresses.
func (s *ImpNetworkSpec) HostCapacity() (int64, error) {
	p, err := s.Prefix()
	if err != nil {
		return 0, err
	}
	return int64(1)<<(32-p.Bits()) - 3, nil
}

// ReservedOverlap returns the first of reserved that the network's CIDR overlaps, if any.
func (s *ImpNetworkSpec) ReservedOverlap(reserved []netip.Prefix) (netip.Prefix, bool) {
	p, err := s.Prefix()
	if err != nil {
		return netip.Prefix{}, false
	}
	for _, r := range reserved {
		if r.Overlaps(p) {
			return r, true
		}
	}
	return netip.Prefix{}, false
}

// ParseIPv4CIDRs parses a comma-separated list of IPv4 CIDRs (a flag's value), masked.
func ParseIPv4CIDRs(s string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, c := range strings.Split(s, ",") {
		if c = strings.TrimSpace(c); c == "" {
			continue
		}
		p, err := netip.ParsePrefix(c)
		if err != nil || !p.Addr().Is4() {
			return nil, fmt.Errorf("not an IPv4 CIDR: %q", c)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}
