package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// PoolLabel is set on an ImpVMPool's members to the pool's name.
const PoolLabel = "imp.dev/pool"

// PoolRevisionLabel is set on an ImpVMPool's members to the revision (the hash of the pool's
// template, the name suffix of its ControllerRevision) they were made from.
const PoolRevisionLabel = "imp.dev/pool-revision"

// PoolIndexLabel is set on an ImpVMPool's members to their index: a member is named
// <pool>-<index>.
const PoolIndexLabel = "imp.dev/pool-index"

// PoolUpdateStrategyType is how a pool replaces members of an older revision.
// +kubebuilder:validation:Enum=RollingUpdate;OnDelete
type PoolUpdateStrategyType string

const (
	// PoolRollingUpdate replaces members of older revisions a few at a time, within maxSurge
	// and maxUnavailable.
	PoolRollingUpdate PoolUpdateStrategyType = "RollingUpdate"
	// PoolOnDelete leaves members alone: a member of an older revision is replaced by one of the
	// current revision only when someone deletes it.
	PoolOnDelete PoolUpdateStrategyType = "OnDelete"
)

// Conditions of an ImpVMPool.
const (
	// PoolAvailableCondition is True while at least replicas - maxUnavailable members are
	// available (Ready for minReadySeconds).
	PoolAvailableCondition = "Available"
	// PoolProgressingCondition is True while the pool creates, replaces or removes members,
	// and stays True with reason RolloutComplete once every member is of the current revision.
	PoolProgressingCondition = "Progressing"
	// PoolReplicaFailureCondition is True while a member cannot be created (the namespace's
	// ImpQuota, an admission policy): the pool stays short and says why.
	PoolReplicaFailureCondition = "ReplicaFailure"
)

// Reasons of an ImpVMPool's conditions.
const (
	// ReasonMinimumAvailable: at least replicas - maxUnavailable members are available.
	ReasonMinimumAvailable = "MinimumReplicasAvailable"
	// ReasonMinimumUnavailable: fewer than replicas - maxUnavailable members are available.
	ReasonMinimumUnavailable = "MinimumReplicasUnavailable"
	// ReasonScaling: the pool creates or removes members to reach replicas.
	ReasonScaling = "Scaling"
	// ReasonRolling: members of an older revision are being replaced.
	ReasonRolling = "RollingUpdate"
	// ReasonRolloutComplete: replicas members, all of the current revision, all available.
	ReasonRolloutComplete = "RolloutComplete"
	// ReasonWaitingForDeletion: OnDelete: members of an older revision wait to be deleted.
	ReasonWaitingForDeletion = "WaitingForDeletion"
	// ReplicaFailure is also ReasonQuotaExceeded: creating a member was refused by the
	// namespace's ImpQuota (or a member waits, unplaced, for it).
	// ReasonCreateFailed: creating a member was refused for another reason (the message has
	// the API server's answer).
	ReasonCreateFailed = "CreateFailed"
	// ReasonSelectorMismatch: the selector does not select the template's labels.
	ReasonSelectorMismatch = "SelectorMismatch"
	// ReasonMembersCreated: no creation is failing.
	ReasonMembersCreated = "MembersCreated"
)

// PoolRollingUpdateStrategy bounds a rolling update.
type PoolRollingUpdateStrategy struct {
	// maxUnavailable is how many members (or what percentage of replicas, rounded down) may be
	// unavailable during the update. Default 25%. It and maxSurge are not both 0.
	// +optional
	// +kubebuilder:validation:XIntOrString
	// +kubebuilder:validation:XValidation:rule="type(self) == int ? self >= 0 : self.matches('^[0-9]{1,3}%$')",message="maxUnavailable is a count >= 0 or a percentage such as 25%"
	MaxUnavailable *intstr.IntOrString `json:"maxUnavailable,omitempty"`
	// maxSurge is how many members (or what percentage of replicas, rounded up) may exist
	// beyond replicas during the update. Default 25%.
	// +optional
	// +kubebuilder:validation:XIntOrString
	// +kubebuilder:validation:XValidation:rule="type(self) == int ? self >= 0 : self.matches('^[0-9]{1,3}%$')",message="maxSurge is a count >= 0 or a percentage such as 25%"
	MaxSurge *intstr.IntOrString `json:"maxSurge,omitempty"`
}

