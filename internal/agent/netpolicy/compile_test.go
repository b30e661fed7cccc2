package netpolicy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
)

// flat writes allows as sorted lines "net|out PREFIX PROTO FROM-TO" (or "all"), one per
// peer prefix and port, so that two compilations compare as sets.
func flat(allows []hostnet.Allow) []string {
	if allows == nil {
		return nil
	}
	out := []string{}
	for _, a := range allows {
		ports := []string{"all"}
		if len(a.Ports) > 0 {
			ports = nil
			for _, p := range a.Ports {
				ports = append(ports, fmt.Sprintf("%d %d-%d", p.Protocol, p.From, p.To))
			}
		}
		for _, side := range []struct {
			word string
			ps   []netip.Prefix
		}{{"net", a.Network}, {"out", a.Outside}} {
			for _, p := range side.ps {
				for _, port := range ports {
					line := side.word + " " + p.String() + " " + port
					if !slices.Contains(out, line) {
						out = append(out, line)
					}
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

func sel(kv ...string) *metav1.LabelSelector {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return &metav1.LabelSelector{MatchLabels: m}
}

func policy(ns string, on *metav1.LabelSelector, types []networkingv1.PolicyType, in []networkingv1.NetworkPolicyIngressRule, out []networkingv1.NetworkPolicyEgressRule) *networkingv1.NetworkPolicy {
	return &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: fmt.Sprint("p", len(in), len(out))},
		Spec: networkingv1.NetworkPolicySpec{PodSelector: *on, PolicyTypes: types, Ingress: in, Egress: out}}
}

func tcp(port int) networkingv1.NetworkPolicyPort {
	return networkingv1.NetworkPolicyPort{Port: ptr.To(intstr.FromInt32(int32(port)))}
}

var (
	ingressOnly = []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}
	egressOnly  = []networkingv1.PolicyType{networkingv1.PolicyTypeEgress}
)

// world: namespaces x (team=a) and y (team=b); pods in each; VMs web (the target) and db on
// network x/net, a VM on network x/other, and a VM of y on y/net.
func world(ps ...*networkingv1.NetworkPolicy) (*World, VM) {
	web := VM{Namespace: "x", Name: "web", Labels: map[string]string{"app": "web"}, Network: "x/net", Address: netip.MustParseAddr("10.0.0.2"),
		Ports: []NamedPort{{Name: "http", Protocol: corev1.ProtocolTCP, Port: 8080}, {Name: "dns", Protocol: corev1.ProtocolUDP, Port: 53}}}
	w := &World{
		Policies:   ps,
		Namespaces: map[string]map[string]string{"x": {"team": "a"}, "y": {"team": "b"}},
		Pods: []Pod{
			{Namespace: "x", Labels: map[string]string{"app": "client"}, IPs: []netip.Addr{netip.MustParseAddr("192.168.1.1")},
				Ports: []NamedPort{{Name: "http", Protocol: corev1.ProtocolTCP, Port: 9000}}},
			{Namespace: "y", Labels: map[string]string{"app": "client"}, IPs: []netip.Addr{netip.MustParseAddr("192.168.2.1")},
				Ports: []NamedPort{{Name: "http", Protocol: corev1.ProtocolTCP, Port: 9001}}},
			{Namespace: "y", Labels: map[string]string{"app": "other"}, IPs: []netip.Addr{netip.MustParseAddr("192.168.2.2")}},
		},
		VMs: []VM{web,
			{Namespace: "x", Name: "db", Labels: map[string]string{"app": "client"}, Network: "x/net", Address: netip.MustParseAddr("10.0.0.3"),
				Ports: []NamedPort{{Name: "http", Protocol: corev1.ProtocolTCP, Port: 5432}}},
			{Namespace: "x", Name: "elsewhere", Labels: map[string]string{"app": "client"}, Network: "x/other", Address: netip.MustParseAddr("10.0.0.4")},
			{Namespace: "y", Name: "theirs", Labels: map[string]string{"app": "client"}, Network: "y/net", Address: netip.MustParseAddr("10.0.0.5")},
		},
	}
	return w, web
}

// TestCompile: the NetworkPolicy API's semantics for a VM, case by case, as sig-network's
// conformance cases state them for a pod.
func TestCompile(t *testing.T) {
	from := func(peers ...networkingv1.NetworkPolicyPeer) []networkingv1.NetworkPolicyIngressRule {
		return []networkingv1.NetworkPolicyIngressRule{{From: peers}}
	}
	for _, tc := range []struct {
		name    string
		ps      []*networkingv1.NetworkPolicy
		in, out []string // nil: not isolated
	}{
		{name: "no policy"},
		{name: "a policy of another namespace", ps: []*networkingv1.NetworkPolicy{policy("y", sel(), ingressOnly, nil, nil)}},
		{name: "a policy selecting other VMs", ps: []*networkingv1.NetworkPolicy{policy("x", sel("app", "db"), ingressOnly, nil, nil)}},
		{name: "default deny ingress", ps: []*networkingv1.NetworkPolicy{policy("x", sel(), ingressOnly, nil, nil)}, in: []string{}},
		{name: "default deny egress", ps: []*networkingv1.NetworkPolicy{policy("x", sel(), egressOnly, nil, nil)}, out: []string{}},
		{name: "types defaulted from the rules", ps: []*networkingv1.NetworkPolicy{policy("x", sel("app", "web"), nil, nil,
			[]networkingv1.NetworkPolicyEgressRule{{}})},
			in: []string{}, out: []string{"net 0.0.0.0/0 all", "out 0.0.0.0/0 all"}},
		{name: "allow all ingress", ps: []*networkingv1.NetworkPolicy{policy("x", sel(), ingressOnly, []networkingv1.NetworkPolicyIngressRule{{}}, nil)},
			in: []string{"net 0.0.0.0/0 all", "out 0.0.0.0/0 all"}},
		{name: "from a pod label: the policy's namespace only, pods and VMs of the network",
			ps: []*networkingv1.NetworkPolicy{policy("x", sel(), ingressOnly, from(networkingv1.NetworkPolicyPeer{PodSelector: sel("app", "client")}), nil)},
			in: []string{"net 10.0.0.3/32 all", "out 192.168.1.1/32 all"}},
		{name: "from a namespace: every pod and VM of it",
			ps: []*networkingv1.NetworkPolicy{policy("x", sel(), ingressOnly, from(networkingv1.NetworkPolicyPeer{NamespaceSelector: sel("team", "b")}), nil)},
			in: []string{"out 192.168.2.1/32 all", "out 192.168.2.2/32 all"}},
		{name: "from every namespace",
			ps: []*networkingv1.NetworkPolicy{policy("x", sel(), ingressOnly, from(networkingv1.NetworkPolicyPeer{NamespaceSelector: sel()}), nil)},
			in: []string{"net 10.0.0.2/32 all", "net 10.0.0.3/32 all", "out 192.168.1.1/32 all", "out 192.168.2.1/32 all", "out 192.168.2.2/32 all"}},
		{name: "both selectors: the pods of those namespaces with the label",
			ps: []*networkingv1.NetworkPolicy{policy("x", sel(), ingressOnly, from(networkingv1.NetworkPolicyPeer{NamespaceSelector: sel("team", "b"), PodSelector: sel("app", "client")}), nil)},
			in: []string{"out 192.168.2.1/32 all"}},
		{name: "ipBlock with except",
			ps: []*networkingv1.NetworkPolicy{policy("x", sel(), ingressOnly, from(networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: "192.168.0.0/16", Except: []string{"192.168.2.0/24"}}}), nil)},
			in: []string{"net 192.168.0.0/23 all", "net 192.168.128.0/17 all", "net 192.168.16.0/20 all", "net 192.168.3.0/24 all", "net 192.168.32.0/19 all", "net 192.168.4.0/22 all", "net 192.168.64.0/18 all", "net 192.168.8.0/21 all",
				"out 192.168.0.0/23 all", "out 192.168.128.0/17 all", "out 192.168.16.0/20 all", "out 192.168.3.0/24 all", "out 192.168.32.0/19 all", "out 192.168.4.0/22 all", "out 192.168.64.0/18 all", "out 192.168.8.0/21 all"}},
		{name: "ports: a number, a range, a whole protocol, a named port of the VM's",
			ps: []*networkingv1.NetworkPolicy{policy("x", sel(), ingressOnly, []networkingv1.NetworkPolicyIngressRule{{
				From: []networkingv1.NetworkPolicyPeer{{PodSelector: sel("app", "client")}},
				Ports: []networkingv1.NetworkPolicyPort{tcp(80), {Port: ptr.To(intstr.FromInt32(1000)), EndPort: ptr.To[int32](2000)},
					{Protocol: ptr.To(corev1.ProtocolSCTP)}, {Protocol: ptr.To(corev1.ProtocolUDP), Port: ptr.To(intstr.FromString("dns"))},
					{Port: ptr.To(intstr.FromString("dns"))}, // TCP: the VM's dns is UDP
				}}}, nil)},
			in: []string{"net 10.0.0.3/32 132 0-65535", "net 10.0.0.3/32 17 53-53", "net 10.0.0.3/32 6 1000-2000", "net 10.0.0.3/32 6 80-80",
				"out 192.168.1.1/32 132 0-65535", "out 192.168.1.1/32 17 53-53", "out 192.168.1.1/32 6 1000-2000", "out 192.168.1.1/32 6 80-80"}},
		{name: "egress to a named port: each peer's own number; an ipBlock has none",
			ps: []*networkingv1.NetworkPolicy{policy("x", sel(), egressOnly, nil, []networkingv1.NetworkPolicyEgressRule{{
				To:    []networkingv1.NetworkPolicyPeer{{NamespaceSelector: sel(), PodSelector: sel("app", "client")}, {IPBlock: &networkingv1.IPBlock{CIDR: "8.8.8.8/32"}}},
				Ports: []networkingv1.NetworkPolicyPort{{Port: ptr.To(intstr.FromString("http"))}},
			}})},
			out: []string{"net 10.0.0.3/32 6 5432-5432", "out 192.168.1.1/32 6 9000-9000", "out 192.168.2.1/32 6 9001-9001"}},
		{name: "two policies add up, each with its own types",
			ps: []*networkingv1.NetworkPolicy{
				policy("x", sel("app", "web"), ingressOnly, from(networkingv1.NetworkPolicyPeer{PodSelector: sel("app", "client")}), nil),
				policy("x", sel(), []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress},
					[]networkingv1.NetworkPolicyIngressRule{{Ports: []networkingv1.NetworkPolicyPort{tcp(443)}}}, nil),
			},
			in:  []string{"net 0.0.0.0/0 6 443-443", "net 10.0.0.3/32 all", "out 0.0.0.0/0 6 443-443", "out 192.168.1.1/32 all"},
			out: []string{}},
		{name: "a selector that selects nothing selects no peer",
			ps: []*networkingv1.NetworkPolicy{policy("x", sel(), ingressOnly, from(networkingv1.NetworkPolicyPeer{PodSelector: sel("app", "nobody")}), nil)},
			in: []string{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, web := world(tc.ps...)
			got := w.Compile(web)
			if g := flat(got.Ingress); !slices.Equal(g, tc.in) || (g == nil) != (tc.in == nil) {
				t.Errorf("ingress:\n got %s\nwant %s", show(g), show(tc.in))
			}
			if g := flat(got.Egress); !slices.Equal(g, tc.out) || (g == nil) != (tc.out == nil) {
				t.Errorf("egress:\n got %s\nwant %s", show(g), show(tc.out))
			}
		})
	}
}

