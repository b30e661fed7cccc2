package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ImpVMClassSpec is a VM size and its defaults.
type ImpVMClassSpec struct {
	// vcpus is the number of virtual CPUs.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=32
	VCPUs int32 `json:"vcpus"`

	// memory is the guest's memory, a whole number of MiB and at least 128Mi.
	// +required
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('128Mi')) >= 0",message="memory must be at least 128Mi"
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('1Ti')) <= 0",message="memory must be at most 1Ti"
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).isInteger() && quantity(string(self)).asInteger() % 1048576 == 0",message="memory must be a whole number of MiB, such as 512Mi or 2Gi"
	Memory resource.Quantity `json:"memory"`

	// defaultDiskSize is the writable disk size of VMs of this class that do not set diskSize.
	// +optional
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('64Mi')) >= 0",message="defaultDiskSize must be at least 64Mi"
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('16Ti')) <= 0",message="defaultDiskSize must be at most 16Ti"
	DefaultDiskSize *resource.Quantity `json:"defaultDiskSize,omitempty"`

	// vmm is the VMM VMs of this class ask for unless they name their own.
	// +optional
	VMM VMMKind `json:"vmm,omitempty"`
}

// ImpVMClass is a cluster-wide VM size: vCPUs, memory, default disk size and VMM preference.
// A placed VM keeps the resources it was placed with when its class changes.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Cluster,categories=imp
// +kubebuilder:printcolumn:name="VCPUs",type=integer,JSONPath=`.spec.vcpus`
// +kubebuilder:printcolumn:name="Memory",type=string,JSONPath=`.spec.memory`
// +kubebuilder:printcolumn:name="Disk",type=string,JSONPath=`.spec.defaultDiskSize`
// +kubebuilder:printcolumn:name="VMM",type=string,JSONPath=`.spec.vmm`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImpVMClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec ImpVMClassSpec `json:"spec"`
}

// ImpVMClassList is a list of ImpVMClasses.
//
// +kubebuilder:object:root=true
type ImpVMClassList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpVMClass `json:"items"`
}

func init() {
	SchemeBuilder.Register(&ImpVMClass{}, &ImpVMClassList{})
}
