package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// QuotaResources are amounts an ImpQuota bounds or reports; an unset field is not bounded.
type QuotaResources struct {
	// vms counts the VMs that hold a placement (placed and not Succeeded or Failed).
	// +optional
	// +kubebuilder:validation:Minimum=0
	VMs *int32 `json:"vms,omitempty"`
	// vcpus of those VMs.
	// +optional
	// +kubebuilder:validation:Minimum=0
	VCPUs *int32 `json:"vcpus,omitempty"`
	// memory of those VMs' guests.
	// +optional
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('0')) >= 0",message="memory must not be negative"
	Memory *resource.Quantity `json:"memory,omitempty"`
	// disk is the writable disks' size (diskSize) of those VMs.
	// +optional
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('0')) >= 0",message="disk must not be negative"
	Disk *resource.Quantity `json:"disk,omitempty"`
	// suspendedMemory is the memory of those VMs that are suspended or being suspended: a
	// suspended VM keeps its node's memory for its resume.
	// +optional
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('0')) >= 0",message="suspendedMemory must not be negative"
	SuspendedMemory *resource.Quantity `json:"suspendedMemory,omitempty"`
	// snapshots is the number of ImpVMSnapshots of the namespace that hold files on a node, or
	// are being taken (a Failed one holds nothing).
	// +optional
	// +kubebuilder:validation:Minimum=0
	Snapshots *int32 `json:"snapshots,omitempty"`
	// snapshotStorage is the space those snapshots take on their nodes: a snapshot taken counts
	// its size, one being taken its VM's memory and disk size (what it may take at most).
	// +optional
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('0')) >= 0",message="snapshotStorage must not be negative"
	SnapshotStorage *resource.Quantity `json:"snapshotStorage,omitempty"`
}

// PerVMBounds bound the size of each VM of a namespace.
type PerVMBounds struct {
	// vcpus of one VM at most.
	// +optional
	// +kubebuilder:validation:Minimum=1
	VCPUs *int32 `json:"vcpus,omitempty"`
	// memory of one VM at most.
	// +optional
	Memory *resource.Quantity `json:"memory,omitempty"`
	// disk (diskSize) of one VM at most.
	// +optional
	Disk *resource.Quantity `json:"disk,omitempty"`
}

// ImpQuotaSpec is what the VMs of a namespace may hold together, and how large one may be.
type ImpQuotaSpec struct {
	// hard bounds the sum over the namespace's VMs that hold a placement.
	// +optional
	Hard QuotaResources `json:"hard,omitempty"`
	// perVM bounds each VM's size.
	// +optional
	PerVM *PerVMBounds `json:"perVM,omitempty"`
	// allowedClasses, when set, are the only ImpVMClasses the namespace's VMs may name; VMs
	// sized inline are still bounded by perVM.
	// +optional
	// +listType=set
	AllowedClasses []string `json:"allowedClasses,omitempty"`
}

// QuotaSummary is used/hard for the printer columns ("6/8", "6Gi/8Gi"; "6" when unbounded).
type QuotaSummary struct {
	VMs    string `json:"vms,omitempty"`
	VCPUs  string `json:"vcpus,omitempty"`
	Memory string `json:"memory,omitempty"`
	Disk   string `json:"disk,omitempty"`
	// snapshots is the number of snapshots and the storage they take, used/hard.
	Snapshots string `json:"snapshots,omitempty"`
}

// ImpQuotaStatus is what the namespace's VMs hold now.
type ImpQuotaStatus struct {
	// observedGeneration is the spec generation the status is computed for.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// hard is the spec's hard, as enforced.
	// +optional
	Hard QuotaResources `json:"hard,omitempty"`
	// used is what the namespace's VMs hold.
	// +optional
	Used QuotaResources `json:"used,omitempty"`
	// summary is used/hard per resource, for kubectl get.
	// +optional
	Summary QuotaSummary `json:"summary,omitempty"`
}

// ImpQuota bounds what the ImpVMs of its namespace hold together (VMs, vCPUs, memory, disk,
// memory of suspended VMs) and each VM's size, the way a ResourceQuota bounds pods' requests.
// The operator enforces it when it places a VM: a VM that would exceed it waits, with
// Scheduled=False QuotaExceeded saying which limit and by how much, and is placed once room
// is freed. Every ImpQuota of a namespace applies.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Namespaced,shortName=impquota,categories=imp
// +kubebuilder:printcolumn:name="VMs",type=string,JSONPath=`.status.summary.vms`
// +kubebuilder:printcolumn:name="vCPUs",type=string,JSONPath=`.status.summary.vcpus`
// +kubebuilder:printcolumn:name="Memory",type=string,JSONPath=`.status.summary.memory`
// +kubebuilder:printcolumn:name="Disk",type=string,JSONPath=`.status.summary.disk`
// +kubebuilder:printcolumn:name="Snapshots",type=string,JSONPath=`.status.summary.snapshots`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImpQuota struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +optional
	Spec ImpQuotaSpec `json:"spec,omitempty"`
	// +optional
	Status ImpQuotaStatus `json:"status,omitempty"`
}

// ImpQuotaList is a list of ImpQuotas.
//
// +kubebuilder:object:root=true
type ImpQuotaList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpQuota `json:"items"`
}

// ReasonQuotaExceeded (ScheduledCondition, SuspendedCondition; an ImpVMPool's
// ReplicaFailure): placing the VM, suspending it, or creating a pool's member would take its
// namespace past an ImpQuota; the message names the quota and the limit.
const ReasonQuotaExceeded = "QuotaExceeded"

func init() {
	SchemeBuilder.Register(&ImpQuota{}, &ImpQuotaList{})
}
