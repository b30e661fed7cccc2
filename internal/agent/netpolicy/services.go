package netpolicy

import (
	"net/netip"

	corev1 "k8s.io/api/core/v1"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
)

// Service is a Service's virtual addresses and, per port, the endpoints kube-proxy sends its
// connections to.
type Service struct {
	Namespace, Name string
	ClusterIPs      []netip.Addr
	Ports           []ServicePort
}

// ServicePort is one port of a Service and the endpoints (address and target port) kube-proxy
// may pick: ready ones, and serving ones, which it falls back to when none is ready.
type ServicePort struct {
	Protocol  corev1.Protocol
	Port      int32
	Endpoints []netip.AddrPort
}

// throughServices adds to a VM's egress the Services whose every endpoint one allow lets the
// VM reach: a VM's egress is checked before the node's kube-proxy picks an endpoint for a
// ClusterIP, so a Service's address and port are allowed only when whichever endpoint it
// picks would have been. A Service with no ready endpoint adds nothing.
func (w *World) throughServices(egress []hostnet.Allow) []hostnet.Allow {
	var added []hostnet.Allow
	for _, s := range w.Services {
		var vips []netip.Prefix
		for _, ip := range s.ClusterIPs {
			if ip.Is4() {
				vips = append(vips, netip.PrefixFrom(ip, 32))
			}
		}
		if len(vips) == 0 {
			continue
		}
		for _, sp := range s.Ports {
			if len(sp.Endpoints) == 0 || sp.Port < 1 || sp.Port > 65535 {
				continue
			}
			proto := protoNum(protocol(&sp.Protocol))
			for _, a := range egress {
				if allowsAll(a, proto, sp.Endpoints) {
					added = append(added, hostnet.Allow{Outside: vips,
						Ports: []hostnet.PortRange{{Protocol: proto, From: uint16(sp.Port), To: uint16(sp.Port)}}})
					break
				}
			}
		}
	}
	return append(egress, added...)
}

// allowsAll says whether a lets every endpoint, reached beyond the network, over proto.
func allowsAll(a hostnet.Allow, proto byte, eps []netip.AddrPort) bool {
	for _, ep := range eps {
		in := false
		for _, p := range a.Outside {
			if p.Contains(ep.Addr()) {
				in = true
				break
			}
		}
		if !in {
			return false
		}
		if len(a.Ports) == 0 {
			continue
		}
		ok := false
		for _, r := range a.Ports {
			if r.Protocol == proto && ep.Port() >= r.From && ep.Port() <= r.To {
				ok = true
				break
			}
		}
		if !ok {
			return false
		}
	}
	return true
}
