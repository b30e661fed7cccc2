package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// SnapshotFinalizer holds an ImpVMSnapshot until its node confirmed its files are gone (or the
// node is gone).
const SnapshotFinalizer = "imp.dev/snapshot"

// SnapshotPhase is where an ImpVMSnapshot is in its life.
// +kubebuilder:validation:Enum=Pending;Taking;Ready;Failed;Scheduled
type SnapshotPhase string

const (
	// SnapshotPending: waiting for its VM to run on a node.
	SnapshotPending SnapshotPhase = "Pending"
	// SnapshotTaking: the node is saving the VM's memory, devices and disk.
	SnapshotTaking SnapshotPhase = "Taking"
	// SnapshotReady: the snapshot is on its node and VMs may start from it.
	SnapshotReady SnapshotPhase = "Ready"
	// SnapshotFailed: it could not be taken (the reason says why); the VM kept running.
	SnapshotFailed SnapshotPhase = "Failed"
	// SnapshotScheduled: a recurring snapshot (spec.schedule), which takes none itself.
	SnapshotScheduled SnapshotPhase = "Scheduled"
)

// ScheduleLabel is set on each snapshot a recurring one made, to the recurring one's name.
const ScheduleLabel = "imp.dev/snapshot-schedule"

// Reasons of an ImpVMSnapshot, and of a VM that names one (spec.snapshotRef).
const (
	// ReasonSnapshotVMNotFound: spec.vmName names no ImpVM of the snapshot's namespace.
	ReasonSnapshotVMNotFound = "VMNotFound"
	// ReasonSnapshotVMNotRunning: the VM does not run (nor is it suspended) on a node.
	ReasonSnapshotVMNotRunning = "VMNotRunning"
	// ReasonSnapshotVMHasDisks: the VM has disk volumes (emptyDisk), which a snapshot does not
	// hold; it is not snapshotted.
	ReasonSnapshotVMHasDisks = "VMHasDiskVolumes"
	// ReasonSnapshotVMBootsAnOS: the VM boots an OS (spec.boot OS), whose snapshots are not
	// built yet; it is not snapshotted.
	ReasonSnapshotVMBootsAnOS = "VMBootsAnOS"
	// ReasonSnapshotTakeFailed: the node could not save the VM; it kept running.
	ReasonSnapshotTakeFailed = "SnapshotFailed"
	// ReasonSnapshotNotFound: the VM's snapshotRef names no ImpVMSnapshot of its namespace
	// (a snapshot of another namespace cannot be named).
	ReasonSnapshotNotFound = "SnapshotNotFound"
	// ReasonSnapshotNotReady: the VM's snapshot is not Ready yet (it waits) or failed.
	ReasonSnapshotNotReady = "SnapshotNotReady"
	// ReasonSnapshotIncompatible: the snapshot cannot run as this VM or on this node: another
	// VMM, kernel, CPU, size or device set than it was taken with.
	ReasonSnapshotIncompatible = "SnapshotIncompatible"
	// ReasonRestoreFailed: the node could not start the VM from its snapshot.
	ReasonRestoreFailed = "RestoreFailed"
	// ReasonInvalidSchedule: spec.schedule is no cron expression.
	ReasonInvalidSchedule = "InvalidSchedule"
	// ReasonPushFailed: the snapshot could not be pushed to its registry (it is tried again);
	// it is Ready on its node meanwhile.
	ReasonPushFailed = "PushFailed"
	// ReasonRegistrySecretNotFound: spec.registry.secretRef names no Secret of the namespace.
	ReasonRegistrySecretNotFound = "RegistrySecretNotFound"
)

// SnapshotReadyCondition is True once a snapshot is on its node, ready to start VMs from.
const SnapshotReadyCondition = "Ready"

// ImpVMSnapshotSpec names the VM to snapshot, once or on a schedule.
// +kubebuilder:validation:XValidation:rule="!has(self.retention) || has(self.schedule)",message="retention is for a recurring snapshot: set schedule too"
type ImpVMSnapshotSpec struct {
	// vmName is the ImpVM of this namespace to snapshot, while it runs (paused for the time
	// it takes to save its memory, devices and writable disk) or while suspended.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	VMName string `json:"vmName"`
	// schedule makes the snapshot recurring: a cron expression (five fields, as a CronJob's,
	// in UTC; or @hourly, @daily, ...). It takes none itself: at each time it creates an
	// ImpVMSnapshot of the VM, named after it and the time, labelled imp.dev/snapshot-schedule
	// with its name and owned by it (deleting it deletes them). A time missed while the
	// operator was away is made up once, not once per missed time.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=128
	Schedule string `json:"schedule,omitempty"`
	// retention is how many of a recurring snapshot's snapshots are kept: the newest that are
	// Ready; older ones, and failures but the newest, are deleted. Default 3.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	Retention *int32 `json:"retention,omitempty"`
	// registry, when set, pushes the snapshot once taken to an OCI registry, so that VMs on
	// other nodes can start from it. Its files are compressed and encrypted with a key of the
	// snapshot's own (AES-256-GCM, kept in a Secret of IMP's namespace): the registry sees their
	// names and sizes, not the tenant's memory or disk. A recurring snapshot's snapshots are
	// pushed too.
	// +optional
	Registry *SnapshotRegistry `json:"registry,omitempty"`
}

