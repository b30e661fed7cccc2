package hostnet

import (
	"fmt"
	"net/netip"

	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Egress is where a network's NAT egress may go, first match wins: Deny, then Allow, then
// public addresses when Internet is set; everything else is dropped. The node's rules come
// after these and win over them: the cluster's denied CIDRs, link-local addresses and the
// overlay ports (nodeRules).
type Egress struct {
	// Internet lets the VMs reach public addresses (all but NonPublic).
	Internet bool
	Allow    []EgressRule
	Deny     []EgressRule
	// Proxy sends the VMs' TCP connections to ports 80 and 443 outside the network through
	// the domain egress proxy on the gateway (ProxyPort) instead of these rules.
	Proxy bool
}

// EgressRule is a destination: a prefix and, when Ports is not empty, only those ports.
type EgressRule struct {
	Prefix netip.Prefix
	Ports  []PortRange
}

// PortRange is the ports From to To (inclusive) of a protocol (unix.IPPROTO_TCP or _UDP).
type PortRange struct {
	Protocol byte
	From, To uint16
}

// PublicEgress is the default: public addresses only.
var PublicEgress = Egress{Internet: true}

// NonPublic are the IPv4 ranges that are not public addresses: this network, private,
// shared (CGNAT), loopback, link-local, IETF protocol assignments, benchmarking, multicast and
// reserved. A cluster's nodes, pods and services, and a data centre's neighbours, live there.
var NonPublic = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.0.0.0/24"),
	netip.MustParsePrefix("192.168.0.0/16"),
	netip.MustParsePrefix("198.18.0.0/15"),
	netip.MustParsePrefix("224.0.0.0/4"),
	netip.MustParsePrefix("240.0.0.0/4"),
}

// OverlayPorts are the UDP ports of the overlays a node may run, IMP's besides: VXLAN (IANA,
// Calico, Antrea), Geneve (Cilium, OVN) and Linux's VXLAN default (Flannel, Cilium). Their
// receivers take packets from any node's address, which NAT egress would carry.
var OverlayPorts = []uint16{4789, 6081, 8472}

// egressRules are the rules of a NAT network's forward chain for traffic from its bridge
// (in) to its transit link (out), in order.
func egressRules(in, out string, e Egress) []rule {
	match := func() []expr.Any {
		return cat(ifname(expr.MetaKeyIIFNAME, in, true), ifname(expr.MetaKeyOIFNAME, out, true))
	}
	prefix := fmt.Sprintf("iifname %q oifname %q", in, out)
	var rs []rule
	add := func(r EgressRule, v expr.VerdictKind, word string) {
		p := r.Prefix.Masked()
		dst := fmt.Sprintf("%s ip daddr %s", prefix, p)
		if len(r.Ports) == 0 {
			rs = append(rs, rule{spaceForward, dst + " counter " + word, cat(match(), ipv4(), prefixCmp(16, p, expr.CmpOpEq), counted(v))})
			return
		}
		for _, pr := range r.Ports {
			rs = append(rs, rule{spaceForward, fmt.Sprintf("%s %s dport %d-%d counter %s", dst, protoName(pr.Protocol), pr.From, pr.To, word),
				cat(match(), ipv4(), prefixCmp(16, p, expr.CmpOpEq), l4proto(pr.Protocol), dportRange(pr.From, pr.To), counted(v))})
		}
	}
	for _, r := range e.Deny {
		add(r, expr.VerdictDrop, "drop")
	}
	for _, r := range e.Allow {
		add(r, expr.VerdictAccept, "accept")
	}
	if e.Internet {
		for _, p := range NonPublic {
			rs = append(rs, rule{spaceForward, fmt.Sprintf("%s ip daddr %s counter drop", prefix, p),
				cat(match(), ipv4(), prefixCmp(16, p, expr.CmpOpEq), drop())})
		}
		rs = append(rs, rule{spaceForward, prefix + " meta nfproto ipv4 accept", cat(match(), ipv4(), verdict(expr.VerdictAccept))})
	}
	return rs
}

func counted(v expr.VerdictKind) []expr.Any {
	return []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: v}}
}

// dportRange matches a transport header's destination port from..to.
func dportRange(from, to uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Range{Op: expr.CmpOpEq, Register: 1, FromData: binaryutil.BigEndian.PutUint16(from), ToData: binaryutil.BigEndian.PutUint16(to)},
	}
}

func protoName(p byte) string {
	switch p {
	case unix.IPPROTO_TCP:
		return "tcp"
	case unix.IPPROTO_UDP:
		return "udp"
	}
	return fmt.Sprint("l4proto ", p)
}

// overlayPortRules drop NAT egress to the overlay ports (ports), whatever the destination.
func overlayPortRules(from func() []expr.Any, egress string, ports []uint16) []rule {
	var rs []rule
	for _, p := range ports {
		rs = append(rs, rule{nodeForward, fmt.Sprintf("%s udp dport %d counter drop", egress, p),
			cat(from(), ipv4(), l4proto(unix.IPPROTO_UDP), dportRange(p, p), drop())})
	}
	return rs
}
