package hostnet

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strconv"

	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Domain egress: a NAT network whose egress names domains (Egress.Proxy) sends every new TCP
// connection of its VMs to port 80 or 443 outside the network to the egress proxy on its
// gateway (ProxyPort), which lets it out only to an allowed name (package egressproxy). The
// redirect comes after the VM's NetworkPolicy (checked in prerouting, on the destination the
// VM named) and replaces the network's CIDR rules for those ports.

// ProxyPort is where the domain egress proxy listens on each network's gateway.
const ProxyPort = 15001

// proxiedPorts are the ports whose connections go through the proxy.
var proxiedPorts = []uint16{80, 443}

// proxyRules redirect n's VMs' HTTP and HTTPS connections leaving the network to the proxy on
// the gateway, and let them reach it.
func proxyRules(br string, n Network) []rule {
	gw := n.Gateway.As4()
	p := n.Prefix.Masked()
	var rs []rule
	for _, port := range proxiedPorts {
		rs = append(rs, rule{dnatChain, fmt.Sprintf("iifname %q ip daddr != %s tcp dport %d dnat ip to %s:%d", br, p, port, n.Gateway, ProxyPort),
			cat(ifname(expr.MetaKeyIIFNAME, br, true), ipv4(), prefixCmp(16, p, expr.CmpOpNeq), l4proto(unix.IPPROTO_TCP), dportRange(port, port),
				[]expr.Any{
					&expr.Immediate{Register: 1, Data: gw[:]},
					&expr.Immediate{Register: 2, Data: bePort(ProxyPort)},
					&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegProtoMin: 2, Specified: true},
				})})
	}
	return rs
}

// proxyInput lets the redirected connections reach the proxy (the input chain drops the rest).
func proxyInput(br string) rule {
	return rule{spaceInput, fmt.Sprintf("iifname %q tcp dport %d ct status dnat accept", br, ProxyPort),
		cat(ifname(expr.MetaKeyIIFNAME, br, true), l4proto(unix.IPPROTO_TCP), dportRange(ProxyPort, ProxyPort), []expr.Any{
			&expr.Ct{Register: 1, Key: expr.CtKeySTATUS},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: nativeU32(0x20), Xor: nativeU32(0)},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: nativeU32(0)},
		}, verdict(expr.VerdictAccept))}
}

// bePort is a port as the NAT expression reads it from a register: network byte order.
func bePort(p uint16) []byte { return []byte{byte(p >> 8), byte(p)} }

// ListenProxy listens for the domain egress proxy on n's gateway, in n's namespace.
func (h *Host) ListenProxy(n Network) (net.Listener, error) {
	h.mu.Lock()
	s, err := h.plumbed(n)
	h.mu.Unlock()
	if err != nil {
		return nil, err
	}
	var l net.Listener
	err = runIn(s.ns, func() (err error) {
		l, err = net.Listen("tcp", net.JoinHostPort(n.Gateway.String(), strconv.Itoa(ProxyPort)))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listening for the egress proxy of %s: %w", n.Key(), err)
	}
	return l, nil
}

// DialFromNode connects to to from the node's namespace.
func (h *Host) DialFromNode(ctx context.Context, to netip.AddrPort) (net.Conn, error) {
	var c net.Conn
	err := runIn(h.ns, func() (err error) {
		var d net.Dialer
		c, err = d.DialContext(ctx, "tcp", to.String())
		return err
	})
	return c, err
}

// Resolver resolves names as the node does, its queries sent from the node's namespace; to
// nameserver ("host:port") when set, else to the node's resolv.conf's.
func (h *Host) Resolver(nameserver string) *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, address string) (net.Conn, error) {
		if nameserver != "" {
			address = nameserver
		}
		var c net.Conn
		err := runIn(h.ns, func() (err error) {
			var d net.Dialer
			c, err = d.DialContext(ctx, network, address)
			return err
		})
		return c, err
	}}
}

// Internal says why n's VMs may not reach a on TCP port through the egress proxy, or "": an
// address of the node's, loopback, link-local, unspecified or multicast, the cluster's denied
// ranges and the transit range; what n's egress denies (on that port); and a non-public address
// its allow does not list (on that port). A name the network's domains allow may resolve to
// any public address, whatever internet says: domains are what it allows over HTTP and HTTPS.
func (h *Host) Internal(n Network) func(netip.Addr, uint16) string {
	return func(a netip.Addr, port uint16) string {
		switch {
		case !a.Is4():
			return "not an IPv4 address"
		case a.IsLoopback(), a.IsLinkLocalUnicast(), a.IsUnspecified(), a.IsMulticast():
			return "a loopback, link-local, unspecified or multicast address"
		case h.opts.TransitCIDR.Contains(a):
			return "the transit range"
		}
		for _, p := range h.opts.DeniedEgress {
			if p.Contains(a) {
				return "in the cluster's denied range " + p.String()
			}
		}
		if h.nodeAddress(a) {
			return "an address of the node"
		}
		for _, r := range n.Egress.Deny {
			if r.holds(a, port) {
				return "denied by the network's egress " + r.Prefix.String()
			}
		}
		for _, r := range n.Egress.Allow {
			if r.holds(a, port) {
				return ""
			}
		}
		for _, p := range NonPublic {
			if p.Contains(a) {
				return "not a public address (" + p.String() + ")"
			}
		}
		return ""
	}
}

// holds says whether r covers TCP port of a: its prefix holds a, and it names no ports or a
// TCP range with port.
func (r EgressRule) holds(a netip.Addr, port uint16) bool {
	if !r.Prefix.Contains(a) {
		return false
	}
	if len(r.Ports) == 0 {
		return true
	}
	for _, pr := range r.Ports {
		if pr.Protocol == unix.IPPROTO_TCP && port >= pr.From && port <= pr.To {
			return true
		}
	}
	return false
}

// nodeAddress says whether a is an address of the node's namespace.
func (h *Host) nodeAddress(a netip.Addr) bool {
	h.mu.Lock()
	addrs, err := h.nl.AddrList(nil, netlink.FAMILY_V4)
	h.mu.Unlock()
	if err != nil {
		return true // unknown: refused
	}
	for _, x := range addrs {
		if b, ok := netip.AddrFromSlice(x.IP.To4()); ok && b == a {
			return true
		}
	}
	return false
}
