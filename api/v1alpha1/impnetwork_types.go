package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// NATSpec configures egress address translation.
type NATSpec struct {
	// enabled masquerades the network's traffic out of each node's uplink, so VMs reach
	// addresses beyond the cluster with their node's address.
	// +optional
	// +kubebuilder:default=false
	Enabled bool `json:"enabled"`
}

// Egress policies of a network's NAT egress (spec.egress.internet).
const (
	// EgressInternetAllow: VMs reach public addresses.
	EgressInternetAllow = "Allow"
	// EgressInternetDeny: VMs reach only what spec.egress.allow lists.
	EgressInternetDeny = "Deny"
)

// EgressSpec says where the VMs of a network with NAT may connect outside it. In order, first
// match wins: the cluster's denied CIDRs (network.egressDeniedCIDRs), link-local addresses
// and the overlay ports of every node (UDP 4789, 6081, 8472 and the agents' VXLAN port) are
// never reached; then deny; then allow; then public addresses when internet is Allow;
// everything else is dropped. Public addresses are all but 0.0.0.0/8, 10.0.0.0/8,
// 100.64.0.0/10, 127.0.0.0/8, 169.254.0.0/16, 172.16.0.0/12, 192.0.0.0/24, 192.168.0.0/16,
// 198.18.0.0/15, 224.0.0.0/4 and 240.0.0.0/4: the private, shared, loopback, link-local,
// benchmarking, multicast and reserved ranges, where a cluster's nodes, pods, services and
// neighbours live. A network without NAT has no egress at all.
type EgressSpec struct {
	// internet: Allow (the default) lets VMs reach public addresses; Deny reaches only what
	// allow lists.
	// +optional
	// +kubebuilder:validation:Enum=Allow;Deny
	// +kubebuilder:default=Allow
	Internet string `json:"internet,omitempty"`

	// allow lists destinations reached beyond public addresses (a database on a private
	// range, another network of the data centre), or with internet Deny, the only ones. The
	// cluster's denied CIDRs win over it.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=32
	Allow []EgressRule `json:"allow,omitempty"`

	// deny lists destinations never reached, public or allowed.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=32
	Deny []EgressRule `json:"deny,omitempty"`

	// domains, when set, are the only names the VMs reach over HTTP and HTTPS: every TCP
	// connection to port 80 or 443 outside the network goes through the node's egress proxy,
	// which lets it out only when the request's Host or the TLS server name (SNI) is one of
	// these — an exact name (api.github.com) or one leading wildcard label (*.pypi.org:
	// files.pypi.org, not pypi.org) — resolves the name itself with the node's resolver, and
	// refuses, with a reset, a name that resolves to an address these rules would not let out
	// (private ranges unless allowed, the node, link-local, the cluster's denied ranges). Other
	// ports follow internet, allow and deny. Needs nat.enabled.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=64
	// +kubebuilder:validation:items:MaxLength=253
	// +kubebuilder:validation:items:Pattern=`^(\*\.)?([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)*[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	Domains []string `json:"domains,omitempty"`
}

// EgressRule is a destination: an IPv4 CIDR, and optionally ports.
type EgressRule struct {
	// cidr is an IPv4 range in canonical form, such as 10.20.0.0/16 or 192.0.2.7/32.
	// +required
	// +kubebuilder:validation:MinLength=9
	// +kubebuilder:validation:MaxLength=18
	// +kubebuilder:validation:XValidation:rule="isCIDR(self) && cidr(self).ip().family() == 4",message="cidr must be an IPv4 CIDR such as 10.20.0.0/16"
	// +kubebuilder:validation:XValidation:rule="!isCIDR(self) || cidr(self) == cidr(self).masked()",message="cidr must be a network address with no host bits set, such as 10.20.0.0/16"
	CIDR string `json:"cidr"`

	// ports the rule applies to; empty: every port and protocol (ICMP included).
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=16
	Ports []EgressPort `json:"ports,omitempty"`
}

