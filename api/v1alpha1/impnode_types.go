package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// NodeResources are vCPUs, memory and disk of a node.
type NodeResources struct {
	// vcpus is a number of virtual CPUs.
	// +kubebuilder:validation:Minimum=0
	VCPUs int32 `json:"vcpus"`
	// memory is an amount of memory.
	Memory resource.Quantity `json:"memory"`
	// disk is space of the file system holding the agent's state (VMs' writable disks). A
	// report without it (an older agent) bounds no VM's disk.
	// +optional
	Disk *resource.Quantity `json:"disk,omitempty"`
}

// NodeImages is what a node holds of VM images on its state file system, beside the VMs'
// disks: allocatable.disk leaves it out.
type NodeImages struct {
	// disks is the number of base disks (one per image digest).
	// +kubebuilder:validation:Minimum=0
	Disks int32 `json:"disks"`
	// bytes the base disks take, in whole MiB.
	Bytes resource.Quantity `json:"bytes"`
	// builds of base disks in progress.
	// +kubebuilder:validation:Minimum=0
	Builds int32 `json:"builds"`
}

// VMMCapability is a VMM a node can run.
type VMMCapability struct {
	// kind of the VMM.
	Kind VMMKind `json:"kind"`
	// acceleration is kvm or tcg (software emulation, QEMU only).
	// +kubebuilder:validation:Enum=kvm;tcg
	Acceleration string `json:"acceleration"`
	// version the VMM reports.
	// +optional
	Version string `json:"version,omitempty"`
	// guestCPU names the CPU the VMM gives its guests on this node: "tcg:max" under TCG
	// (QEMU's own model, whatever the host's), "host:" and a hash of the host CPU's model and
	// flags under KVM (the host's CPU, passed through). A running guest moves only to a node
	// whose VMM of its kind gives the same CPU, at the same version and acceleration: its
	// state holds what the CPU it booted on offered.
	// +optional
	// +kubebuilder:validation:MaxLength=80
	GuestCPU string `json:"guestCPU,omitempty"`
	// memoryOverhead is the memory one VMM process of this kind holds beyond its guest's RAM
	// (device emulation, its own code and buffers). Placement counts it with every VM.
	// +optional
	MemoryOverhead *resource.Quantity `json:"memoryOverhead,omitempty"`
}

// Artifact identifies a file the agent boots guests with.
type Artifact struct {
	// path on the host.
	Path string `json:"path"`
	// sha256 of the file's content, hex.
	// +optional
	SHA256 string `json:"sha256,omitempty"`
}

// ImpNodeSpec is what the operator assigns a node.
type ImpNodeSpec struct {
	// endpointCIDR is the node's block of endpoint addresses, from the operator's
	// --endpoint-cidr: each VM on the node that declares ports gets one, which the Services
	// selecting the VM reach it at (status.runtime.endpoint). Set once by the operator.
	// +optional
	// +kubebuilder:validation:MaxLength=18
	// +kubebuilder:validation:XValidation:rule="isCIDR(self) && cidr(self).ip().family() == 4 && cidr(self) == cidr(self).masked()",message="endpointCIDR must be an IPv4 CIDR without host bits"
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="endpointCIDR is set once"
	EndpointCIDR string `json:"endpointCIDR,omitempty"`
}

// ImpNodeStatus is what a node's agent reports about the node.
type ImpNodeStatus struct {
	// capacity is the node's total vCPUs and memory.
	// +optional
	Capacity *NodeResources `json:"capacity,omitempty"`
	// allocatable is what VMs may use, after the agent's configured reserve. The operator places
	// VMs against allocatable minus what VMs placed on the node hold.
	// +optional
	Allocatable *NodeResources `json:"allocatable,omitempty"`
	// vmms the node can run, best first.
	// +optional
	// +listType=atomic
	VMMs []VMMCapability `json:"vmms,omitempty"`
	// kernel the node boots guests with.
	// +optional
	Kernel *Artifact `json:"kernel,omitempty"`
	// initramfs the node boots guests with.
	// +optional
	Initramfs *Artifact `json:"initramfs,omitempty"`
	// overlayAddress is the node's underlay address: other nodes send VXLAN traffic for this
	// node's VMs to it. Empty when the node takes no part in the overlay.
	// +optional
	// +kubebuilder:validation:MaxLength=15
	OverlayAddress string `json:"overlayAddress,omitempty"`

	// migrationEndpoint is where the node's agent takes the migrations of VMs moving to it
	// (host:port, mutually authenticated TLS with the agents' certificates): the source's agent
	// connects there, and checks that the agent answering is this node's.
	// +optional
	// +kubebuilder:validation:MaxLength=261
	MigrationEndpoint string `json:"migrationEndpoint,omitempty"`
	// networks are the ImpNetworks plumbed on the node (bridge, overlay, rules), each with
	// whether that worked.
	// +optional
	// +listType=atomic
	Networks []NodeNetwork `json:"networks,omitempty"`
	// images is what the node holds of VM images: base disks, and builds in progress.
	// +optional
	Images *NodeImages `json:"images,omitempty"`
	// agentVersion is the version of the node's agent.
	// +optional
	AgentVersion string `json:"agentVersion,omitempty"`
	// heartbeatTime is when the agent last refreshed this report.
	// +optional
	HeartbeatTime *metav1.Time `json:"heartbeatTime,omitempty"`
	// conditions: Ready.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// features are what the node's agent can do beyond running VMs, for the operator to ask
	// only of nodes that can (an agent upgraded node by node): WarmHandover.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=32
	// +kubebuilder:validation:items:MaxLength=63
	Features []string `json:"features,omitempty"`
}

// FeatureWarmHandover: the agent hands a running warm pool member to a claim (the member's
// guest takes the claim's identity). The operator binds claims to members on such nodes only.
const FeatureWarmHandover = "WarmHandover"

// HasFeature is true when the node's agent reports feature.
func (n *ImpNode) HasFeature(feature string) bool {
	for _, f := range n.Status.Features {
		if f == feature {
			return true
		}
	}
	return false
}

// NodeNetwork is one ImpNetwork as a node plumbs it.
type NodeNetwork struct {
	// namespace of the ImpNetwork.
	Namespace string `json:"namespace"`
	// name of the ImpNetwork.
	Name string `json:"name"`
	// ready is true when the node's bridge, overlay and rules for the network are in place.
	Ready bool `json:"ready"`
	// message says what failed when not ready.
	// +optional
	Message string `json:"message,omitempty"`
}

// ImpNode is a node's agent's report of what the node offers VMs. It has the node's name; its
// status is written only by that node's agent, its spec only by the operator.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Cluster,categories=imp
// +kubebuilder:printcolumn:name="VCPUs",type=integer,JSONPath=`.status.allocatable.vcpus`
// +kubebuilder:printcolumn:name="Memory",type=string,JSONPath=`.status.allocatable.memory`
// +kubebuilder:printcolumn:name="VMM",type=string,JSONPath=`.status.vmms[0].kind`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Endpoints",type=string,JSONPath=`.spec.endpointCIDR`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImpNode struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +optional
	Spec ImpNodeSpec `json:"spec,omitempty"`

	// +optional
	Status ImpNodeStatus `json:"status,omitempty"`
}

// ImpNodeList is a list of ImpNodes.
//
// +kubebuilder:object:root=true
type ImpNodeList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpNode `json:"items"`
}

func init() {
	SchemeBuilder.Register(&ImpNode{}, &ImpNodeList{})
}