func show(s []string) string {
	if s == nil {
		return "not isolated"
	}
	return "[" + strings.Join(s, ", ") + "]"
}

// TestSubtract: a CIDR less exceptions inside it, at its edges, or holding it.
func TestSubtract(t *testing.T) {
	for _, tc := range []struct {
		cidr   string
		except []string
		want   []string
	}{
		{"10.0.0.0/24", nil, []string{"10.0.0.0/24"}},
		{"10.0.0.0/24", []string{"10.0.0.0/25"}, []string{"10.0.0.128/25"}},
		{"10.0.0.0/24", []string{"10.0.0.255/32"}, []string{"10.0.0.0/25", "10.0.0.128/26", "10.0.0.192/27", "10.0.0.224/28", "10.0.0.240/29", "10.0.0.248/30", "10.0.0.252/31", "10.0.0.254/32"}},
		{"10.0.0.0/24", []string{"10.0.0.0/8"}, nil},
		{"10.0.0.0/24", []string{"11.0.0.0/8"}, []string{"10.0.0.0/24"}},
		{"0.0.0.0/0", []string{"10.0.0.0/8", "192.168.0.0/16"}, nil}, // checked by count below
	} {
		got := ipBlock(&networkingv1.IPBlock{CIDR: tc.cidr, Except: tc.except})
		var s []string
		for _, p := range got {
			s = append(s, p.String())
		}
		slices.Sort(s)
		if tc.cidr == "0.0.0.0/0" {
			for _, p := range got {
				for _, x := range tc.except {
					if p.Overlaps(netip.MustParsePrefix(x)) {
						t.Errorf("%s less %v keeps %s", tc.cidr, tc.except, p)
					}
				}
			}
			if len(got) != 7+15 { // 0/0 less a /8: 8 prefixes; one of them less a /16: 15 more
				t.Errorf("%s less %v: %d prefixes %v", tc.cidr, tc.except, len(got), s)
			}
			continue
		}
		slices.Sort(tc.want)
		if !slices.Equal(s, tc.want) {
			t.Errorf("%s less %v = %v, want %v", tc.cidr, tc.except, s, tc.want)
		}
	}
}

