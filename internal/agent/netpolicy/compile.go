// Package netpolicy applies the cluster's NetworkPolicies (networking.k8s.io/v1) to the VMs
// of this node, as the API defines them for pods: a policy whose podSelector matches a VM's
// labels in its namespace isolates it for the policy's types, and then only what some
// selecting policy allows reaches it or leaves it; peers are pods and VMs (by podSelector,
// namespaceSelector or both) and ipBlocks; ports are numbers, ranges and names. Compile turns
// the API's objects into a hostnet.Policy per VM; the Enforcer keeps every local VM's policy
// current in its network's namespace as policies, namespaces, pods and VMs change.
//
// Each node computes and enforces the policy of its own VMs only, from objects no agent can
// write (NetworkPolicies, Namespaces, Pods, and the operator's ImpIPAddresses, which carry
// each VM's address, labels and named ports): an agent cannot widen what another node
// enforces.
package netpolicy

import (
	"encoding/binary"
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
)

// NamedPort is a port a pod's container or a VM declares with a name.
type NamedPort struct {
	Name     string
	Protocol corev1.Protocol
	Port     int32
}

// Pod is what a policy reads of a pod: its namespace, labels, addresses and named ports.
type Pod struct {
	Namespace string
	Labels    map[string]string
	IPs       []netip.Addr
	Ports     []NamedPort
}

// VM is what a policy reads of a VM: its namespace, labels, network ("namespace/name" of its
// ImpNetwork), address on it and named ports.
type VM struct {
	Namespace, Name string
	Labels          map[string]string
	Network         string
	Address         netip.Addr
	Ports           []NamedPort
}

// World is what the policies of a VM are computed from.
type World struct {
	Policies []*networkingv1.NetworkPolicy
	// Namespaces are the namespaces' labels by name.
	Namespaces map[string]map[string]string
	Pods       []Pod
	// VMs are the VMs with an address, on every node.
	VMs []VM
	// Services are the cluster's Services with their endpoints: a VM's egress to a ClusterIP.
	Services []Service

	selectors map[*metav1.LabelSelector]labels.Selector
	// index holds the pods' and VMs' indices by namespace and by label (candidates).
	index map[string]*[2][]int
}

// everywhere is a peer list that says nothing: every address.
var everywhere = []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}

// Selecting are the policies that select vm, in the order given.
func (w *World) Selecting(vm VM) []*networkingv1.NetworkPolicy {
	var out []*networkingv1.NetworkPolicy
	for _, p := range w.Policies {
		if p.Namespace == vm.Namespace && w.matches(&p.Spec.PodSelector, vm.Labels) {
			out = append(out, p)
		}
	}
	return out
}

// Compile is vm's policy: for each direction, nil when no selecting policy has that type
// (not isolated), else the union of what their rules allow.
func (w *World) Compile(vm VM) hostnet.Policy {
	var out hostnet.Policy
	for _, p := range w.Selecting(vm) {
		ingress, egress := policyTypes(p)
		if ingress {
			if out.Ingress == nil {
				out.Ingress = []hostnet.Allow{}
			}
			for _, r := range p.Spec.Ingress {
				out.Ingress = append(out.Ingress, w.allows(p.Namespace, vm, r.From, r.Ports, true)...)
			}
		}
		if egress {
			if out.Egress == nil {
				out.Egress = []hostnet.Allow{}
			}
			for _, r := range p.Spec.Egress {
				out.Egress = append(out.Egress, w.allows(p.Namespace, vm, r.To, r.Ports, false)...)
			}
		}
	}
	if len(out.Egress) > 0 {
		out.Egress = w.throughServices(out.Egress)
	}
	return out
}

// policyTypes are the directions p isolates: its policyTypes, or, where the API server has not
// defaulted them, Ingress always and Egress when it has egress rules.
func policyTypes(p *networkingv1.NetworkPolicy) (ingress, egress bool) {
	if len(p.Spec.PolicyTypes) == 0 {
		return true, len(p.Spec.Egress) > 0
	}
	return slices.Contains(p.Spec.PolicyTypes, networkingv1.PolicyTypeIngress), slices.Contains(p.Spec.PolicyTypes, networkingv1.PolicyTypeEgress)
}

// peer is one selected pod or VM, or an ipBlock's prefixes, as a rule sees it.
type peer struct {
	network, outside []netip.Prefix
	ports            []NamedPort // its named ports (an ipBlock has none)
}

