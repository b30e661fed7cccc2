package v1alpha1

import metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

// VMFigures are an ImpVM's figures at a moment, as its subresource stats serves them (API group
// subresources.imp.dev, from its node's agent; kubectl imp top): the node's side, which needs
// nothing of the guest, and the guest's own word when it said any within the last minute.
// They are not stored: each request reads them anew.
type VMFigures struct {
	// at is when the node read them.
	At metav1.MicroTime `json:"at"`
	// vmmCPUSeconds is the CPU time of the VM's VMM process: its vCPUs and the VMM's own work.
	VMMCPUSeconds float64 `json:"vmmCPUSeconds"`
	// vmmResidentBytes is the memory its VMM process holds on the node (resident set).
	VMMResidentBytes uint64 `json:"vmmResidentBytes"`
	// diskAllocatedBytes is what its writable disk takes on the node.
	DiskAllocatedBytes uint64 `json:"diskAllocatedBytes"`
	// network is what the VM's tap carried, as the node's kernel counts it (a VM on a network).
	// +optional
	Network *NetworkFigures `json:"network,omitempty"`
	// guest is what the guest last said of itself (imp-init), when within a minute.
	// +optional
	Guest *GuestFigures `json:"guest,omitempty"`
}

// NetworkFigures are what a VM's tap carried since it was made, from the guest's side:
// received is what the node delivered to the guest, transmitted what the guest sent
// (including what its network's rules then dropped). The node counts them, not the guest.
type NetworkFigures struct {
	// at is when the node read them (the node reads them at most once a second).
	At              metav1.MicroTime `json:"at"`
	ReceiveBytes    uint64           `json:"receiveBytes"`
	ReceivePackets  uint64           `json:"receivePackets"`
	TransmitBytes   uint64           `json:"transmitBytes"`
	TransmitPackets uint64           `json:"transmitPackets"`
}

// GuestFigures are a guest's own figures, its kernel's as imp-init reports them: the guest's
// word, bounded by the node (never more memory than the VM has).
type GuestFigures struct {
	// at is when the guest said them.
	At metav1.MicroTime `json:"at"`
	// memoryBytes and memoryAvailableBytes are the kernel's MemTotal and MemAvailable.
	MemoryBytes          uint64 `json:"memoryBytes"`
	MemoryAvailableBytes uint64 `json:"memoryAvailableBytes"`
	// cpuSeconds is the time its vCPUs spent busy since boot.
	CPUSeconds float64 `json:"cpuSeconds"`
	// filesystemSizeBytes and filesystemFreeBytes are its root filesystem's.
	FilesystemSizeBytes uint64 `json:"filesystemSizeBytes"`
	FilesystemFreeBytes uint64 `json:"filesystemFreeBytes"`
}
