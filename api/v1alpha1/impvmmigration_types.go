package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// EvictionStrategy is what becomes of a running VM when its node is evacuated.
type EvictionStrategy string

const (
	// EvictionMigrate: the VM is moved to another node with its memory.
	EvictionMigrate EvictionStrategy = "Migrate"
	// EvictionNone: the VM stays where it is.
	EvictionNone EvictionStrategy = "None"
)

// EvacuateTaint, on a Node with effect NoExecute, evacuates it: its VMs whose evictionStrategy
// is Migrate are moved off it, a few at a time (kubectl imp drain sets it, with the node
// cordoned). It keeps new VMs off the node as any untolerated NoExecute taint does.
const EvacuateTaint = "imp.dev/evacuate"

// EvacuationLabel, on an ImpVMMigration, names the node whose evacuation made it.
const EvacuationLabel = "imp.dev/evacuation"

// MigrationPhase is where a migration stands (docs/migration.md).
// +kubebuilder:validation:Enum=Pending;Scheduling;Preparing;Transferring;Committed;Succeeded;Failed
type MigrationPhase string

const (
	// MigrationPending: created, not yet checked.
	MigrationPending MigrationPhase = "Pending"
	// MigrationScheduling: the VM is the migration's; a target node is being chosen.
	MigrationScheduling MigrationPhase = "Scheduling"
	// MigrationPreparing: the target's agent prepares the VM's place (its directory, network
	// attachment with the same address and MAC, volumes, a VMM waiting for the state).
	MigrationPreparing MigrationPhase = "Preparing"
	// MigrationTransferring: the source's agent sends the VM's disk, memory and devices while
	// it runs, then pauses it for the rest; the target loads them and keeps the guest paused.
	MigrationTransferring MigrationPhase = "Transferring"
	// MigrationCommitted: the operator moved the VM to the target (status.nodeName): the target
	// runs it on, the source never runs it again.
	MigrationCommitted MigrationPhase = "Committed"
	// MigrationSucceeded: the VM runs on the target and the source let it go.
	MigrationSucceeded MigrationPhase = "Succeeded"
	// MigrationFailed: the migration ended before its commit; the VM runs on its source as it
	// was (or, failed after commit, on the target as its runStrategy decides).
	MigrationFailed MigrationPhase = "Failed"
)

// Finished says whether a migration in phase p is over.
func (p MigrationPhase) Finished() bool { return p == MigrationSucceeded || p == MigrationFailed }

// Committed says whether the VM of a migration in phase p belongs to the target.
func (p MigrationPhase) Committed() bool { return p == MigrationCommitted || p == MigrationSucceeded }

// MigrationAgentState is what one of a migration's agents reports of its side.
// +kubebuilder:validation:Enum=Preparing;Ready;Sending;Paused;Loaded;Running;Released;Failed
type MigrationAgentState string

const (
	// MigrationAgentPreparing (target): the VM's place is being made.
	MigrationAgentPreparing MigrationAgentState = "Preparing"
	// MigrationAgentReady (target): the VM's place is made and its VMM waits for the state.
	MigrationAgentReady MigrationAgentState = "Ready"
	// MigrationAgentSending (source): the state is being sent, the guest running.
	MigrationAgentSending MigrationAgentState = "Sending"
	// MigrationAgentPaused (source): all of the state was sent; the guest is paused, kept for
	// the commit or, failing it, to run on.
	MigrationAgentPaused MigrationAgentState = "Paused"
	// MigrationAgentLoaded (target): all of the state was received and loaded; the guest is
	// paused until the commit.
	MigrationAgentLoaded MigrationAgentState = "Loaded"
	// MigrationAgentRunning (target): committed, the guest runs on the target.
	MigrationAgentRunning MigrationAgentState = "Running"
	// MigrationAgentReleased (source): committed, the source's VMM and its run are gone.
	MigrationAgentReleased MigrationAgentState = "Released"
	// MigrationAgentFailed: this side failed; message says why.
	MigrationAgentFailed MigrationAgentState = "Failed"
)

// MigrationAgentReport is one agent's report of its side of a migration. Each agent writes its
// own (status.source, status.target) and nothing else of a migration (the chart's admission
// policy imp-agent-node-scope); the operator alone decides the phase and the commit.
type MigrationAgentReport struct {
	// state is where this side stands.
	State MigrationAgentState `json:"state"`
	// bytes is what this side sent (source) or received (target) so far.
	// +optional
	// +kubebuilder:validation:Minimum=0
	Bytes int64 `json:"bytes,omitempty"`
	// downtime is how long the guest was paused for the last of the state (source, once
	// Paused): the VMM's own figure.
	// +optional
	Downtime *metav1.Duration `json:"downtime,omitempty"`
	// message is detail for humans (why it failed).
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Message string `json:"message,omitempty"`
}