// TestServices: a VM isolated for egress reaches a Service's ClusterIP on a port only when one
// of its allows lets it reach every ready endpoint of that port (kube-proxy picks one after
// the VM's egress is checked); a Service with an endpoint it may not reach, or none, is not
// opened; a VM not isolated for egress needs none of this.
func TestServices(t *testing.T) {
	udp := corev1.ProtocolUDP
	toClients := policy("x", sel(), egressOnly, nil, []networkingv1.NetworkPolicyEgressRule{{
		To:    []networkingv1.NetworkPolicyPeer{{NamespaceSelector: sel(), PodSelector: sel("app", "client")}},
		Ports: []networkingv1.NetworkPolicyPort{{Protocol: &udp, Port: ptr.To(intstr.FromInt32(53))}, tcp(9000)},
	}})
	w, web := world(toClients)
	w.Services = []Service{
		{Namespace: "y", Name: "dns", ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")}, Ports: []ServicePort{
			{Protocol: udp, Port: 53, Endpoints: []netip.AddrPort{netip.MustParseAddrPort("192.168.1.1:53"), netip.MustParseAddrPort("192.168.2.1:53")}},
			{Protocol: corev1.ProtocolTCP, Port: 53, Endpoints: []netip.AddrPort{netip.MustParseAddrPort("192.168.1.1:53")}}, // TCP 53 not allowed
		}},
		{Namespace: "x", Name: "web", ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.20")}, Ports: []ServicePort{
			{Protocol: corev1.ProtocolTCP, Port: 80, Endpoints: []netip.AddrPort{netip.MustParseAddrPort("192.168.1.1:9000")}},
		}},
		{Namespace: "y", Name: "mixed", ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.30")}, Ports: []ServicePort{
			{Protocol: corev1.ProtocolTCP, Port: 80, Endpoints: []netip.AddrPort{netip.MustParseAddrPort("192.168.1.1:9000"), netip.MustParseAddrPort("192.168.2.2:9000")}},
		}},
		{Namespace: "y", Name: "empty", ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.40")}, Ports: []ServicePort{{Protocol: udp, Port: 53}}},
	}
	got := flat(w.Compile(web).Egress)
	for _, want := range []string{"out 10.96.0.10/32 17 53-53", "out 10.96.0.20/32 6 80-80"} {
		if !slices.Contains(got, want) {
			t.Errorf("egress %v lacks %s", got, want)
		}
	}
	for _, l := range got {
		for _, not := range []string{"10.96.0.10/32 6 ", "10.96.0.30", "10.96.0.40"} {
			if strings.Contains(l, not) {
				t.Errorf("egress opened %s", l)
			}
		}
	}
	w2, web2 := world()
	w2.Services = w.Services
	if p := w2.Compile(web2); p.Egress != nil {
		t.Errorf("a VM no policy selects is isolated for egress: %v", flat(p.Egress))
	}
}
