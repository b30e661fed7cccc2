package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// WarmPoolLabel is set on an ImpWarmPool's members to the pool's name; the pool's
// status.selector selects them by it. A VM carrying it is a member only while its controller
// (owner reference) is the pool too: a label alone makes no member.
const WarmPoolLabel = "imp.dev/warm-pool"

// WarmPoolRevisionLabel is set on an ImpWarmPool's members to the revision of the pool's
// template they were made from (the template's status.revision).
const WarmPoolRevisionLabel = "imp.dev/warm-pool-revision"

// WarmPoolUpdateStrategyType is what a pool does with idle members made from an older revision
// of its template.
// +kubebuilder:validation:Enum=OnClaim;Recreate
type WarmPoolUpdateStrategyType string

const (
	// WarmPoolOnClaim: idle members of an older revision are handed out as they are; the members
	// made to refill the pool are of the template's current revision.
	WarmPoolOnClaim WarmPoolUpdateStrategyType = "OnClaim"
	// WarmPoolRecreate: idle members of an older revision are deleted at once and made again of
	// the current revision (claims meanwhile are restored, never wait).
	WarmPoolRecreate WarmPoolUpdateStrategyType = "Recreate"
)

// WarmPoolSpread is how a pool's members are spread over the nodes they may run on.
// +kubebuilder:validation:Enum=Nodes;None
type WarmPoolSpread string

const (
	// WarmPoolSpreadNodes: each member goes to the node holding fewest of the pool's members
	// among those with room, so that one node lost takes few of them.
	WarmPoolSpreadNodes WarmPoolSpread = "Nodes"
	// WarmPoolSpreadNone: members are placed as any VM is.
	WarmPoolSpreadNone WarmPoolSpread = "None"
)

// Conditions of an ImpWarmPool.
const (
	// WarmPoolReadyCondition is True while replicas members are idle, ready to be handed out.
	WarmPoolReadyCondition = "Ready"
	// WarmPoolReplicaFailureCondition is True while a member cannot be made (the namespace's
	// ImpQuota, the template, an admission policy): the pool stays short and says why.
	WarmPoolReplicaFailureCondition = "ReplicaFailure"
)

// Reasons of an ImpWarmPool's conditions, and of a claim's (an ImpVM with spec.warmPoolRef).
const (
	// ReasonWarmPoolFilled: replicas members are idle.
	ReasonWarmPoolFilled = "Filled"
	// ReasonWarmPoolFilling: members are being made (or made ready) to reach replicas.
	ReasonWarmPoolFilling = "Filling"
	// ReasonWarmPoolNotFound: a claim's warmPoolRef names no ImpWarmPool of its namespace (or it
	// is being deleted); the claim is restored from the template it would have had, if known,
	// else waits.
	ReasonWarmPoolNotFound = "WarmPoolNotFound"
	// ReasonWarmHandoverFailed: the claim's node could not hand it the member it was bound to
	// (the member's guest refused the claim's identity, or did not answer): the member is
	// destroyed, never handed out with its old identity, and the claim is placed again, restored.
	ReasonWarmHandoverFailed = "WarmHandoverFailed"
	// ReasonWarmPoolIncompatible: the claim cannot take the pool's members (its network is not
	// the pool's): it is restored from the pool's template instead.
	ReasonWarmPoolIncompatible = "WarmPoolIncompatible"
)

// WarmPoolUpdateStrategy is what a pool does when its template changes.
type WarmPoolUpdateStrategy struct {
	// type is OnClaim (default) or Recreate. Claimed VMs are never touched: they are the
	// claimants'.
	// +optional
	// +kubebuilder:default=OnClaim
	Type WarmPoolUpdateStrategyType `json:"type,omitempty"`
}

// WarmPoolReference names an ImpWarmPool of the VM's own namespace.
type WarmPoolReference struct {
	// name of the ImpWarmPool.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`
}

// ImpWarmPoolSpec is a number of copies of a template, kept running idle for claims.
type ImpWarmPoolSpec struct {
	// templateRef names the ImpVMTemplate of the pool's namespace whose copies the members are.
	// +required
	TemplateRef TemplateReference `json:"templateRef"`

	// replicas is how many idle members the pool keeps. The scale subresource sets it
	// (kubectl scale, HorizontalPodAutoscaler, KEDA), down to 0.
	// +optional
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=10000
	Replicas *int32 `json:"replicas,omitempty"`

	// networkRef is the ImpNetwork of the pool's namespace its members are attached to: set it
	// if, and only if, the template's VM has a network. A claim takes a member only when it
	// names the same network.
	// +optional
	NetworkRef *NetworkReference `json:"networkRef,omitempty"`

	// nodeSelector adds node label requirements to the members' (beside imp/enabled=true).
	// +optional
	// +kubebuilder:validation:MaxProperties=32
	// +kubebuilder:validation:XValidation:rule="!('imp/enabled' in self) || self['imp/enabled'] == 'true'",message="imp/enabled is always required to be \"true\"; add other labels beside it"
	NodeSelector map[string]string `json:"nodeSelector,omitempty"`

	// tolerations of the members.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=32
	Tolerations []corev1.Toleration `json:"tolerations,omitempty"`

	// spread is Nodes (default: each member on the node holding fewest of the pool's members)
	// or None.
	// +optional
	// +kubebuilder:default=Nodes
	Spread WarmPoolSpread `json:"spread,omitempty"`

	// updateStrategy is what becomes of idle members when the template changes.
	// +optional
	// +kubebuilder:default={type: OnClaim}
	UpdateStrategy WarmPoolUpdateStrategy `json:"updateStrategy,omitempty"`
}