// SnapshotRegistry is where a snapshot is pushed.
type SnapshotRegistry struct {
	// repository is host[:port]/path; the snapshot is pushed there with its UID as the tag.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=512
	Repository string `json:"repository"`
	// secretRef names a kubernetes.io/dockerconfigjson Secret of the snapshot's namespace with
	// credentials that may push there (and pull, for the nodes that restore it).
	// +optional
	SecretRef *corev1.LocalObjectReference `json:"secretRef,omitempty"`
}

// SnapshotSource is what a snapshot was taken of and with: a VM restoring it must match.
type SnapshotSource struct {
	// vmUID is the UID of the VM snapshotted.
	VMUID types.UID `json:"vmUID"`
	// image is the image its base disk was built from, by digest (repository@sha256:...).
	Image string `json:"image"`
	// vmm is the VMM kind it ran under, and vmmVersion its version.
	VMM        VMMKind `json:"vmm"`
	VMMVersion string  `json:"vmmVersion,omitempty"`
	// vcpus, memory and diskSize are the VM's resources: a VM restoring it gets them.
	VCPUs    int32             `json:"vcpus"`
	Memory   resource.Quantity `json:"memory"`
	DiskSize resource.Quantity `json:"diskSize"`
	// network says whether the VM had a network interface: a VM restoring it must have one
	// too (or none).
	Network bool `json:"network,omitempty"`
}

// ImpVMSnapshotStatus is what the operator and the snapshot's node report.
type ImpVMSnapshotStatus struct {
	// phase is Pending, Taking, Ready or Failed.
	// +optional
	Phase SnapshotPhase `json:"phase,omitempty"`
	// nodeName is the node holding the snapshot's files (its VM's node when taken).
	// +optional
	NodeName string `json:"nodeName,omitempty"`
	// source is what was snapshotted: the VM, its image, VMM and resources.
	// +optional
	Source *SnapshotSource `json:"source,omitempty"`
	// takenAt is when the VM was paused for it.
	// +optional
	TakenAt *metav1.Time `json:"takenAt,omitempty"`
	// pauseMilliseconds is how long the VM was paused to take it (0 for a suspended VM).
	// +optional
	PauseMilliseconds int64 `json:"pauseMilliseconds,omitempty"`
	// size is the space its files take on the node: memory and device state, and the
	// writable disk (allocated bytes).
	// +optional
	Size *resource.Quantity `json:"size,omitempty"`
	// digest is the snapshot's manifest digest in spec.registry.repository, once pushed.
	// +optional
	Digest string `json:"digest,omitempty"`
	// filesRemoved: the node removed its files (the object is being deleted).
	// +optional
	FilesRemoved bool `json:"filesRemoved,omitempty"`
	// reason and message say why it is Pending or Failed.
	// +optional
	Reason string `json:"reason,omitempty"`
	// +optional
	// +kubebuilder:validation:MaxLength=4096
	Message string `json:"message,omitempty"`
	// lastScheduleTime is the time of a recurring snapshot's newest snapshot, and
	// nextScheduleTime that of the next.
	// +optional
	LastScheduleTime *metav1.Time `json:"lastScheduleTime,omitempty"`
	// +optional
	NextScheduleTime *metav1.Time `json:"nextScheduleTime,omitempty"`
	// conditions: Ready.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// ImpVMSnapshot is a snapshot of one VM of its namespace: its memory, device state and
// writable disk, on the node where it ran. VMs of the same namespace start from it
// (spec.snapshotRef) by restoring instead of booting, each with its own identity. It holds the
// tenant's memory: its files are the agent's alone (0600, outside every VMM's jail), never
// restored in another namespace, and removed when it is deleted.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=impsnap,categories=imp
// +kubebuilder:selectablefield:JSONPath=`.status.nodeName`
// +kubebuilder:validation:XValidation:rule="self.spec == oldSelf.spec",message="an ImpVMSnapshot's spec is immutable: take a new snapshot"
// +kubebuilder:printcolumn:name="VM",type=string,JSONPath=`.spec.vmName`
// +kubebuilder:printcolumn:name="Phase",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.status.nodeName`
// +kubebuilder:printcolumn:name="Size",type=string,JSONPath=`.status.size`
// +kubebuilder:printcolumn:name="Pause-ms",type=integer,JSONPath=`.status.pauseMilliseconds`
// +kubebuilder:printcolumn:name="Digest",type=string,JSONPath=`.status.digest`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImpVMSnapshot struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec ImpVMSnapshotSpec `json:"spec"`
	// +optional
	Status ImpVMSnapshotStatus `json:"status,omitempty"`
}

// ImpVMSnapshotList is a list of ImpVMSnapshots.
//
// +kubebuilder:object:root=true
type ImpVMSnapshotList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpVMSnapshot `json:"items"`
}

// SnapshotReference names an ImpVMSnapshot of the VM's own namespace.
type SnapshotReference struct {
	// name of the ImpVMSnapshot.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`
}

func init() {
	SchemeBuilder.Register(&ImpVMSnapshot{}, &ImpVMSnapshotList{})
}