// PoolUpdateStrategy is how a pool replaces members when its template changes.
// +kubebuilder:validation:XValidation:rule="!has(self.rollingUpdate) || !has(self.type) || self.type == 'RollingUpdate'",message="rollingUpdate is only for type RollingUpdate",fieldPath=".rollingUpdate"
type PoolUpdateStrategy struct {
	// type is RollingUpdate (default) or OnDelete.
	// +optional
	// +kubebuilder:default=RollingUpdate
	Type PoolUpdateStrategyType `json:"type,omitempty"`
	// rollingUpdate bounds a RollingUpdate.
	// +optional
	RollingUpdate *PoolRollingUpdateStrategy `json:"rollingUpdate,omitempty"`
}

// PoolMemberMetadata is what a pool gives each member's metadata.
type PoolMemberMetadata struct {
	// labels of each member (a Service selects members by them). They must include what the
	// pool's selector matches.
	// +optional
	Labels map[string]string `json:"labels,omitempty"`
	// annotations of each member.
	// +optional
	Annotations map[string]string `json:"annotations,omitempty"`
}

// ImpVMPoolTemplate is a pool member: its metadata and its ImpVM spec.
type ImpVMPoolTemplate struct {
	// metadata of each member.
	// +optional
	Metadata PoolMemberMetadata `json:"metadata,omitempty"`
	// spec of each member: an ImpVM spec, validated as one. A change is a new revision, rolled
	// out by the update strategy (the fields immutable in an ImpVM may change here: members are
	// replaced, not changed).
	// +required
	Spec ImpVMSpec `json:"spec"`
}

// PoolClaimTemplate is a PersistentVolumeClaim made for each member of a pool, as a
// StatefulSet's volumeClaimTemplates are.
type PoolClaimTemplate struct {
	// name of the template. A volume of template.spec.volumes whose
	// persistentVolumeClaim.claimName is this name is given, in each member, the member's own
	// claim: <name>-<pool>-<index>.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	Name string `json:"name"`
	// labels of each claim (with imp.dev/pool and imp.dev/pool-index).
	// +optional
	Labels map[string]string `json:"labels,omitempty"`
	// spec of each claim.
	// +required
	Spec corev1.PersistentVolumeClaimSpec `json:"spec"`
}

// PoolClaimRetention says what becomes of members' claims.
type PoolClaimRetention struct {
	// whenDeleted: Retain (default) keeps the claims when the pool is deleted; Delete makes
	// them the pool's, deleted with it. Claims are always kept when a member goes: a member
	// made again at that index takes them again.
	// +optional
	// +kubebuilder:default=Retain
	// +kubebuilder:validation:Enum=Retain;Delete
	WhenDeleted string `json:"whenDeleted,omitempty"`
}

// ImpVMPoolSpec is a set of identical VMs.
// +kubebuilder:validation:XValidation:rule="!has(self.template.spec.runStrategy) || self.template.spec.runStrategy == 'Always'",message="a pool's members run until removed: runStrategy is Always",fieldPath=".template.spec.runStrategy"
// +kubebuilder:validation:XValidation:rule="!has(self.template.spec.expireAfter)",message="a pool's members run until removed: no expireAfter",fieldPath=".template.spec.expireAfter"
// +kubebuilder:validation:XValidation:rule="!has(self.template.spec.nodeName)",message="a pool places its members: no nodeName (use nodeSelector)",fieldPath=".template.spec.nodeName"
// +kubebuilder:validation:XValidation:rule="!has(self.updateStrategy.rollingUpdate) || !has(self.updateStrategy.rollingUpdate.maxSurge) || !has(self.updateStrategy.rollingUpdate.maxUnavailable) || self.updateStrategy.rollingUpdate.maxSurge != 0 || self.updateStrategy.rollingUpdate.maxUnavailable != 0",message="maxSurge and maxUnavailable cannot both be 0",fieldPath=".updateStrategy.rollingUpdate"
type ImpVMPoolSpec struct {
	// replicas is how many members the pool keeps. The scale subresource sets it (kubectl
	// scale, HorizontalPodAutoscaler, KEDA).
	// +optional
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=10000
	Replicas *int32 `json:"replicas,omitempty"`

	// selector selects the pool's members by label; it must select template.metadata.labels
	// (else the pool makes no member and says SelectorMismatch). Immutable.
	// +required
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="selector is immutable"
	// +kubebuilder:validation:XValidation:rule="has(self.matchLabels) || has(self.matchExpressions)",message="selector selects something: set matchLabels or matchExpressions"
	Selector *metav1.LabelSelector `json:"selector"`

	// template is each member.
	// +required
	Template ImpVMPoolTemplate `json:"template"`

	// minReadySeconds is how long a member must be Ready before it counts as available (and a
	// rolling update goes on).
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=3600
	MinReadySeconds int32 `json:"minReadySeconds,omitempty"`

	// updateStrategy is how members of an older revision are replaced.
	// +optional
	// +kubebuilder:default={type: RollingUpdate}
	UpdateStrategy PoolUpdateStrategy `json:"updateStrategy,omitempty"`

	// volumeClaimTemplates are claims made for each member (<name>-<pool>-<index>), kept
	// when the member goes, so that the member made again at its index has its data. With
	// them, members are replaced in place, index by index: maxSurge is not used. Immutable.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=8
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="volumeClaimTemplates are immutable"
	VolumeClaimTemplates []PoolClaimTemplate `json:"volumeClaimTemplates,omitempty"`

	// claimRetention says whether members' claims go with the pool.
	// +optional
	ClaimRetention *PoolClaimRetention `json:"claimRetention,omitempty"`

	// revisionHistoryLimit is how many old revisions (ControllerRevisions) are kept for
	// `kubectl imp rollout undo`. Default 10.
	// +optional
	// +kubebuilder:default=10
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	RevisionHistoryLimit *int32 `json:"revisionHistoryLimit,omitempty"`
}