// ImpWarmPoolStatus is what the operator reports of a pool.
type ImpWarmPoolStatus struct {
	// observedGeneration is the spec generation the status was computed for.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// replicas is the number of members (idle or on their way to it; not those handed out).
	// +optional
	Replicas int32 `json:"replicas"`
	// idle is the number of members ready to be handed out: running, guest ready, not claimed.
	// +optional
	Idle int32 `json:"idle"`
	// claimed is the number of members bound to a claim and being handed over.
	// +optional
	Claimed int32 `json:"claimed"`
	// revision is the template revision new members are made of.
	// +optional
	Revision string `json:"revision,omitempty"`
	// selector selects the members, for the scale subresource (HorizontalPodAutoscaler).
	// +optional
	Selector string `json:"selector,omitempty"`
	// conditions: Ready, ReplicaFailure.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// ImpWarmPool keeps copies of an ImpVMTemplate running idle, so that an ImpVM naming the pool
// (spec.warmPoolRef, a claim) is handed one in place of a restore: it becomes that VM, with the
// claim's name, identity and configuration. See docs/warmpools.md.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.replicas,statuspath=.status.replicas,selectorpath=.status.selector
// +kubebuilder:resource:shortName=impwp,categories=imp
// +kubebuilder:validation:XValidation:rule="self.metadata.name.size() <= 57 && !self.metadata.name.contains('.')",message="an ImpWarmPool's name is a DNS label of at most 57 characters (its members are <name>-<5 characters>)"
// +kubebuilder:printcolumn:name="Template",type=string,JSONPath=`.spec.templateRef.name`
// +kubebuilder:printcolumn:name="Desired",type=integer,JSONPath=`.spec.replicas`
// +kubebuilder:printcolumn:name="Idle",type=integer,JSONPath=`.status.idle`
// +kubebuilder:printcolumn:name="Claimed",type=integer,JSONPath=`.status.claimed`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="Revision",type=string,JSONPath=`.status.revision`,priority=1
type ImpWarmPool struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec ImpWarmPoolSpec `json:"spec"`
	// +optional
	Status ImpWarmPoolStatus `json:"status,omitempty"`
}

// ImpWarmPoolList is a list of ImpWarmPools.
//
// +kubebuilder:object:root=true
type ImpWarmPoolList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpWarmPool `json:"items"`
}

// WarmStatus is, for a claim served warm, the member it was handed.
type WarmStatus struct {
	// pool is the ImpWarmPool the member was of.
	Pool string `json:"pool"`
	// member is the member's name.
	Member string `json:"member"`
	// memberUID is the member's UID: the member the claim was bound to, whatever is named
	// after it later.
	MemberUID string `json:"memberUID"`
}

// VMStart is how a VM's placement starts.
// +kubebuilder:validation:Enum=warm;restored;booted
type VMStart string

const (
	// StartWarm: an idle member of a warm pool was handed to the VM.
	StartWarm VMStart = "warm"
	// StartRestored: the VM restores a snapshot (its snapshotRef, or its template's).
	StartRestored VMStart = "restored"
	// StartBooted: the VM boots from its image.
	StartBooted VMStart = "booted"
)

// IsClaim is true for a VM that names a warm pool (spec.warmPoolRef).
func (vm *ImpVM) IsClaim() bool { return vm.Spec.WarmPoolRef != nil }

// IsCopy is true for a copy of a template: a VM naming one (spec.templateRef), or a claim of a
// warm pool (the copy of the pool's template, whether handed a member or restored).
func (vm *ImpVM) IsCopy() bool { return vm.Spec.TemplateRef != nil || vm.Spec.WarmPoolRef != nil }

// SetsWorkload is true for a VM that sets its own command, args or workingDir: a copy may only
// when its template's snapshot was taken before the workload started (beforeWorkload).
func (vm *ImpVM) SetsWorkload() bool {
	return len(vm.Spec.Command) > 0 || len(vm.Spec.Args) > 0 || vm.Spec.WorkingDir != ""
}

// TemplateName is the ImpVMTemplate a copy is of: its templateRef, or for a claim the template
// its placement resolved (status.template.name); empty when not known (yet).
func (vm *ImpVM) TemplateName() string {
	switch {
	case vm.Spec.TemplateRef != nil:
		return vm.Spec.TemplateRef.Name
	case vm.Spec.WarmPoolRef != nil && vm.Status.Template != nil:
		return vm.Status.Template.Name
	}
	return ""
}

// HostUID is the UID the VM's run is kept under on its node (its state directory, VMM, jail,
// tap, endpoint): for a claim served warm, the member's whose running guest it was handed
// (status.warm.memberUID: status is the operator's to write, so a tenant never points a VM at
// another's run); the VM's own UID otherwise. What is said of the VM to the API server is
// always the VM's own.
func (vm *ImpVM) HostUID() types.UID {
	if w := vm.Status.Warm; w != nil && w.MemberUID != "" && vm.Status.Start == StartWarm && vm.IsClaim() {
		return types.UID(w.MemberUID)
	}
	return vm.UID
}

// WarmPoolOf is the pool a VM is a member of: the pool named by its label, when the pool is
// also its controller (owner); empty for any other VM.
func WarmPoolOf(vm *ImpVM) string {
	name := vm.Labels[WarmPoolLabel]
	if name == "" {
		return ""
	}
	ref := metav1.GetControllerOfNoCopy(vm)
	if ref == nil || ref.Kind != "ImpWarmPool" || ref.Name != name || ref.APIVersion != GroupVersion.String() {
		return ""
	}
	return name
}

func init() {
	SchemeBuilder.Register(&ImpWarmPool{}, &ImpWarmPoolList{})
}
