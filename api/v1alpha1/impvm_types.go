package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Boot says what runs as a guest's PID 1.
// +kubebuilder:validation:Enum=Workload;OS
type Boot string

const (
	// BootWorkload (the default): IMP's init runs the image's entrypoint or the VM's command
	// as the VM's workload; the run ends with it.
	BootWorkload Boot = "Workload"
	// BootOS: the image's own init (/sbin/init, systemd) runs a whole operating system, and
	// IMP's guest side runs beside it as a service of it (docs/os.md).
	BootOS Boot = "OS"
)

// CloudInit is cloud-init's NoCloud data (ImpVM spec.cloudInit).
// +kubebuilder:validation:XValidation:rule="!(has(self.userData) && has(self.userDataSecretRef))",message="userData or userDataSecretRef, not both"
type CloudInit struct {
	// userData is the user data as written here (#cloud-config, a script, ...): anyone who
	// may read the ImpVM reads it. What is secret goes in a Secret, named by userDataSecretRef.
	// +optional
	// +kubebuilder:validation:MaxLength=65536
	UserData string `json:"userData,omitempty"`

	// userDataSecretRef names the key of a Secret of the VM's namespace that holds the user
	// data. It is read at each start of the VM, never copied into the ImpVM or its status.
	// +optional
	UserDataSecretRef *SecretKeyReference `json:"userDataSecretRef,omitempty"`

	// networkData is cloud-init's network configuration (its version 1 or 2). Without it,
	// cloud-init leaves the network alone: IMP configured the VM's address, gateway and DNS
	// before the OS booted.
	// +optional
	// +kubebuilder:validation:MaxLength=16384
	NetworkData string `json:"networkData,omitempty"`
}

// AccessCredential gives users of a VM's OS the SSH public keys of a Secret of the VM's
// namespace (ImpVM spec.accessCredentials).
type AccessCredential struct {
	// sshPublicKeys names the Secret whose data holds the keys: each of its keys' values is
	// one or more lines of an authorized_keys file. The Secret is read while the VM runs; a
	// change reaches the guest within seconds, without a restart.
	// +required
	SSHPublicKeys SSHPublicKeysSource `json:"sshPublicKeys"`

	// users are the OS's users whose ~/.ssh/authorized_keys get the keys (a block of IMP's
	// own in the file, replaced whole on a change; the user's own lines stay). A user the OS
	// does not have yet (one cloud-init makes) gets them once it exists.
	// +required
	// +listType=set
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=16
	// +kubebuilder:validation:items:MaxLength=32
	// +kubebuilder:validation:items:Pattern=`^[a-z_][a-z0-9_-]*$`
	Users []string `json:"users"`
}

// AccessCredentialsStatus is what the operator last read of a VM's access credentials.
type AccessCredentialsStatus struct {
	// digest is the SHA-256 of the keys and users, in hex: what the run's Secret holds.
	// +optional
	Digest string `json:"digest,omitempty"`
	// message says why the keys could not be read (a Secret missing), when they could not.
	// +optional
	Message string `json:"message,omitempty"`
}

// SSHPublicKeysSource names where a VM's SSH public keys are.
type SSHPublicKeysSource struct {
	// secretName is a Secret of the VM's namespace.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	SecretName string `json:"secretName"`
}

// SecretKeyReference names a key of a Secret of the referrer's namespace.
type SecretKeyReference struct {
	// name is the Secret's name, in the namespace of the object that names it.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name"`
	// key is the key of the Secret's data; userdata when not given.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[-._a-zA-Z0-9]+$`
	Key string `json:"key,omitempty"`
}

// UserDataKey is the key of a userDataSecretRef's Secret when its key is not given.
const UserDataKey = "userdata"

// RunStrategy says what happens when a VM's workload exits, and whether the VM runs at all.
// +kubebuilder:validation:Enum=Always;RerunOnFailure;Once;Halted
type RunStrategy string

const (
	// RunStrategyAlways restarts the VM after any exit, successful or not.
	RunStrategyAlways RunStrategy = "Always"
	// RunStrategyRerunOnFailure restarts the VM only after its workload failed.
	RunStrategyRerunOnFailure RunStrategy = "RerunOnFailure"
	// RunStrategyOnce runs the VM once and never restarts it.
	RunStrategyOnce RunStrategy = "Once"
	// RunStrategyHalted stops a running VM and keeps it stopped.
	RunStrategyHalted RunStrategy = "Halted"
)

// VMMKind names a virtual machine monitor an IMP node can run.
// +kubebuilder:validation:Enum=firecracker;qemu
type VMMKind string

const (
	// VMMFirecracker is Firecracker under its jailer: the production VMM (needs /dev/kvm).
	VMMFirecracker VMMKind = "firecracker"
	// VMMQEMU is QEMU's microvm machine, with KVM when present and TCG otherwise.
	VMMQEMU VMMKind = "qemu"
)

// VMPhase is a one-word summary of a VM's state for humans. Logic keys off conditions.
// +kubebuilder:validation:Enum=Pending;Scheduled;Starting;Running;Stopping;Stopped;Succeeded;Failed;Suspending;Suspended;Unknown
type VMPhase string

const (
	// VMPending: accepted, not yet placed on a node.
	VMPending VMPhase = "Pending"
	// VMScheduled: placed on a node (and given an address), the agent has not started it yet.
	VMScheduled VMPhase = "Scheduled"
	// VMStarting: the agent is preparing disks and network or the VMM is booting.
	VMStarting VMPhase = "Starting"
	// VMRunning: the VMM is running.
	VMRunning VMPhase = "Running"
	// VMStopping: the VM is shutting down.
	VMStopping VMPhase = "Stopping"
	// VMStopped: the VM is not running and is not expected to run (runStrategy Halted).
	VMStopped VMPhase = "Stopped"
	// VMSucceeded: the workload exited with code 0 and the runStrategy does not restart it.
	VMSucceeded VMPhase = "Succeeded"
	// VMFailed: the workload or VMM failed and the runStrategy does not restart it.
	VMFailed VMPhase = "Failed"
	// VMSuspending: the VM's memory is being written to a snapshot.
	VMSuspending VMPhase = "Suspending"
	// VMSuspended: the VM's state is on its node's disk and its VMM is gone.
	VMSuspended VMPhase = "Suspended"
	// VMUnknown: the VM's node stopped reporting.
	VMUnknown VMPhase = "Unknown"
)