// ImpVMPoolStatus is what the operator reports of a pool.
type ImpVMPoolStatus struct {
	// observedGeneration is the spec generation the status was computed for.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// replicas is how many members exist (not being deleted).
	// +optional
	Replicas int32 `json:"replicas"`
	// readyReplicas is how many members are Ready.
	// +optional
	ReadyReplicas int32 `json:"readyReplicas,omitempty"`
	// availableReplicas is how many members have been Ready for minReadySeconds.
	// +optional
	AvailableReplicas int32 `json:"availableReplicas,omitempty"`
	// updatedReplicas is how many members are of the current revision.
	// +optional
	UpdatedReplicas int32 `json:"updatedReplicas,omitempty"`
	// selector is spec.selector as a string, for the scale subresource (HPA).
	// +optional
	Selector string `json:"selector,omitempty"`
	// currentRevision is the revision every member had when the pool last finished an update.
	// +optional
	CurrentRevision string `json:"currentRevision,omitempty"`
	// updateRevision is the revision of the current template.
	// +optional
	UpdateRevision string `json:"updateRevision,omitempty"`
	// conditions: Available, Progressing, ReplicaFailure.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// ImpVMPool keeps replicas identical ImpVMs (its members, named <pool>-<index>), replaces
// those that fail, and rolls template changes through them. See docs/pools.md.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.replicas,statuspath=.status.replicas,selectorpath=.status.selector
// +kubebuilder:resource:shortName=impvmp,categories=imp
// +kubebuilder:validation:XValidation:rule="self.metadata.name.size() <= 52 && !self.metadata.name.contains('.')",message="an ImpVMPool's name is a DNS label of at most 52 characters (its members are <name>-<index>)"
// +kubebuilder:printcolumn:name="Desired",type=integer,JSONPath=`.spec.replicas`
// +kubebuilder:printcolumn:name="Current",type=integer,JSONPath=`.status.replicas`
// +kubebuilder:printcolumn:name="Ready",type=integer,JSONPath=`.status.readyReplicas`
// +kubebuilder:printcolumn:name="Up-to-date",type=integer,JSONPath=`.status.updatedReplicas`
// +kubebuilder:printcolumn:name="Available",type=integer,JSONPath=`.status.availableReplicas`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="Image",type=string,JSONPath=`.spec.template.spec.image`,priority=1
type ImpVMPool struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec ImpVMPoolSpec `json:"spec"`
	// +optional
	Status ImpVMPoolStatus `json:"status,omitempty"`
}

// ImpVMPoolList is a list of ImpVMPools.
//
// +kubebuilder:object:root=true
type ImpVMPoolList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpVMPool `json:"items"`
}

func init() {
	SchemeBuilder.Register(&ImpVMPool{}, &ImpVMPoolList{})
}
