package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TemplateLabel is set on what an ImpVMTemplate makes (its builder VMs and their snapshots) to
// the template's name.
const TemplateLabel = "imp.dev/template"

// TemplateRevisionLabel is set on what an ImpVMTemplate makes to the revision it was made for.
const TemplateRevisionLabel = "imp.dev/template-revision"

// Reasons of an ImpVMTemplate, and of a VM that names one (spec.templateRef).
const (
	// ReasonTemplateNotFound: the VM's templateRef names no ImpVMTemplate of its namespace.
	ReasonTemplateNotFound = "TemplateNotFound"
	// ReasonTemplateNotReady: the template's snapshot for the VM's node is being made (its VM
	// boots, or is being snapshotted); the VM starts from it once it is Ready.
	ReasonTemplateNotReady = "TemplateNotReady"
	// ReasonTemplateIncompatible: the VM cannot be a copy of the template (one has a network
	// interface, the other none).
	ReasonTemplateIncompatible = "TemplateIncompatible"
)

// TemplateReadyCondition is True while a snapshot of the template's current revision is Ready
// on some node (or pushed): copies start from it.
const TemplateReadyCondition = "Ready"

// HoldWorkloadAnnotation, "true" on a template's VM (written by the operator when its template
// sets snapshotWhen.beforeWorkload), has the guest ready everything but the workload and wait:
// the copies of its snapshot start their own. The agent honours it only on a VM labelled with
// and controlled by an ImpVMTemplate.
const HoldWorkloadAnnotation = "imp.dev/hold-workload"

// SnapshotWhen says when a template's VM is snapshotted.
// +kubebuilder:validation:XValidation:rule="!(has(self.beforeWorkload) && self.beforeWorkload && has(self.command))",message="command runs once the workload started: it cannot be set with beforeWorkload",fieldPath=".command"
type SnapshotWhen struct {
	// beforeWorkload snapshots the VM booted, its network, volumes and guest channel ready,
	// before its workload starts. Each copy (templateRef) and warm pool claim then starts the
	// workload when it is restored, as its own process: with its own env, Secret and ConfigMap
	// files and host name, and, when it sets them, its own command, args and workingDir (a
	// copy of a template without beforeWorkload cannot: its workload was already running).
	// The template VM's probes are not run (there is no workload); each copy runs its own.
	// +optional
	BeforeWorkload bool `json:"beforeWorkload,omitempty"`

	// command is run in the guest (as an exec readiness probe is, every second) once the
	// workload started; the first time it exits 0, the VM is snapshotted. Without it, the VM is
	// snapshotted once it is Ready (its readinessProbe succeeded, or its workload started).
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=256
	// +kubebuilder:validation:items:MaxLength=4096
	Command []string `json:"command,omitempty"`
}