// EgressPort is a port, or a range of ports, of TCP or UDP.
//
// +kubebuilder:validation:XValidation:rule="!has(self.endPort) || self.endPort >= self.port",message="endPort must not be below port",fieldPath=".endPort"
type EgressPort struct {
	// protocol: TCP (the default) or UDP.
	// +optional
	// +kubebuilder:validation:Enum=TCP;UDP
	// +kubebuilder:default=TCP
	Protocol corev1.Protocol `json:"protocol,omitempty"`

	// port is the destination port, or the first of a range.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65535
	Port int32 `json:"port"`

	// endPort, when set, makes the rule a range from port to endPort.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65535
	EndPort *int32 `json:"endPort,omitempty"`
}

// DNSSpec is the resolver configuration written into the VMs of a network.
type DNSSpec struct {
	// nameservers are IPv4 addresses of resolvers.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=3
	// +kubebuilder:validation:items:MaxLength=15
	// +kubebuilder:validation:items:XValidation:rule="isIP(self) && ip(self).family() == 4",message="each nameserver must be an IPv4 address"
	Nameservers []string `json:"nameservers,omitempty"`

	// searches are DNS search domains.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=6
	// +kubebuilder:validation:items:MaxLength=253
	// +kubebuilder:validation:items:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\.?$`
	Searches []string `json:"searches,omitempty"`
}

// ImpNetworkSpec is an IPv4 network for VMs: a CIDR, its gateway, NAT egress and DNS.
//
// IPv4 only in v1alpha1: the node plumbing (bridge gateway, NAT, VXLAN forwarding) is IPv4.
//
// +kubebuilder:validation:XValidation:rule="!has(self.gateway) || !isCIDR(self.cidr) || !isIP(self.gateway) || cidr(self.cidr).containsIP(self.gateway)",message="gateway must be inside cidr",fieldPath=".gateway"
// +kubebuilder:validation:XValidation:rule="!has(self.gateway) || !isCIDR(self.cidr) || !isIP(self.gateway) || self.gateway != string(cidr(self.cidr).ip())",message="gateway must not be the network address of cidr",fieldPath=".gateway"
// +kubebuilder:validation:XValidation:rule="!has(self.egress) || !has(self.egress.domains) || size(self.egress.domains) == 0 || (has(self.nat) && self.nat.enabled)",message="egress.domains needs nat.enabled: a network without NAT has no egress",fieldPath=".egress.domains"
type ImpNetworkSpec struct {
	// cidr is the network's IPv4 range in canonical form, such as 10.100.0.0/24, from /8 to /30.
	// It must not overlap 0.0.0.0/8, loopback, link-local, multicast or 240.0.0.0/4, nor a
	// range the cluster reserves (network.reservedCIDRs). Networks with the same CIDR may
	// coexist, on the same nodes too: each node keeps every network in a network namespace of
	// its own. It cannot change while any address of it is allocated.
	// +required
	// +kubebuilder:validation:MinLength=9
	// +kubebuilder:validation:MaxLength=18
	// +kubebuilder:validation:XValidation:rule="isCIDR(self) && cidr(self).ip().family() == 4",message="cidr must be an IPv4 CIDR such as 10.100.0.0/24"
	// +kubebuilder:validation:XValidation:rule="!isCIDR(self) || cidr(self) == cidr(self).masked()",message="cidr must be a network address with no host bits set, such as 10.100.0.0/24"
	// +kubebuilder:validation:XValidation:rule="!isCIDR(self) || (cidr(self).prefixLength() >= 8 && cidr(self).prefixLength() <= 30)",message="cidr prefix length must be between /8 and /30"
	// +kubebuilder:validation:XValidation:rule="!isCIDR(self) || !['0.0.0.0/8', '127.0.0.0/8', '169.254.0.0/16', '224.0.0.0/4', '240.0.0.0/4'].exists(r, cidr(r).containsCIDR(cidr(self)) || cidr(self).containsCIDR(cidr(r)))",message="cidr must not overlap 0.0.0.0/8, loopback (127.0.0.0/8), link-local (169.254.0.0/16), multicast (224.0.0.0/4) or reserved (240.0.0.0/4) addresses"
	CIDR string `json:"cidr"`

	// gateway is the address the nodes' bridges hold on this network; VMs route through it.
	// Defaults to the first host address of cidr. It cannot change while any address of the
	// network is allocated.
	// +optional
	// +kubebuilder:validation:MaxLength=15
	// +kubebuilder:validation:XValidation:rule="isIP(self) && ip(self).family() == 4",message="gateway must be an IPv4 address"
	Gateway string `json:"gateway,omitempty"`

	// nat configures egress to addresses outside the network.
	// +optional
	NAT NATSpec `json:"nat,omitempty"`

	// egress says where the VMs may connect through NAT: by default public addresses only,
	// never the cluster's nodes, pods or private ranges (see EgressSpec).
	// +optional
	Egress *EgressSpec `json:"egress,omitempty"`

	// dns is the resolver configuration of the network's VMs.
	// +optional
	DNS *DNSSpec `json:"dns,omitempty"`
}

