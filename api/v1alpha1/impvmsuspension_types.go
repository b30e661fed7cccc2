package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Reasons a VM is suspended.
const (
	// SuspendReasonUser: a person asked (kubectl imp suspend).
	SuspendReasonUser = "User"
	// SuspendReasonPressure: the operator's pressure lifecycle suspended the VM because its
	// node reported MemoryPressure.
	SuspendReasonPressure = "PressureLifecycle"
	// SuspendReasonIdle: the VM had no activity for its spec.idle.suspendAfter; something
	// arriving for it wakes it (the operator deletes the suspension), as does a session
	// through the API. A suspension of another reason is never woken.
	SuspendReasonIdle = "Idle"
)

// ImpVMSuspensionSpec says why the VM of the same name is suspended.
type ImpVMSuspensionSpec struct {
	// reason is why: User, PressureLifecycle or Idle.
	// +kubebuilder:validation:Enum=User;PressureLifecycle;Idle
	Reason string `json:"reason"`
	// message is detail for humans (the node and its pressure, who asked and why).
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Message string `json:"message,omitempty"`
}

// ImpVMSuspension suspends the ImpVM of the same name in its namespace while it exists: the
// VM's memory and device state go to its node's disk and its VMM stops, its disks, address and
// placement stay. Deleting it resumes the VM where it stopped. Being an object of its own,
// suspending is granted by RBAC apart from editing VMs, and every suspension is in the audit
// log with who made it.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:shortName=impsusp,categories=imp
// +kubebuilder:validation:XValidation:rule="self.spec == oldSelf.spec",message="an ImpVMSuspension is immutable: delete it to resume the VM"
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.spec.reason`
// +kubebuilder:printcolumn:name="Message",type=string,JSONPath=`.spec.message`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImpVMSuspension struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec ImpVMSuspensionSpec `json:"spec"`
}

// ImpVMSuspensionList is a list of ImpVMSuspensions.
//
// +kubebuilder:object:root=true
type ImpVMSuspensionList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpVMSuspension `json:"items"`
}

func init() {
	SchemeBuilder.Register(&ImpVMSuspension{}, &ImpVMSuspensionList{})
}