// ImpVMTemplateSpec is a VM booted once and snapshotted, for copies to start from.
// +kubebuilder:validation:XValidation:rule="!has(self.vm.snapshotRef) && !has(self.vm.templateRef) && !has(self.vm.warmPoolRef)",message="a template's VM boots: it has no snapshotRef, templateRef or warmPoolRef",fieldPath=".vm"
// +kubebuilder:validation:XValidation:rule="!has(self.vm.boot) || self.vm.boot != 'OS'",message="a template's VM cannot boot an OS yet: the snapshots of an OS are not built (docs/os.md)",fieldPath=".vm.boot"
// +kubebuilder:validation:XValidation:rule="!has(self.vm.nodeName)",message="a template's VM is placed on each node that needs it: it has no nodeName (use nodeSelector)",fieldPath=".vm.nodeName"
// +kubebuilder:validation:XValidation:rule="!has(self.vm.expireAfter)",message="a template's VM lives until it is snapshotted: it has no expireAfter",fieldPath=".vm.expireAfter"
// +kubebuilder:validation:XValidation:rule="!has(self.vm.runStrategy) || self.vm.runStrategy == 'Always'",message="a template's VM runs until it is snapshotted: its runStrategy is Always",fieldPath=".vm.runStrategy"
// +kubebuilder:validation:XValidation:rule="!has(self.vm.volumes) || self.vm.volumes.all(v, !has(v.emptyDisk) && !has(v.persistentVolumeClaim))",message="a template's VM has no disk volumes (emptyDisk, persistentVolumeClaim): a snapshot holds no disk volume",fieldPath=".vm.volumes"
type ImpVMTemplateSpec struct {
	// vm is the VM of the template: its image, class or resources, workload, network and
	// probes. IMP boots it on a node that needs the template's snapshot, snapshots it at the
	// point snapshotWhen says, and deletes it. Any change (image, class, env, ...) is a new revision:
	// the template's snapshots are made again, and copies placed afterwards start from them.
	// +required
	VM ImpVMSpec `json:"vm"`

	// snapshotWhen is the point at which the VM is snapshotted.
	// +optional
	SnapshotWhen *SnapshotWhen `json:"snapshotWhen,omitempty"`

	// nodeSelector makes the template's snapshot ahead of time on each IMP node whose labels
	// it matches (an empty selector: every IMP node). Without it, a snapshot is made on a node
	// when the first copy is placed there, and that copy waits for it (TemplateNotReady).
	// +optional
	// +kubebuilder:validation:MaxProperties=32
	NodeSelector map[string]string `json:"nodeSelector,omitempty"`

	// registry pushes the template's snapshot, encrypted, to an OCI registry (as an
	// ImpVMSnapshot's registry does): then one snapshot serves copies on every node, which pull
	// it, instead of one made on each node.
	// +optional
	Registry *SnapshotRegistry `json:"registry,omitempty"`
}

// TemplatePhase is where one of a template's snapshots is.
// +kubebuilder:validation:Enum=Building;Taking;Ready;Failed
type TemplatePhase string

const (
	// TemplateBuilding: the template's VM boots on the node, up to the snapshot point.
	TemplateBuilding TemplatePhase = "Building"
	// TemplateTaking: the VM is being snapshotted.
	TemplateTaking TemplatePhase = "Taking"
	// TemplateReady: copies start from the snapshot.
	TemplateReady TemplatePhase = "Ready"
	// TemplateFailed: the VM or its snapshot failed; it is made again after a minute.
	TemplateFailed TemplatePhase = "Failed"
)

// TemplateSnapshot is one of a template's snapshots.
type TemplateSnapshot struct {
	// nodeName is the node it is made on (unset while a pushed template's VM is not placed).
	// +optional
	NodeName string `json:"nodeName,omitempty"`
	// name is the ImpVMSnapshot (and the name of the VM it is taken of).
	Name string `json:"name"`
	// revision is the template revision it is of.
	Revision string `json:"revision"`
	// phase is Building, Taking, Ready or Failed.
	Phase TemplatePhase `json:"phase"`
	// pushed: the snapshot is in the registry, and serves every node.
	// +optional
	Pushed bool `json:"pushed,omitempty"`
	// message is detail for humans.
	// +optional
	Message string `json:"message,omitempty"`
}

// ImpVMTemplateStatus is what the operator reports of a template.
type ImpVMTemplateStatus struct {
	// observedGeneration is the spec generation the status was computed for.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// revision is a hash of the template's vm and snapshotWhen.
	// +optional
	Revision string `json:"revision,omitempty"`
	// snapshots are the template's snapshots, of this revision and of earlier ones still
	// held by copies that have not started.
	// +optional
	// +listType=atomic
	Snapshots []TemplateSnapshot `json:"snapshots,omitempty"`
	// conditions: Ready.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// ImpVMTemplate is a VM booted once and snapshotted, per node that needs it (or once, pushed to
// a registry), so that ImpVMs naming it in spec.templateRef start as copies of it instead of
// booting. See docs/snapshots.md.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=impvmt,categories=imp
// +kubebuilder:printcolumn:name="Image",type=string,JSONPath=`.spec.vm.image`
// +kubebuilder:printcolumn:name="Revision",type=string,JSONPath=`.status.revision`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ImpVMTemplate struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec ImpVMTemplateSpec `json:"spec"`
	// +optional
	Status ImpVMTemplateStatus `json:"status,omitempty"`
}