// allows are what one rule allows vm: its peers (ns is the policy's namespace) on its ports.
// Named ports resolve against vm's own on ingress, and against each peer's on egress.
func (w *World) allows(ns string, vm VM, peers []networkingv1.NetworkPolicyPeer, ports []networkingv1.NetworkPolicyPort, in bool) []hostnet.Allow {
	var ps []peer
	if len(peers) == 0 {
		ps = []peer{{network: everywhere, outside: everywhere}}
	}
	for _, pr := range peers {
		ps = append(ps, w.peers(ns, vm, pr)...)
	}
	if len(ports) == 0 {
		var a hostnet.Allow
		for _, p := range ps {
			a.Network, a.Outside = append(a.Network, p.network...), append(a.Outside, p.outside...)
		}
		return []hostnet.Allow{a}
	}
	var out []hostnet.Allow
	for _, port := range ports {
		if port.Port == nil || port.Port.Type == intstr.Int {
			r, ok := portRange(port)
			if !ok {
				continue
			}
			a := hostnet.Allow{Ports: []hostnet.PortRange{r}}
			for _, p := range ps {
				a.Network, a.Outside = append(a.Network, p.network...), append(a.Outside, p.outside...)
			}
			out = append(out, a)
			continue
		}
		// A named port: the number it names for the VM itself (ingress), or for each peer
		// (egress); a peer without such a port (an ipBlock among them) is not allowed by it.
		proto := protocol(port.Protocol)
		if in {
			if n, ok := resolve(vm.Ports, port.Port.StrVal, proto); ok {
				a := hostnet.Allow{Ports: []hostnet.PortRange{{Protocol: protoNum(proto), From: n, To: n}}}
				for _, p := range ps {
					a.Network, a.Outside = append(a.Network, p.network...), append(a.Outside, p.outside...)
				}
				out = append(out, a)
			}
			continue
		}
		for _, p := range ps {
			if n, ok := resolve(p.ports, port.Port.StrVal, proto); ok {
				out = append(out, hostnet.Allow{Network: p.network, Outside: p.outside,
					Ports: []hostnet.PortRange{{Protocol: protoNum(proto), From: n, To: n}}})
			}
		}
	}
	return out
}

// peers are the pods and VMs (or the prefixes) one peer of a rule names. A pod is reached
// beyond the network's transit link; a VM on the network's own segment, and only a VM of vm's
// network: a VM of another network reaches vm only through NAT, as its node's address.
func (w *World) peers(ns string, vm VM, pr networkingv1.NetworkPolicyPeer) []peer {
	if b := pr.IPBlock; b != nil {
		ps := ipBlock(b)
		if len(ps) == 0 {
			return nil
		}
		return []peer{{network: ps, outside: ps}}
	}
	inNS := func(name string) bool {
		if pr.NamespaceSelector == nil {
			return name == ns
		}
		l, ok := w.Namespaces[name]
		return ok && w.matches(pr.NamespaceSelector, l)
	}
	picked := func(l map[string]string) bool {
		return pr.PodSelector == nil || w.matches(pr.PodSelector, l)
	}
	pods, vms := w.candidates(ns, pr)
	var out []peer
	for _, i := range pods {
		p := &w.Pods[i]
		if !inNS(p.Namespace) || !picked(p.Labels) {
			continue
		}
		var pp peer
		for _, ip := range p.IPs {
			if ip.Is4() {
				pp.outside = append(pp.outside, netip.PrefixFrom(ip, 32))
			}
		}
		if len(pp.outside) > 0 {
			pp.ports = p.Ports
			out = append(out, pp)
		}
	}
	for _, i := range vms {
		v := &w.VMs[i]
		if v.Network != vm.Network || !v.Address.Is4() || !inNS(v.Namespace) || !picked(v.Labels) {
			continue
		}
		out = append(out, peer{network: []netip.Prefix{netip.PrefixFrom(v.Address, 32)}, ports: v.Ports})
	}
	return out
}

