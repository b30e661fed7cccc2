package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// VMReference names an ImpVM of the same namespace, and which one by UID.
type VMReference struct {
	// name of the ImpVM.
	Name string `json:"name"`
	// uid of the ImpVM.
	UID types.UID `json:"uid"`
}

// ImpIPAddressSpec says which VM holds which address of which network, and on which node it
// runs.
// +kubebuilder:validation:XValidation:rule="self.network == oldSelf.network && self.address == oldSelf.address && self.vmRef == oldSelf.vmRef",message="an ImpIPAddress's network, address and vmRef are immutable"
type ImpIPAddressSpec struct {
	// network is the ImpNetwork the address belongs to.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	Network string `json:"network"`
	// address is the IPv4 address.
	// +kubebuilder:validation:MaxLength=15
	// +kubebuilder:validation:XValidation:rule="isIP(self) && ip(self).family() == 4",message="address must be an IPv4 address"
	Address string `json:"address"`
	// vmRef is the VM holding the address.
	VMRef VMReference `json:"vmRef"`
	// nodeName is the node the VM is placed on, set by the operator as it places the VM and
	// changed only when the VM moves: each node's agent routes the network's overlay from
	// these, and so hears of a VM of another node only when its address or node changes.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	NodeName string `json:"nodeName,omitempty"`
	// vmLabels are the VM's labels, kept by the operator: NetworkPolicies select the VM as a
	// peer by them, on every node, without any node hearing of the VM's status changes.
	// +optional
	VMLabels map[string]string `json:"vmLabels,omitempty"`
	// vmPorts are the VM's named ports (spec.ports with a name), kept by the operator: a
	// NetworkPolicy's egress rule may name them.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=64
	VMPorts []VMPort `json:"vmPorts,omitempty"`
}

// ImpIPAddress records that one VM holds one address of an ImpNetwork. The operator creates it
// when it allocates the address and deletes it when the VM is gone. Its name is
// "<network>.<address>", so the API server itself refuses a second holder of an address.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:shortName=impip,categories=imp
// +kubebuilder:printcolumn:name="Network",type=string,JSONPath=`.spec.network`
// +kubebuilder:printcolumn:name="Address",type=string,JSONPath=`.spec.address`
// +kubebuilder:printcolumn:name="VM",type=string,JSONPath=`.spec.vmRef.name`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.nodeName`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImpIPAddress struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec ImpIPAddressSpec `json:"spec"`
}

// ImpIPAddressList is a list of ImpIPAddresses.
//
// +kubebuilder:object:root=true
type ImpIPAddressList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpIPAddress `json:"items"`
}

// NamedPorts are the ports of ps with a name, as an ImpIPAddress carries them.
func NamedPorts(ps []VMPort) []VMPort {
	var out []VMPort
	for _, p := range ps {
		if p.Name != "" {
			out = append(out, p)
		}
	}
	return out
}

// IPAddressName is the name of the ImpIPAddress of address on network.
func IPAddressName(network, address string) string { return network + "." + address }

func init() {
	SchemeBuilder.Register(&ImpIPAddress{}, &ImpIPAddressList{})
}