// ClassReference names a cluster-scoped ImpVMClass.
type ClassReference struct {
	// name of the ImpVMClass.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`
}

// NetworkReference names an ImpNetwork in the VM's own namespace.
type NetworkReference struct {
	// name of the ImpNetwork.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`
}

// VMResources are a VM's inline resources. Each field set here overrides its ImpVMClass.
type VMResources struct {
	// vcpus is the number of virtual CPUs.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=32
	VCPUs *int32 `json:"vcpus,omitempty"`

	// memory is the guest's memory, a whole number of MiB and at least 128Mi (the guest kernel and
	// IMP's initramfs need about 100 MiB).
	// +optional
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('128Mi')) >= 0",message="memory must be at least 128Mi"
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('1Ti')) <= 0",message="memory must be at most 1Ti"
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).isInteger() && quantity(string(self)).asInteger() % 1048576 == 0",message="memory must be a whole number of MiB, such as 512Mi or 2Gi"
	Memory *resource.Quantity `json:"memory,omitempty"`
}

// EnvVar is an environment variable of the VM's workload.
// +kubebuilder:validation:XValidation:rule="!(has(self.value) && has(self.valueFrom))",message="value and valueFrom are mutually exclusive"
type EnvVar struct {
	// name of the variable.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	// +kubebuilder:validation:Pattern=`^[-._a-zA-Z][-._a-zA-Z0-9]*$`
	Name string `json:"name"`

	// value of the variable.
	// +optional
	// +kubebuilder:validation:MaxLength=32768
	Value string `json:"value,omitempty"`

	// valueFrom takes the value from a key of a Secret or ConfigMap in the VM's namespace.
	// +optional
	ValueFrom *EnvVarSource `json:"valueFrom,omitempty"`
}

// EnvVarSource is where an environment variable's value comes from: exactly one of its fields.
// +kubebuilder:validation:XValidation:rule="has(self.secretKeyRef) != has(self.configMapKeyRef)",message="exactly one of secretKeyRef and configMapKeyRef must be set"
type EnvVarSource struct {
	// secretKeyRef selects a key of a Secret.
	// +optional
	SecretKeyRef *corev1.SecretKeySelector `json:"secretKeyRef,omitempty"`

	// configMapKeyRef selects a key of a ConfigMap.
	// +optional
	ConfigMapKeyRef *corev1.ConfigMapKeySelector `json:"configMapKeyRef,omitempty"`
}

// VMPort is a port the VM's workload serves, as a container's port is: Services select the VM
// and name or number its ports as their targetPort, probes may name it. Only declared ports are
// ever reachable through a Service.
type VMPort struct {
	// name of the port (an IANA service name: at most 15 lowercase letters, digits and
	// dashes, with a letter), for a Service's targetPort or a probe's port.
	// +optional
	// +kubebuilder:validation:MaxLength=15
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	// +kubebuilder:validation:XValidation:rule="self.matches('[a-z]') && !self.contains('--')",message="a port name has at least one letter and no two dashes in a row"
	Name string `json:"name,omitempty"`

	// port is the port number in the guest.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65535
	Port int32 `json:"port"`

	// protocol is TCP or UDP.
	// +optional
	// +kubebuilder:default=TCP
	// +kubebuilder:validation:Enum=TCP;UDP
	Protocol corev1.Protocol `json:"protocol,omitempty"`
}

// Probe is a container probe's fields (exec, httpGet, tcpSocket or grpc; its timings and
// thresholds), run by imp-init inside the guest. An httpGet's or tcpSocket's host defaults to
// the guest's loopback, and a port may name one of spec.ports. Defaults are a Pod's.
// +kubebuilder:validation:XValidation:rule="[has(self.exec), has(self.httpGet), has(self.tcpSocket), has(self.grpc)].filter(x, x).size() == 1",message="set exactly one of exec, httpGet, tcpSocket and grpc"
// +kubebuilder:validation:XValidation:rule="!has(self.exec) || (has(self.exec.command) && self.exec.command.size() >= 1 && self.exec.command.size() <= 256)",message="exec.command needs 1 to 256 items"
// +kubebuilder:validation:XValidation:rule="!has(self.httpGet) || !has(self.httpGet.httpHeaders) || self.httpGet.httpHeaders.size() <= 32",message="httpGet.httpHeaders holds at most 32 headers"
// +kubebuilder:validation:XValidation:rule="!has(self.httpGet) || !has(self.httpGet.path) || self.httpGet.path.size() <= 2048",message="httpGet.path is at most 2048 bytes"
// +kubebuilder:validation:XValidation:rule="!has(self.httpGet) || type(self.httpGet.port) == string || (self.httpGet.port >= 1 && self.httpGet.port <= 65535)",message="httpGet.port must be 1 to 65535 or a port's name"
// +kubebuilder:validation:XValidation:rule="!has(self.tcpSocket) || type(self.tcpSocket.port) == string || (self.tcpSocket.port >= 1 && self.tcpSocket.port <= 65535)",message="tcpSocket.port must be 1 to 65535 or a port's name"
// +kubebuilder:validation:XValidation:rule="!has(self.grpc) || (self.grpc.port >= 1 && self.grpc.port <= 65535)",message="grpc.port must be 1 to 65535"
type Probe struct {
	corev1.ProbeHandler `json:",inline"`

	// initialDelaySeconds is how long after the workload starts the probe first runs.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=3600
	InitialDelaySeconds int32 `json:"initialDelaySeconds,omitempty"`

	// timeoutSeconds bounds one attempt.
	// +optional
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=3600
	TimeoutSeconds int32 `json:"timeoutSeconds,omitempty"`

	// periodSeconds is how often the probe runs.
	// +optional
	// +kubebuilder:default=10
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=3600
	PeriodSeconds int32 `json:"periodSeconds,omitempty"`

	// successThreshold is how many successes in a row make a failed probe pass again (1 for
	// startup and liveness probes).
	// +optional
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	SuccessThreshold int32 `json:"successThreshold,omitempty"`

	// failureThreshold is how many failures in a row make the probe fail.
	// +optional
	// +kubebuilder:default=3
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	FailureThreshold int32 `json:"failureThreshold,omitempty"`

	// terminationGracePeriodSeconds replaces the VM's for a kill this (liveness or startup)
	// probe's failure causes.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=3600
	TerminationGracePeriodSeconds *int64 `json:"terminationGracePeriodSeconds,omitempty"`
}

