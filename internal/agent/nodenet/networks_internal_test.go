package nodenet

import (
	"net/netip"
	"reflect"
	"testing"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
)

// TestHostEgress: a network that says nothing reaches public addresses only; its allow and
// deny rules reach the node as prefixes and port ranges; internet Deny turns public egress off.
func TestHostEgress(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec *impv1.EgressSpec
		want hostnet.Egress
	}{
		{"unset", nil, hostnet.PublicEgress},
		{"empty", &impv1.EgressSpec{}, hostnet.Egress{Internet: true}},
		{"rules", &impv1.EgressSpec{Internet: impv1.EgressInternetDeny,
			Allow: []impv1.EgressRule{{CIDR: "10.20.0.0/16", Ports: []impv1.EgressPort{{Protocol: corev1.ProtocolTCP, Port: 5432}, {Protocol: corev1.ProtocolUDP, Port: 53, EndPort: ptr.To[int32](54)}}}},
			Deny:  []impv1.EgressRule{{CIDR: "198.51.100.0/24"}}},
			hostnet.Egress{
				Allow: []hostnet.EgressRule{{Prefix: netip.MustParsePrefix("10.20.0.0/16"), Ports: []hostnet.PortRange{{Protocol: unix.IPPROTO_TCP, From: 5432, To: 5432}, {Protocol: unix.IPPROTO_UDP, From: 53, To: 54}}}},
				Deny:  []hostnet.EgressRule{{Prefix: netip.MustParsePrefix("198.51.100.0/24")}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := hostEgress(tc.spec)
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Errorf("hostEgress = %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
	if _, err := hostEgress(&impv1.EgressSpec{Allow: []impv1.EgressRule{{CIDR: "fd00::/8"}}}); err == nil {
		t.Error("an IPv6 egress CIDR was accepted")
	}
}
