package vmm

import "os"

// Drive is an extra block device of a VM (a disk volume): the file or block device at Path on
// the node, or File, already open (a claim's, opened where the kubelet put it), which the guest
// finds by Serial; ReadOnly: the guest may not write it. ID names it among the VM's devices (a
// DNS label).
type Drive struct {
	ID       string   `json:"id"`
	Path     string   `json:"path,omitempty"`
	File     *os.File `json:"-"`
	Serial   string   `json:"serial"`
	ReadOnly bool     `json:"readOnly,omitempty"`
	// Block: a block device (a Block claim's), not a file.
	Block bool `json:"block,omitempty"`
	// Direct: the VMM's I/O to it bypasses the node's page cache (O_DIRECT), as a VM's
	// volumes do under KubeVirt (cache=none): the guest caches, the node does not cache twice,
	// and a write the guest flushed is on the device. Set by the driver where the file or
	// device takes O_DIRECT.
	Direct bool `json:"direct,omitempty"`
	// Own: a file of the VM's own run (an emptyDisk volume's, in its state directory), which no
	// other VMM opens. QEMU takes no image lock on it: through an fd set it holds the file by
	// two descriptions (read-only, read-write), and a mirror to a migration's target, changing
	// the drive's permissions, found its own lock on the other in the way and aborted the VMM.
	Own bool `json:"own,omitempty"`
}