// ImpVMSpec is the desired state of an ImpVM.
//
// classRef and resources together must give both vcpus and memory; inline resources override the
// class. The fields that define the VM's instance (class, resources, disk size, network, VMM) are
// immutable: delete and recreate the ImpVM to change them. The workload fields (image, command,
// args, env, workingDir, stdin, tty) take effect at the VM's next start.
//
// +kubebuilder:validation:XValidation:rule="!has(self.tty) || !self.tty || (has(self.stdin) && self.stdin)",message="tty requires stdin",fieldPath=".tty"
// +kubebuilder:validation:XValidation:rule="!has(self.boot) || self.boot != 'OS' || (!has(self.command) && !has(self.args) && !(has(self.stdin) && self.stdin))",message="boot OS runs the image's /sbin/init: command, args and stdin are a workload's",fieldPath=".boot"
// +kubebuilder:validation:XValidation:rule="!has(self.cloudInit) || (has(self.boot) && self.boot == 'OS')",message="cloudInit is for a VM that boots an OS (boot OS)",fieldPath=".cloudInit"
// +kubebuilder:validation:XValidation:rule="!has(self.accessCredentials) || (has(self.boot) && self.boot == 'OS')",message="accessCredentials are for a VM that boots an OS (boot OS)",fieldPath=".accessCredentials"
// +kubebuilder:validation:XValidation:rule="!has(self.boot) || self.boot != 'OS' || !(has(self.snapshotRef) || has(self.templateRef) || has(self.warmPoolRef))",message="a VM of boot OS cannot be started from a snapshot, template or warm pool yet (docs/os.md)",fieldPath=".boot"
// +kubebuilder:validation:XValidation:rule="has(self.classRef) || has(self.snapshotRef) || has(self.templateRef) || has(self.warmPoolRef) || (has(self.resources) && has(self.resources.vcpus) && has(self.resources.memory))",message="set classRef, or resources with both vcpus and memory"
// +kubebuilder:validation:XValidation:rule="has(self.image) || has(self.templateRef) || has(self.warmPoolRef)",message="image is required (a copy of a template, with templateRef or warmPoolRef, takes its template's)",fieldPath=".image"
// +kubebuilder:validation:XValidation:rule="!has(self.warmPoolRef) || [has(self.templateRef), has(self.snapshotRef), has(self.image), has(self.classRef), has(self.resources), has(self.diskSize), has(self.vmm), has(self.nodeName)].all(x, !x)",message="a claim of a warm pool is a copy of the pool's template: it takes its image, class, resources, disk size and VMM from the template and its node from the pool: set none of them, nor templateRef, snapshotRef or nodeName (command, args and workingDir only when the template sets snapshotWhen.beforeWorkload)",fieldPath=".warmPoolRef"
// +kubebuilder:validation:XValidation:rule="!has(self.templateRef) || !has(self.snapshotRef)",message="set snapshotRef or templateRef, not both",fieldPath=".templateRef"
// +kubebuilder:validation:XValidation:rule="!has(self.idle) || has(self.networkRef)",message="idle needs networkRef: what arrives for the VM over its network is its activity, and wakes it",fieldPath=".idle"
// +kubebuilder:validation:XValidation:rule="!has(self.templateRef) || [has(self.image), has(self.classRef), has(self.resources), has(self.diskSize), has(self.vmm)].all(x, !x)",message="a copy of a template takes its image, class, resources, disk size and VMM from the template: set none of them (command, args and workingDir only when the template sets snapshotWhen.beforeWorkload)",fieldPath=".templateRef"
// +kubebuilder:validation:XValidation:rule="!has(self.startupProbe) || !has(self.startupProbe.httpGet) || type(self.startupProbe.httpGet.port) == int || (has(self.ports) && self.ports.exists(p, has(p.name) && p.name == self.startupProbe.httpGet.port))",message="startupProbe.httpGet.port names no port of spec.ports",fieldPath=".startupProbe.httpGet.port"
// +kubebuilder:validation:XValidation:rule="!has(self.startupProbe) || !has(self.startupProbe.tcpSocket) || type(self.startupProbe.tcpSocket.port) == int || (has(self.ports) && self.ports.exists(p, has(p.name) && p.name == self.startupProbe.tcpSocket.port))",message="startupProbe.tcpSocket.port names no port of spec.ports",fieldPath=".startupProbe.tcpSocket.port"
// +kubebuilder:validation:XValidation:rule="!has(self.readinessProbe) || !has(self.readinessProbe.httpGet) || type(self.readinessProbe.httpGet.port) == int || (has(self.ports) && self.ports.exists(p, has(p.name) && p.name == self.readinessProbe.httpGet.port))",message="readinessProbe.httpGet.port names no port of spec.ports",fieldPath=".readinessProbe.httpGet.port"
// +kubebuilder:validation:XValidation:rule="!has(self.readinessProbe) || !has(self.readinessProbe.tcpSocket) || type(self.readinessProbe.tcpSocket.port) == int || (has(self.ports) && self.ports.exists(p, has(p.name) && p.name == self.readinessProbe.tcpSocket.port))",message="readinessProbe.tcpSocket.port names no port of spec.ports",fieldPath=".readinessProbe.tcpSocket.port"
// +kubebuilder:validation:XValidation:rule="!has(self.livenessProbe) || !has(self.livenessProbe.httpGet) || type(self.livenessProbe.httpGet.port) == int || (has(self.ports) && self.ports.exists(p, has(p.name) && p.name == self.livenessProbe.httpGet.port))",message="livenessProbe.httpGet.port names no port of spec.ports",fieldPath=".livenessProbe.httpGet.port"
// +kubebuilder:validation:XValidation:rule="!has(self.livenessProbe) || !has(self.livenessProbe.tcpSocket) || type(self.livenessProbe.tcpSocket.port) == int || (has(self.ports) && self.ports.exists(p, has(p.name) && p.name == self.livenessProbe.tcpSocket.port))",message="livenessProbe.tcpSocket.port names no port of spec.ports",fieldPath=".livenessProbe.tcpSocket.port"
// +kubebuilder:validation:XValidation:rule="!has(self.livenessProbe) || !has(self.livenessProbe.successThreshold) || self.livenessProbe.successThreshold == 1",message="a liveness probe's successThreshold must be 1",fieldPath=".livenessProbe.successThreshold"
// +kubebuilder:validation:XValidation:rule="!has(self.startupProbe) || !has(self.startupProbe.successThreshold) || self.startupProbe.successThreshold == 1",message="a startup probe's successThreshold must be 1",fieldPath=".startupProbe.successThreshold"
// +kubebuilder:validation:XValidation:rule="!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && self.volumes.exists(v, v.name == m.name))",message="every volumeMount names a volume of spec.volumes",fieldPath=".volumeMounts"
// +kubebuilder:validation:XValidation:rule="!has(self.volumeMounts) || self.volumeMounts.all(m, !has(m.subPath) || size(m.subPath) == 0 || !has(self.volumes) || !self.volumes.exists(v, v.name == m.name && (has(v.emptyDisk) || has(v.persistentVolumeClaim))))",message="subPath is for volumes of files (secret, configMap, downwardAPI), not disks",fieldPath=".volumeMounts"
// +kubebuilder:validation:XValidation:rule="!has(self.volumeDevices) || self.volumeDevices.all(d, has(self.volumes) && self.volumes.exists(v, v.name == d.name && (has(v.emptyDisk) || has(v.persistentVolumeClaim))))",message="every volumeDevice names a disk volume (emptyDisk, persistentVolumeClaim) of spec.volumes",fieldPath=".volumeDevices"
// +kubebuilder:validation:XValidation:rule="!has(self.volumeDevices) || !has(self.volumeMounts) || !self.volumeDevices.exists(d, self.volumeMounts.exists(m, m.name == d.name))",message="a volume is mounted (volumeMounts) or a raw device (volumeDevices), not both",fieldPath=".volumeDevices"
// +kubebuilder:validation:XValidation:rule="!(has(self.snapshotRef) || has(self.templateRef) || has(self.warmPoolRef)) || !has(self.volumes) || self.volumes.all(v, !has(v.emptyDisk) && !has(v.persistentVolumeClaim))",message="a VM started from a snapshot or template cannot have disk volumes (emptyDisk, persistentVolumeClaim): a snapshot holds no disk volume",fieldPath=".volumes"
type ImpVMSpec struct {
	// classRef names the ImpVMClass giving the VM's default vCPUs, memory, disk size and VMM.
	// +optional
	ClassRef *ClassReference `json:"classRef,omitempty"`

	// resources are the VM's vCPUs and memory, overriding its class field by field.
	// +optional
	Resources *VMResources `json:"resources,omitempty"`

	// image is the OCI image whose filesystem becomes the VM's root, such as
	// registry.example.com/team/app:1.2 or ...@sha256:<digest>. A tag is resolved to a digest when
	// the VM is started.
	// It is required but in a copy of a template (templateRef), which takes its template's.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:Pattern=`^[a-zA-Z0-9][a-zA-Z0-9.-]*(:[0-9]+)?(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*(:[a-zA-Z0-9_][a-zA-Z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$`
	Image string `json:"image,omitempty"`

	// boot says what runs as the guest's PID 1. Workload (the default): IMP's init runs the
	// image's entrypoint (or command) as the VM's workload, and the run ends when it exits.
	// OS: the image's own /sbin/init (systemd) boots a whole operating system, with IMP's
	// guest side (exec, probes, readiness) as a service of it; the VM is Ready once the OS
	// says it is up (systemctl is-system-running: running or degraded). See docs/os.md.
	// +optional
	Boot Boot `json:"boot,omitempty"`

	// cloudInit is cloud-init's NoCloud data for a VM of boot OS, given to the guest on a
	// read-only disk labelled cidata (never on a network service a guest's process could
	// reach): its meta-data (instance-id the VM's UID and placement, local-hostname its name),
	// its user data, and its network configuration. See docs/os.md.
	// +optional
	CloudInit *CloudInit `json:"cloudInit,omitempty"`

	// accessCredentials give users of a VM of boot OS SSH public keys from Secrets of the VM's
	// namespace, written by IMP's guest side into their authorized_keys once the OS is up and
	// again whenever a Secret changes, without a restart. See docs/os.md.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=8
	AccessCredentials []AccessCredential `json:"accessCredentials,omitempty"`

	// imagePullSecrets name Secrets of type kubernetes.io/dockerconfigjson in the VM's namespace
	// used to pull image.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=16
	ImagePullSecrets []corev1.LocalObjectReference `json:"imagePullSecrets,omitempty"`

	// command replaces the image's entrypoint.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=256
	// +kubebuilder:validation:items:MaxLength=4096
	Command []string `json:"command,omitempty"`

	// args replaces the image's cmd.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=256
	// +kubebuilder:validation:items:MaxLength=4096
	Args []string `json:"args,omitempty"`

	// env is added to the image's environment; a name here wins over the image's.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=256
	Env []EnvVar `json:"env,omitempty"`

	// workingDir replaces the image's working directory.
	// +optional
	// +kubebuilder:validation:MaxLength=4096
	// +kubebuilder:validation:Pattern=`^/`
	WorkingDir string `json:"workingDir,omitempty"`

	// stdin gives the workload the VM's serial console as its standard input: what
	// `kubectl imp console` (the impvms/console subresource) types reaches it. Without it the
	// workload's input is empty, as a Pod container's is, and what is typed on the console is
	// read by no one.
	// +optional
	Stdin bool `json:"stdin,omitempty"`

	// tty makes the serial console the workload's controlling terminal, as a Pod container's
	// tty does: input is edited and echoed by lines, Ctrl-C sends SIGINT, and its output goes
	// to the console too. Requires stdin.
	// +optional
	TTY bool `json:"tty,omitempty"`

	// networkRef attaches the VM to an ImpNetwork in its namespace, which gives it an address.
	// Without it the VM has no network interface.
	// +optional
	NetworkRef *NetworkReference `json:"networkRef,omitempty"`

	// nodeSelector adds node label requirements. Nodes must always carry imp/enabled=true as
	// well; this field cannot replace that requirement.
	// +optional
	// +kubebuilder:validation:MaxProperties=32
	// +kubebuilder:validation:XValidation:rule="!('imp/enabled' in self) || self['imp/enabled'] == 'true'",message="imp/enabled is always required to be \"true\"; add other labels beside it"
	NodeSelector map[string]string `json:"nodeSelector,omitempty"`

	// tolerations let the VM be placed on nodes with matching taints.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=32
	Tolerations []corev1.Toleration `json:"tolerations,omitempty"`

	// runStrategy says whether the VM runs and whether it is restarted when it exits.
	// +optional
	// +kubebuilder:default=Always
	RunStrategy RunStrategy `json:"runStrategy,omitempty"`

	// evictionStrategy says what becomes of the running VM when its node is evacuated
	// (kubectl imp drain, the taint imp.dev/evacuate:NoExecute): Migrate moves it to another
	// node with its memory (an ImpVMMigration); None (the default) leaves it running where it
	// is, as node maintenance that keeps VMs in place does.
	// +optional
	// +kubebuilder:validation:Enum=Migrate;None
	EvictionStrategy EvictionStrategy `json:"evictionStrategy,omitempty"`

	// terminationGracePeriodSeconds is how long the guest has to shut down cleanly before its
	// VMM is killed.
	// +optional
	// +kubebuilder:default=30
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=3600
	TerminationGracePeriodSeconds *int64 `json:"terminationGracePeriodSeconds,omitempty"`

	// diskSize is the size of the VM's own writable disk (the upper layer over the image). It
	// defaults to the class's defaultDiskSize, then to 1Gi.
	// +optional
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('64Mi')) >= 0",message="diskSize must be at least 64Mi"
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity('16Ti')) <= 0",message="diskSize must be at most 16Ti"
	DiskSize *resource.Quantity `json:"diskSize,omitempty"`

	// vmm asks for a VMM; the VM is then placed only on nodes that offer it. Without it (and
	// without a class preference) a node's best VMM is used: firecracker, else qemu.
	// +optional
	VMM VMMKind `json:"vmm,omitempty"`

	// ports are the ports the VM's workload serves. A Service selecting the VM reaches these
	// and no others.
	// +optional
	// +listType=map
	// +listMapKey=port
	// +listMapKey=protocol
	// +kubebuilder:validation:MaxItems=64
	// +kubebuilder:validation:XValidation:rule="self.all(p, !has(p.name) || self.exists_one(q, has(q.name) && q.name == p.name))",message="port names must be unique"
	Ports []VMPort `json:"ports,omitempty"`

	// startupProbe, as a container's: until it succeeds the other probes do not run, and when
	// it fails failureThreshold times the workload is killed and the VM restarted per its
	// runStrategy. Probes run in the guest (by imp-init), so they need no network.
	// +optional
	StartupProbe *Probe `json:"startupProbe,omitempty"`

	// readinessProbe, as a container's: the VM is Ready, and an endpoint of the Services that
	// select it, only while it succeeds. Without one the VM is Ready once its workload started.
	// +optional
	ReadinessProbe *Probe `json:"readinessProbe,omitempty"`

	// livenessProbe, as a container's: when it fails failureThreshold times the workload is
	// killed (SIGTERM, then SIGKILL after the grace period) and the VM restarted per its
	// runStrategy, with an Unhealthy Event.
	// +optional
	LivenessProbe *Probe `json:"livenessProbe,omitempty"`

	// snapshotRef names an ImpVMSnapshot of the VM's namespace to start from: the VM's first
	// run on a node restores the snapshot (its memory, devices and writable disk) instead of
	// booting, and gets its own identity before it can do anything visible (address, MAC,
	// hostname, guest channel token, its own configuration and Secrets, fresh random state, the
	// clock). The VM takes the snapshot's vCPUs, memory and disk size and runs on its node.
	// Later runs of the same placement boot from the VM's disk. See docs/snapshots.md.
	// +optional
	SnapshotRef *SnapshotReference `json:"snapshotRef,omitempty"`

	// templateRef names an ImpVMTemplate of the VM's namespace: the VM is a copy of the
	// template. Its first run on a node restores the template's snapshot for that node (made
	// there first if there is none, while the VM waits with TemplateNotReady; or the
	// template's pushed snapshot) and gets its own identity, as with snapshotRef. The VM takes
	// the template's image, command, args, workingDir, resources and disk size (set none of
	// them here); its env, Secrets, ports, probes and network are its own. See
	// docs/snapshots.md.
	// +optional
	TemplateRef *TemplateReference `json:"templateRef,omitempty"`

	// warmPoolRef names an ImpWarmPool of the VM's namespace: the VM is a claim. When the pool
	// has an idle member (and the claim its network), the member is handed to the VM and becomes
	// it: its running guest takes the VM's name, identity and configuration, in place of a
	// restore. Otherwise the VM is a copy of the pool's template, restored as with templateRef;
	// it never waits on the pool. status.start says which it was. See docs/warmpools.md.
	// +optional
	WarmPoolRef *WarmPoolReference `json:"warmPoolRef,omitempty"`

	// nodeName places the VM on this node, as a Pod's nodeName does, instead of letting IMP
	// choose; the node must still carry imp/enabled=true, match nodeSelector and have room.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	NodeName string `json:"nodeName,omitempty"`

	// idle suspends the VM once it has been idle for suspendAfter (an ImpVMSuspension with
	// reason Idle), and wakes it when something arrives for it: the first connection or
	// datagram is held on its node, not dropped, and reaches the guest once it runs again. Off
	// without it. See docs/suspend.md ("Idle VMs").
	// +optional
	Idle *IdlePolicy `json:"idle,omitempty"`

	// expireAfter deletes the VM once it has existed this long, such as 1h or 90m.
	// +optional
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s')",message="expireAfter must be at least 1s"
	ExpireAfter *metav1.Duration `json:"expireAfter,omitempty"`

	// volumes are the VM's volumes, as a Pod's: extra disks (emptyDisk) and files from
	// Secrets, ConfigMaps and the VM itself (secret, configMap, downwardAPI). Each is used by a
	// volumeMount or a volumeDevice. See docs/volumes.md.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=16
	Volumes []Volume `json:"volumes,omitempty"`

	// volumeMounts mount volumes in the guest, as a container's: imp-init mounts them before
	// the workload starts.
	// +optional
	// +listType=map
	// +listMapKey=mountPath
	// +kubebuilder:validation:MaxItems=32
	VolumeMounts []VolumeMount `json:"volumeMounts,omitempty"`

	// volumeDevices put disk volumes in the guest as raw block devices at a path, as a
	// container's volumeDevices do.
	// +optional
	// +listType=map
	// +listMapKey=devicePath
	// +kubebuilder:validation:MaxItems=16
	VolumeDevices []VolumeDevice `json:"volumeDevices,omitempty"`
}