// ImpNetworkStatus is the observed state of an ImpNetwork.
type ImpNetworkStatus struct {
	// observedGeneration is the spec generation the status was last computed for.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// gateway is the gateway in effect (spec.gateway or the first host address).
	// +optional
	Gateway string `json:"gateway,omitempty"`

	// allocated counts addresses held by VMs.
	// +optional
	Allocated int32 `json:"allocated,omitempty"`

	// free counts addresses VMs can still get (network, gateway and broadcast excluded).
	// +optional
	Free int32 `json:"free,omitempty"`

	// vni is the VXLAN network identifier of the network's overlay between nodes, assigned
	// once by the operator and unique in the cluster.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=16777215
	VNI int32 `json:"vni,omitempty"`

	// conditions: Ready (the spec is usable and addresses remain) and NodesReady (every node
	// with VMs of the network has plumbed it); reasons are documented in conditions.go.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// ImpNetwork is an IPv4 network that ImpVMs of its namespace attach to, on any node.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=impnet,categories=imp
// +kubebuilder:validation:XValidation:rule="self.metadata.name.size() <= 63 && !self.metadata.name.contains('.')",message="an ImpNetwork's name must be a DNS label: at most 63 characters, no dots"
// +kubebuilder:validation:XValidation:rule="!has(oldSelf.status) || !has(oldSelf.status.allocated) || oldSelf.status.allocated == 0 || self.spec.cidr == oldSelf.spec.cidr",message="spec.cidr cannot change while addresses of the network are allocated"
// +kubebuilder:validation:XValidation:rule="!has(oldSelf.status) || !has(oldSelf.status.allocated) || oldSelf.status.allocated == 0 || (has(self.spec.gateway) == has(oldSelf.spec.gateway) && (!has(self.spec.gateway) || self.spec.gateway == oldSelf.spec.gateway))",message="spec.gateway cannot change while addresses of the network are allocated"
// +kubebuilder:printcolumn:name="CIDR",type=string,JSONPath=`.spec.cidr`
// +kubebuilder:printcolumn:name="Gateway",type=string,JSONPath=`.status.gateway`
// +kubebuilder:printcolumn:name="NAT",type=boolean,JSONPath=`.spec.nat.enabled`
// +kubebuilder:printcolumn:name="Allocated",type=integer,JSONPath=`.status.allocated`
// +kubebuilder:printcolumn:name="Free",type=integer,JSONPath=`.status.free`
// +kubebuilder:printcolumn:name="VNI",type=integer,JSONPath=`.status.vni`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImpNetwork struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec ImpNetworkSpec `json:"spec"`
	// +optional
	Status ImpNetworkStatus `json:"status,omitempty"`
}

// ImpNetworkList is a list of ImpNetworks.
//
// +kubebuilder:object:root=true
type ImpNetworkList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpNetwork `json:"items"`
}

func init() {
	SchemeBuilder.Register(&ImpNetwork{}, &ImpNetworkList{})
}
