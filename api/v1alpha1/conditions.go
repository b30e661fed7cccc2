package v1alpha1

// Labels IMP reads or writes.
const (
	// NodeEnabledLabel marks a node as opted in to IMP. Placement always requires it to be
	// NodeEnabledValue, whatever else a VM selects.
	NodeEnabledLabel = "imp/enabled"
	// NodeEnabledValue is the value NodeEnabledLabel must have.
	NodeEnabledValue = "true"

	// NetworkLabel is set on an ImpIPAddress to the name of its ImpNetwork.
	NetworkLabel = "imp.dev/network"
	// RestartRequestedAnnotation on an ImpVM asks for a new run (kubectl imp restart): its value
	// is the time of the request (RFC 3339); a run started before it is ended and restarted.
	RestartRequestedAnnotation = "imp.dev/restart-requested-at"
	// VMUIDLabel is set on an ImpIPAddress to the UID of the ImpVM holding it.
	VMUIDLabel = "imp.dev/vm-uid"

	// VMFinalizer holds an ImpVM until its node confirmed the VM is gone and its address is released.
	VMFinalizer = "imp.dev/vm"

	// AgentLeaseLabel marks the Lease each node's agent renews in IMP's namespace, its
	// heartbeat; the Lease is named AgentLeasePrefix + the node's name, and its holderIdentity
	// is the node's name. Heartbeats are Leases, as the kubelet's are, so that they reach the
	// operator and no agent: every agent watches ImpNodes.
	AgentLeaseLabel = "imp.dev/agent-heartbeat"
	// AgentLeasePrefix begins the name of a node's agent Lease.
	AgentLeasePrefix = "imp-agent-"
)

// ImpVM condition types.
const (
	// ScheduledCondition is True once the VM has a node (and, with a networkRef, an address).
	ScheduledCondition = "Scheduled"
	// ReadyCondition is True while the VM runs, its guest reports ready and its readiness probe,
	// if it has one, passes: a Service's endpoint is ready exactly then.
	ReadyCondition = "Ready"
	// SuspendedCondition is True while the VM is suspended; its reason says why
	// (PressureLifecycle or User) and its message by whom or what.
	SuspendedCondition = "Suspended"
	// ReasonNotSuspended: the VM is not suspended.
	ReasonNotSuspended = "NotSuspended"
	// ReasonSuspending: the VM's state is being saved.
	ReasonSuspending = "Suspending"
	// ReasonSuspendFailed: saving the VM's state failed; the VM keeps running (also the
	// reason of its status.runtime).
	ReasonSuspendFailed = "SuspendFailed"
)

// Reasons of ScheduledCondition.
const (
	// ReasonPlaced: the VM was placed on status.nodeName.
	ReasonPlaced = "Placed"
	// ReasonClassNotFound: spec.classRef names an ImpVMClass that does not exist.
	ReasonClassNotFound = "ClassNotFound"
	// ReasonNetworkNotFound: spec.networkRef names an ImpNetwork that does not exist in the
	// VM's namespace.
	ReasonNetworkNotFound = "NetworkNotFound"
	// ReasonVolumeClaimNotFound: a persistentVolumeClaim volume names a PVC that does not
	// exist in the VM's namespace.
	ReasonVolumeClaimNotFound = "VolumeClaimNotFound"
	// ReasonVolumeClaimNotBound: a PVC of immediate binding is not bound to a volume yet.
	ReasonVolumeClaimNotBound = "VolumeClaimNotBound"
	// ReasonVolumeInUse: a ReadWriteOnce PVC of the VM is attached to another VM.
	ReasonVolumeInUse = "VolumeInUse"
	// ReasonVolumesNotReady: the VM is placed and waits for its node's kubelet to attach its
	// PVCs (its holder pod to run).
	ReasonVolumesNotReady = "VolumesNotReady"
	// ReasonNetworkExhausted: the VM's ImpNetwork has no free address.
	ReasonNetworkExhausted = "NetworkExhausted"
	// ReasonNoNodeAvailable: no node matches the VM's requirements and has room for it.
	ReasonNoNodeAvailable = "NoNodeAvailable"
	// ReasonInvalidSpec: the spec passed the API's validation but cannot be acted on, such as a
	// node selector with an invalid label value. Retrying cannot fix it; editing the VM can.
	ReasonInvalidSpec = "InvalidSpec"
	// ReasonNodeLost: the VM's node was deleted or fenced (tainted out of service), so the VM
	// no longer runs there.
	ReasonNodeLost = "NodeLost"
)