// ResolvedResources are what a VM was placed with: its class and inline resources combined at
// placement, so that a later change to the class never changes what a placed VM holds.
type ResolvedResources struct {
	// vcpus is the number of virtual CPUs.
	VCPUs int32 `json:"vcpus"`
	// memory is the guest's memory.
	Memory resource.Quantity `json:"memory"`
	// diskSize is the size of the VM's writable disk.
	DiskSize resource.Quantity `json:"diskSize"`
	// claims are the PersistentVolumeClaims the VM holds alone (ReadWriteOnce), resolved at
	// placement: no other VM is placed with one of them while the VM holds its placement.
	// +optional
	Claims []string `json:"claims,omitempty"`
	// volumeDiskSize is what the VM's disk volumes that IMP makes on its node take there
	// (their emptyDisk capacities); the node's disk and the quota's count it with diskSize.
	// +optional
	VolumeDiskSize *resource.Quantity `json:"volumeDiskSize,omitempty"`
	// vmm is the VMM asked for, empty when any will do.
	// +optional
	VMM VMMKind `json:"vmm,omitempty"`
	// memoryOverhead is what the VM's VMM process holds on its node beyond memory, as the
	// node reported it when the VM was placed; the node's room counts both.
	// +optional
	MemoryOverhead *resource.Quantity `json:"memoryOverhead,omitempty"`
}