// candidates are the pods and VMs (indices) a peer may select, a superset its selectors then
// check: those of the policy's namespace when it names no other, and of those the ones with
// the rarest of its pod selector's labels. The index is built once per World.
func (w *World) candidates(ns string, pr networkingv1.NetworkPolicyPeer) (pods, vms []int) {
	if w.index == nil {
		w.index = map[string]*[2][]int{}
		add := func(key string, kind, i int) {
			e := w.index[key]
			if e == nil {
				e = &[2][]int{}
				w.index[key] = e
			}
			e[kind] = append(e[kind], i)
		}
		for i, p := range w.Pods {
			add("ns\x00"+p.Namespace, 0, i)
			for k, v := range p.Labels {
				add(k+"\x00"+v, 0, i)
			}
		}
		for i, v := range w.VMs {
			add("ns\x00"+v.Namespace, 1, i)
			for k, val := range v.Labels {
				add(k+"\x00"+val, 1, i)
			}
		}
	}
	var best *[2][]int
	count := func(e *[2][]int) int { return len(e[0]) + len(e[1]) }
	consider := func(key string) bool {
		e := w.index[key]
		if e == nil {
			best = &[2][]int{}
			return true // nothing has it: nothing is selected
		}
		if best == nil || count(e) < count(best) {
			best = e
		}
		return false
	}
	if pr.NamespaceSelector == nil && consider("ns\x00"+ns) {
		return nil, nil
	}
	if sel := pr.PodSelector; sel != nil {
		for k, v := range sel.MatchLabels {
			if consider(k + "\x00" + v) {
				return nil, nil
			}
		}
	}
	if best != nil {
		return best[0], best[1]
	}
	pods, vms = make([]int, len(w.Pods)), make([]int, len(w.VMs))
	for i := range pods {
		pods[i] = i
	}
	for i := range vms {
		vms[i] = i
	}
	return pods, vms
}

// ipBlock is b's CIDR less its exceptions, as prefixes.
func ipBlock(b *networkingv1.IPBlock) []netip.Prefix {
	p, err := netip.ParsePrefix(b.CIDR)
	if err != nil || !p.Addr().Is4() {
		return nil
	}
	out := []netip.Prefix{p.Masked()}
	for _, e := range b.Except {
		x, err := netip.ParsePrefix(e)
		if err != nil || !x.Addr().Is4() {
			continue
		}
		out = subtract(out, x.Masked())
	}
	return out
}

// subtract is ps less x: a prefix holding x splits into the halves that do not, down to x.
func subtract(ps []netip.Prefix, x netip.Prefix) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range ps {
		switch {
		case !p.Overlaps(x):
			out = append(out, p)
		case x.Bits() <= p.Bits(): // x holds p: all of it goes
		default:
			for p.Bits() < x.Bits() {
				a := p.Addr().As4()
				hiAddr := binary.BigEndian.Uint32(a[:]) | 1<<(31-p.Bits())
				lo := netip.PrefixFrom(p.Addr(), p.Bits()+1)
				hi := netip.PrefixFrom(netip.AddrFrom4([4]byte(binary.BigEndian.AppendUint32(nil, hiAddr))), p.Bits()+1)
				if lo.Contains(x.Addr()) {
					out, p = append(out, hi), lo
				} else {
					out, p = append(out, lo), hi
				}
			}
		}
	}
	return out
}

// portRange is a numbered port (with its endPort) or a whole protocol.
func portRange(p networkingv1.NetworkPolicyPort) (hostnet.PortRange, bool) {
	proto := protoNum(protocol(p.Protocol))
	if p.Port == nil {
		return hostnet.PortRange{Protocol: proto, From: 0, To: 65535}, true
	}
	from := p.Port.IntValue()
	if from < 1 || from > 65535 {
		return hostnet.PortRange{}, false
	}
	to := from
	if p.EndPort != nil {
		to = int(*p.EndPort)
		if to < from || to > 65535 {
			return hostnet.PortRange{}, false
		}
	}
	return hostnet.PortRange{Protocol: proto, From: uint16(from), To: uint16(to)}, true
}

func protocol(p *corev1.Protocol) corev1.Protocol {
	if p == nil || *p == "" {
		return corev1.ProtocolTCP
	}
	return *p
}

// protoNum is a protocol's IP number.
func protoNum(p corev1.Protocol) byte {
	switch p {
	case corev1.ProtocolUDP:
		return 17
	case corev1.ProtocolSCTP:
		return 132
	}
	return 6
}

// resolve is the number of the port named name with protocol proto, if ports has one.
func resolve(ports []NamedPort, name string, proto corev1.Protocol) (uint16, bool) {
	for _, p := range ports {
		if p.Name == name && protocol(&p.Protocol) == proto && p.Port > 0 && p.Port <= 65535 {
			return uint16(p.Port), true
		}
	}
	return 0, false
}

// matches says whether s selects l; a selector the API would refuse selects nothing. Each
// selector is parsed once per World.
func (w *World) matches(s *metav1.LabelSelector, l map[string]string) bool {
	sel, ok := w.selectors[s]
	if !ok {
		var err error
		if sel, err = metav1.LabelSelectorAsSelector(s); err != nil {
			sel = labels.Nothing()
		}
		if w.selectors == nil {
			w.selectors = map[*metav1.LabelSelector]labels.Selector{}
		}
		w.selectors[s] = sel
	}
	return sel.Matches(labels.Set(l))
}