// ReasonNodeUnreachable (ReadyCondition): neither the node's kubelet nor its IMP agent has
// reported for the grace period. The VM may still run there, so it is not started elsewhere
// until the node is fenced.
const ReasonNodeUnreachable = "NodeUnreachable"

// Reasons of ReadyCondition.
const (
	// ReasonNotScheduled: the VM has no node yet.
	ReasonNotScheduled = "NotScheduled"
	// ReasonStarting: the node is preparing disks and network, or the VMM is booting.
	ReasonStarting = "Starting"
	// ReasonGuestReady: the VMM runs and the guest reported ready over the guest channel.
	ReasonGuestReady = "GuestReady"
	// ReasonGuestNotReady: the VMM runs but the guest has not reported ready.
	ReasonGuestNotReady = "GuestNotReady"
	// ReasonNotServing: the guest is ready but its readiness probe has not passed (or failed).
	ReasonNotServing = "ReadinessProbeFailing"
	// ReasonLivenessProbeFailed (of status.runtime): the liveness or startup probe failed
	// failureThreshold times, so the guest killed the workload; the runStrategy decides.
	ReasonLivenessProbeFailed = "LivenessProbeFailed"
	// ReasonBootTimeout (of status.runtime): the guest was not ready within the agent's boot
	// timeout, so its VMM was ended; the runStrategy decides.
	ReasonBootTimeout = "BootTimeout"
	// ReasonExited: the workload exited (see the condition's message for the code).
	ReasonExited = "Exited"
	// ReasonBackoff: the VM exited and waits before its runStrategy restarts it.
	ReasonBackoff = "Backoff"
	// ReasonHalted: runStrategy is Halted.
	ReasonHalted = "Halted"
	// ReasonSuspended: the VM's state is saved on its node and its VMM is gone.
	ReasonSuspended = "Suspended"
	// ReasonStartFailed: the node could not start the VM (see the message).
	ReasonStartFailed = "StartFailed"
)

// Reasons of ImpNode's ReadyCondition.
const (
	// ReasonAgentReady: the node's agent reports and can run VMs.
	ReasonAgentReady = "AgentReady"
	// ReasonNoVMM: the node's agent found no VMM it can run.
	ReasonNoVMM = "NoVMM"
)

// ImpNetwork condition types and reasons.
const (
	// NetworkReadyCondition is True when the network's spec is usable and addresses remain.
	NetworkReadyCondition = "Ready"
	// NetworkNodesReadyCondition is True when every node that has VMs of the network reports
	// it plumbed (ImpNode status.networks).
	NetworkNodesReadyCondition = "NodesReady"
	// ReasonNodesReady: every node with VMs of the network has plumbed it.
	ReasonNodesReady = "NodesReady"
	// ReasonNodeNetworkFailed: a node could not plumb the network; the message names it.
	ReasonNodeNetworkFailed = "NodeNetworkFailed"
	// ReasonNetworkValid: the network is usable.
	ReasonNetworkValid = "Valid"
	// ReasonInvalidGateway: the gateway is the broadcast address or otherwise unusable.
	ReasonInvalidGateway = "InvalidGateway"
	// ReasonAddressesExhausted: every address of the network is allocated.
	ReasonAddressesExhausted = "AddressesExhausted"
	// ReasonReservedCIDR: the network's CIDR overlaps a range the cluster reserves (the
	// operator's --reserved-cidrs, chart value network.reservedCIDRs); the message names it. A
	// VM on such a network is not placed, with the same reason.
	ReasonReservedCIDR = "ReservedCIDR"
)