// IdlePolicy says when a VM counts as idle and is suspended.
type IdlePolicy struct {
	// suspendAfter is how long the VM must be without activity before it is suspended, such as
	// 10m; at least 10s. Activity: a packet the network delivers to the VM (to its address, by
	// its MAC: through a Service, from a pod, another VM, another node), an exec, console,
	// port-forward or log session through the API while it lasts, and with outbound, a packet
	// the VM sends. A connection left open and silent is not activity; its next packet wakes
	// the VM.
	// +required
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('10s')",message="suspendAfter must be at least 10s"
	SuspendAfter metav1.Duration `json:"suspendAfter"`
	// outbound: what the VM sends counts as activity too (a VM that polls something stays
	// awake).
	// +optional
	Outbound bool `json:"outbound,omitempty"`
}

// SuspensionStatus says that a VM is to be suspended (an ImpVMSuspension of its name exists),
// why, and since when it is.
type SuspensionStatus struct {
	// reason is why the VM was suspended: PressureLifecycle, User or Idle.
	Reason string `json:"reason"`
	// since is when the VM was suspended (its VMM gone); unset while suspending.
	// +optional
	Since *metav1.Time `json:"since,omitempty"`
	// memoryReleased is the memory the node got back.
	// +optional
	MemoryReleased *resource.Quantity `json:"memoryReleased,omitempty"`
	// message is detail for humans.
	// +optional
	Message string `json:"message,omitempty"`
}