// ImpVMMigrationSpec names the VM to move, and where.
type ImpVMMigrationSpec struct {
	// vmName is the ImpVM of the migration's namespace to move. It must be running.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	VMName string `json:"vmName"`
	// targetNode is the node to move it to; unset, placement chooses among the nodes the VM
	// could be placed on (the same rules, room and quota as a new VM), never its own.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	TargetNode string `json:"targetNode,omitempty"`
	// timeoutSeconds bounds the migration from its start to its commit; past it, the migration
	// fails and the VM runs on its source. Default 600.
	// +optional
	// +kubebuilder:validation:Minimum=10
	// +kubebuilder:validation:Maximum=86400
	TimeoutSeconds *int32 `json:"timeoutSeconds,omitempty"`
}

// ImpVMMigrationStatus is where the migration stands, written by the operator (phase,
// nodes, timings) and the two agents (source, target).
type ImpVMMigrationStatus struct {
	// phase is where the migration stands.
	// +optional
	Phase MigrationPhase `json:"phase,omitempty"`
	// vmUID is the UID of the VM moved: a VM deleted and made again under its name is not
	// the migration's.
	// +optional
	VMUID types.UID `json:"vmUID,omitempty"`
	// sourceNode is the node the VM ran on when the migration began.
	// +optional
	SourceNode string `json:"sourceNode,omitempty"`
	// targetNode is the node it moves to, once chosen.
	// +optional
	TargetNode string `json:"targetNode,omitempty"`
	// source is the source agent's report.
	// +optional
	Source *MigrationAgentReport `json:"source,omitempty"`
	// target is the target agent's report.
	// +optional
	Target *MigrationAgentReport `json:"target,omitempty"`
	// startedAt is when the migration began (the VM became the migration's).
	// +optional
	StartedAt *metav1.Time `json:"startedAt,omitempty"`
	// committedAt is when the VM was moved to the target.
	// +optional
	CommittedAt *metav1.Time `json:"committedAt,omitempty"`
	// completedAt is when it succeeded or failed.
	// +optional
	CompletedAt *metav1.Time `json:"completedAt,omitempty"`
	// downtime is how long the guest was paused (the source's figure).
	// +optional
	Downtime *metav1.Duration `json:"downtime,omitempty"`
	// bytesMoved is what the source sent.
	// +optional
	BytesMoved int64 `json:"bytesMoved,omitempty"`
	// reason is a CamelCase word for why it failed.
	// +optional
	Reason string `json:"reason,omitempty"`
	// message is detail for humans.
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Message string `json:"message,omitempty"`
	// conditions: Ready is true once the migration succeeded.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// ImpVMMigration moves a running ImpVM of its namespace to another node with its memory, its
// devices and its disk: the same VM (name, UID, address, MAC, identity), paused only for the
// last of its state. One copy ever: the source's guest stops before the target's may run, and
// never runs again once the target may have; a migration that fails before its commit leaves
// the VM running on its source. At most one migration of a VM at a time.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=impmig,categories=imp
// +kubebuilder:validation:XValidation:rule="self.spec == oldSelf.spec",message="an ImpVMMigration's spec is immutable: delete it and make another"
// +kubebuilder:selectablefield:JSONPath=`.status.targetNode`
// +kubebuilder:printcolumn:name="VM",type=string,JSONPath=`.spec.vmName`
// +kubebuilder:printcolumn:name="Phase",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Source",type=string,JSONPath=`.status.sourceNode`
// +kubebuilder:printcolumn:name="Target",type=string,JSONPath=`.status.targetNode`
// +kubebuilder:printcolumn:name="Downtime",type=string,JSONPath=`.status.downtime`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="Moved",type=integer,JSONPath=`.status.bytesMoved`,priority=1
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.reason`,priority=1
type ImpVMMigration struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec ImpVMMigrationSpec `json:"spec"`
	// +optional
	Status ImpVMMigrationStatus `json:"status,omitempty"`
}

// ImpVMMigrationList is a list of ImpVMMigrations.
//
// +kubebuilder:object:root=true
type ImpVMMigrationList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpVMMigration `json:"items"`
}

func init() {
	SchemeBuilder.Register(&ImpVMMigration{}, &ImpVMMigrationList{})
}

// MigrationStatus is, on a VM being moved, the migration that has it: written by the operator
// alone, it tells the source's agent what to do (prepare nothing, send once Transferring, let
// the VM go once the VM's nodeName is the target's).
type MigrationStatus struct {
	// name is the ImpVMMigration's, in the VM's namespace.
	Name string `json:"name"`
	// uid is the ImpVMMigration's.
	UID types.UID `json:"uid"`
	// phase is the migration's phase as the operator last decided it.
	Phase MigrationPhase `json:"phase"`
	// targetNode is the node the VM moves to, once chosen.
	// +optional
	TargetNode string `json:"targetNode,omitempty"`
	// sourceNode is the node the VM moves from.
	// +optional
	SourceNode string `json:"sourceNode,omitempty"`
	// instance and run are the VM's run the migration moves (status.instance and
	// status.restartCount when it began): a VM whose run changed meanwhile is not committed.
	// +optional
	Instance int64 `json:"instance,omitempty"`
	// +optional
	Run int32 `json:"run,omitempty"`
}