// ImpVMTemplateList is a list of ImpVMTemplates.
//
// +kubebuilder:object:root=true
type ImpVMTemplateList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpVMTemplate `json:"items"`
}

// TemplateReference names an ImpVMTemplate of the VM's own namespace.
type TemplateReference struct {
	// name of the ImpVMTemplate.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`
}

// TemplateStatus is the template a copy (spec.templateRef, or a claim's pool's) was placed from: written by the
// operator at placement, so that a later change of the template never changes a placed copy.
type TemplateStatus struct {
	// name is the ImpVMTemplate (a claim's, spec.warmPoolRef, is its pool's template).
	// +optional
	Name string `json:"name,omitempty"`
	// revision is the template revision the copy is of.
	Revision string `json:"revision"`
	// snapshot is the ImpVMSnapshot the copy's first run restores; unset while the template's
	// snapshot for the copy's node is being made.
	// +optional
	Snapshot string `json:"snapshot,omitempty"`
	// beforeWorkload: the snapshot was taken before the template's workload started
	// (snapshotWhen.beforeWorkload); the copy's restore starts it.
	// +optional
	BeforeWorkload bool `json:"beforeWorkload,omitempty"`
	// image, command, args and workingDir are the template's workload: the copy's, for its
	// later runs (which boot from its disk), and for its restore when beforeWorkload (where
	// the copy's own command, args and workingDir, which only such a copy may set, override
	// them as a container's override its image's).
	Image string `json:"image"`
	// +optional
	// +listType=atomic
	Command []string `json:"command,omitempty"`
	// +optional
	// +listType=atomic
	Args []string `json:"args,omitempty"`
	// +optional
	WorkingDir string `json:"workingDir,omitempty"`
}

// Workload is what a VM runs: its image, command, args and workingDir.
type Workload struct {
	Image      string
	Command    []string
	Args       []string
	WorkingDir string
}

// Workload is the VM's own workload, or, for a copy of a template, its template's as its
// placement found it (status.template), with the copy's own command, args and workingDir over
// it when the template's snapshot was taken before its workload (beforeWorkload).
func (vm *ImpVM) Workload() Workload {
	if t := vm.Status.Template; vm.IsCopy() && t != nil {
		w := Workload{Image: t.Image, Command: t.Command, Args: t.Args, WorkingDir: t.WorkingDir}
		if t.BeforeWorkload { // the copy starts the workload: its own overrides apply
			if len(vm.Spec.Command) > 0 {
				w.Command, w.Args = vm.Spec.Command, nil
			}
			if len(vm.Spec.Args) > 0 {
				w.Args = vm.Spec.Args
			}
			if vm.Spec.WorkingDir != "" {
				w.WorkingDir = vm.Spec.WorkingDir
			}
		}
		return w
	}
	return Workload{Image: vm.Spec.Image, Command: vm.Spec.Command, Args: vm.Spec.Args, WorkingDir: vm.Spec.WorkingDir}
}

// RestoreFrom is the ImpVMSnapshot the VM's first run of a placement restores: its
// snapshotRef, or its template's snapshot for its placement; empty when it boots, or when a
// copy's snapshot is not known yet.
func (vm *ImpVM) RestoreFrom() string {
	switch {
	case vm.Spec.SnapshotRef != nil:
		return vm.Spec.SnapshotRef.Name
	case vm.IsCopy() && vm.Status.Template != nil:
		return vm.Status.Template.Snapshot
	}
	return ""
}

func init() {
	SchemeBuilder.Register(&ImpVMTemplate{}, &ImpVMTemplateList{})
}