// RuntimeState is what a node's agent observed of a VM's current run.
// +kubebuilder:validation:Enum=Starting;Running;Exited;Stopped;Gone;Suspending;Suspended
type RuntimeState string

const (
	// RuntimeStarting: disks, network or the VMM are being prepared, or the guest is booting.
	RuntimeStarting RuntimeState = "Starting"
	// RuntimeRunning: the VMM process runs.
	RuntimeRunning RuntimeState = "Running"
	// RuntimeExited: the run ended by itself (the workload exited, or the VMM died).
	RuntimeExited RuntimeState = "Exited"
	// RuntimeStopped: the agent stopped the VM because it was asked to (runStrategy Halted).
	RuntimeStopped RuntimeState = "Stopped"
	// RuntimeGone: the VM is being deleted and the agent removed its VMM, disks and state.
	RuntimeGone RuntimeState = "Gone"
	// RuntimeResumedMessage is the message of the Running report of a run resumed from a
	// suspension.
	RuntimeResumedMessage = "resumed from suspension"
	// RuntimeSuspending: the agent is saving the VM's memory and device state.
	RuntimeSuspending RuntimeState = "Suspending"
	// RuntimeSuspended: the VM's state is saved on the node and its VMM is gone; the run
	// continues when it is resumed.
	RuntimeSuspended RuntimeState = "Suspended"
)

// RuntimeStatus is what the agent of the VM's node observed. Only the agent writes it; the
// operator reads it and decides.
type RuntimeStatus struct {
	// instance is the status.instance this report is about; a report about another instance
	// is stale and ignored.
	Instance int64 `json:"instance"`
	// run is the status.restartCount this report is about.
	Run int32 `json:"run"`
	// state of the run.
	State RuntimeState `json:"state"`
	// startedAt is when the VMM was started.
	// +optional
	StartedAt *metav1.Time `json:"startedAt,omitempty"`
	// bootMilliseconds is how long the guest took from VMM start to ready.
	// +optional
	BootMilliseconds *int64 `json:"bootMilliseconds,omitempty"`
	// guestReady is true when the guest reported ready over the guest channel.
	// +optional
	GuestReady bool `json:"guestReady,omitempty"`
	// ready is the verdict of the run's readiness probe, as the guest last reported it; unset
	// when the run has none. A run with one starts not ready.
	// +optional
	Ready *bool `json:"ready,omitempty"`
	// endpoint is the address, from its node's endpoint block, at which Services reach the
	// VM's declared ports; unset for a VM without ports or without a network.
	// +optional
	// +kubebuilder:validation:MaxLength=15
	Endpoint string `json:"endpoint,omitempty"`
	// ports are the ports this run forwards at its endpoint: spec.ports as the run started
	// (a change takes effect at the next start). Services reach these.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=64
	Ports []VMPort `json:"ports,omitempty"`
	// finishedAt is when the run ended.
	// +optional
	FinishedAt *metav1.Time `json:"finishedAt,omitempty"`
	// exitCode is the workload's exit code, when the guest reported one.
	// +optional
	ExitCode *int32 `json:"exitCode,omitempty"`
	// reason is a CamelCase word for why the run is in its state (e.g. WorkloadExited,
	// VMMCrashed, StartFailed).
	// +optional
	Reason string `json:"reason,omitempty"`
	// message is detail for humans.
	// +optional
	Message string `json:"message,omitempty"`
	// disksRemoved: the VM finished (Succeeded or Failed) and its node removed its disks after
	// the agent's finished-disk retention. Until then the disks count against the node's disk
	// and the namespace's ImpQuota disk.
	// +optional
	DisksRemoved bool `json:"disksRemoved,omitempty"`
	// restoredFrom is the ImpVMSnapshot (name) this run was restored from, instead of booted.
	// +optional
	RestoredFrom string `json:"restoredFrom,omitempty"`
	// idleSince: the run has had no activity since then, for at least its spec.idle's
	// suspendAfter (reported once; the operator suspends it, reason Idle).
	// +optional
	IdleSince *metav1.Time `json:"idleSince,omitempty"`
	// wakeRequested: while suspended because it was idle, something arrived for the VM at
	// this time, and its node holds it: the operator resumes the VM.
	// +optional
	WakeRequested *metav1.Time `json:"wakeRequested,omitempty"`
}

// ImpVMStatus is the observed state of an ImpVM. The operator writes everything but runtime:
// placement (nodeName, ip, resources, instance), the restart decisions and the conditions. The
// node's agent writes only runtime.
type ImpVMStatus struct {
	// observedGeneration is the spec generation the status was last computed for.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// phase is a one-word summary for humans; conditions carry the detail.
	// +optional
	Phase VMPhase `json:"phase,omitempty"`

	// nodeName is the node the VM is placed on. Set once per instance by the operator.
	// +optional
	NodeName string `json:"nodeName,omitempty"`

	// ip is the VM's address on its ImpNetwork. Set once per instance by the operator.
	// +optional
	IP string `json:"ip,omitempty"`

	// resources are what the VM was placed with.
	// +optional
	Resources *ResolvedResources `json:"resources,omitempty"`

	// instance counts placements: it grows each time the VM is placed anew (after its node was
	// lost). An agent runs only the current instance of a VM placed on its own node.
	// +optional
	Instance int64 `json:"instance,omitempty"`

	// runtime is what the node's agent observed of the VM's current run.
	// +optional
	Runtime *RuntimeStatus `json:"runtime,omitempty"`

	// conditions: Scheduled, Ready, and others; reasons are documented in conditions.go.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// startedAt is when the VM's current run started.
	// +optional
	StartedAt *metav1.Time `json:"startedAt,omitempty"`

	// restartCount counts restarts made by the runStrategy. The agent starts run number
	// restartCount of the current instance when it has not run yet.
	// +optional
	RestartCount int32 `json:"restartCount,omitempty"`

	// nextRestartAt is when the VM, which exited, will be restarted (exponential back-off).
	// +optional
	NextRestartAt *metav1.Time `json:"nextRestartAt,omitempty"`

	// suspension is set while the VM is suspended.
	// +optional
	Suspension *SuspensionStatus `json:"suspension,omitempty"`

	// template is, for a copy of a template (spec.templateRef), the template as its placement
	// found it, and the snapshot its first run restores.
	// +optional
	Template *TemplateStatus `json:"template,omitempty"`

	// accessCredentials is the digest of the SSH public keys spec.accessCredentials name, as
	// the operator last read them (it reads them every few seconds while the VM runs); the
	// agent gives the guest the keys of this digest. Operator-owned.
	// +optional
	AccessCredentials *AccessCredentialsStatus `json:"accessCredentials,omitempty"`

	// volumeHolder is the pod holding the VM's PVCs on its node (docs/volumes.md); the VM's
	// run starts once it is ready. Operator-owned.
	// +optional
	VolumeHolder *VolumeHolderStatus `json:"volumeHolder,omitempty"`

	// image is the image the VM runs: spec.image, or for a copy of a template (or a claim) its
	// template's as its placement found it (empty until it is placed).
	// +optional
	Image string `json:"image,omitempty"`

	// start is how the VM's placement starts: warm (a warm pool's idle member was handed to
	// it), restored (from a snapshot or a template's) or booted. Set at placement.
	// +optional
	Start VMStart `json:"start,omitempty"`

	// warm is, for a claim served warm, the member it was handed. Set with the placement, in
	// the same write.
	// +optional
	Warm *WarmStatus `json:"warm,omitempty"`

	// migration is set while an ImpVMMigration moves the VM (operator-owned): at most one at a
	// time, the one named here.
	// +optional
	Migration *MigrationStatus `json:"migration,omitempty"`
}

// ImpVM is a Firecracker (or QEMU) microVM run from an OCI image.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:validation:XValidation:rule="has(self.spec.templateRef) == has(oldSelf.spec.templateRef) && (!has(self.spec.templateRef) || self.spec.templateRef == oldSelf.spec.templateRef)",message="templateRef is immutable; delete and recreate the ImpVM to change it",fieldPath=".spec.templateRef"
// +kubebuilder:validation:XValidation:rule="has(self.spec.warmPoolRef) == has(oldSelf.spec.warmPoolRef) && (!has(self.spec.warmPoolRef) || self.spec.warmPoolRef == oldSelf.spec.warmPoolRef)",message="warmPoolRef is immutable; delete and recreate the ImpVM to change it",fieldPath=".spec.warmPoolRef"
// +kubebuilder:validation:XValidation:rule="has(self.spec.nodeName) == has(oldSelf.spec.nodeName) && (!has(self.spec.nodeName) || self.spec.nodeName == oldSelf.spec.nodeName)",message="nodeName is immutable; delete and recreate the ImpVM to change it",fieldPath=".spec.nodeName"
// +kubebuilder:validation:XValidation:rule="has(self.spec.classRef) == has(oldSelf.spec.classRef) && (!has(self.spec.classRef) || self.spec.classRef == oldSelf.spec.classRef)",message="classRef is immutable; delete and recreate the ImpVM to change it",fieldPath=".spec.classRef"
// +kubebuilder:validation:XValidation:rule="has(self.spec.resources) == has(oldSelf.spec.resources) && (!has(self.spec.resources) || self.spec.resources == oldSelf.spec.resources)",message="resources are immutable; delete and recreate the ImpVM to change them",fieldPath=".spec.resources"
// +kubebuilder:validation:XValidation:rule="has(self.spec.diskSize) == has(oldSelf.spec.diskSize) && (!has(self.spec.diskSize) || self.spec.diskSize == oldSelf.spec.diskSize)",message="diskSize is immutable; delete and recreate the ImpVM to change it",fieldPath=".spec.diskSize"
// +kubebuilder:validation:XValidation:rule="has(self.spec.networkRef) == has(oldSelf.spec.networkRef) && (!has(self.spec.networkRef) || self.spec.networkRef == oldSelf.spec.networkRef)",message="networkRef is immutable; delete and recreate the ImpVM to change it",fieldPath=".spec.networkRef"
// +kubebuilder:validation:XValidation:rule="has(self.spec.vmm) == has(oldSelf.spec.vmm) && (!has(self.spec.vmm) || self.spec.vmm == oldSelf.spec.vmm)",message="vmm is immutable; delete and recreate the ImpVM to change it",fieldPath=".spec.vmm"
// +kubebuilder:validation:XValidation:rule="has(self.spec.snapshotRef) == has(oldSelf.spec.snapshotRef) && (!has(self.spec.snapshotRef) || self.spec.snapshotRef == oldSelf.spec.snapshotRef)",message="snapshotRef is immutable; delete and recreate the ImpVM to change it",fieldPath=".spec.snapshotRef"
// +kubebuilder:validation:XValidation:rule="has(self.spec.volumes) == has(oldSelf.spec.volumes) && (!has(self.spec.volumes) || self.spec.volumes == oldSelf.spec.volumes)",message="volumes are immutable; delete and recreate the ImpVM to change them",fieldPath=".spec.volumes"
// +kubebuilder:validation:XValidation:rule="has(self.spec.volumeMounts) == has(oldSelf.spec.volumeMounts) && (!has(self.spec.volumeMounts) || self.spec.volumeMounts == oldSelf.spec.volumeMounts)",message="volumeMounts are immutable; delete and recreate the ImpVM to change them",fieldPath=".spec.volumeMounts"
// +kubebuilder:validation:XValidation:rule="has(self.spec.volumeDevices) == has(oldSelf.spec.volumeDevices) && (!has(self.spec.volumeDevices) || self.spec.volumeDevices == oldSelf.spec.volumeDevices)",message="volumeDevices are immutable; delete and recreate the ImpVM to change them",fieldPath=".spec.volumeDevices"
// +kubebuilder:resource:shortName=impvm,categories=imp
// +kubebuilder:selectablefield:JSONPath=`.status.nodeName`
// +kubebuilder:printcolumn:name="Phase",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.status.nodeName`
// +kubebuilder:printcolumn:name="IP",type=string,JSONPath=`.status.ip`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="VCPUs",type=integer,JSONPath=`.status.resources.vcpus`,priority=1
// +kubebuilder:printcolumn:name="Memory",type=string,JSONPath=`.status.resources.memory`,priority=1
// +kubebuilder:printcolumn:name="Image",type=string,JSONPath=`.status.image`,priority=1
// +kubebuilder:printcolumn:name="Start",type=string,JSONPath=`.status.start`,priority=1
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`,priority=1
type ImpVM struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec ImpVMSpec `json:"spec"`
	// +optional
	Status ImpVMStatus `json:"status,omitempty"`
}

// ImpVMList is a list of ImpVMs.
//
// +kubebuilder:object:root=true
type ImpVMList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ImpVM `json:"items"`
}

func init() {
	SchemeBuilder.Register(&ImpVM{}, &ImpVMList{})
}
