package impvm

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/placement"
)

// Migrations places the targets of ImpVMMigrations with the VM reconciler's placement: the
// same nodes (fleet), rules, ledger and quotas as a new VM, so that a target's room is held
// against every other placement while the VM moves (internal/controller/impvmmigration).
type Migrations struct{ R *Reconciler }

// Target chooses the node vm moves to — target when set, else the best node but its own —
// and holds the room of its copy there under hold (the migration's UID) until Release. A
// hold already made gets its node again.
func (m Migrations) Target(ctx context.Context, vm *impv1.ImpVM, hold types.UID, target string) (string, error) {
	r := m.R
	res := vm.Status.Resources
	if res == nil {
		return "", fmt.Errorf("VM %s has no resolved resources", vm.Name)
	}
	quotas, err := r.namespaceQuotas(ctx, vm.Namespace)
	if err != nil {
		return "", err
	}
	// Only a node that takes migrations, and boots guests with the source's kernel and
	// initramfs, under the same VMM giving the same CPU: the guest's memory holds the kernel
	// it booted, and its state the devices this kernel knows and the CPU it booted on.
	source, _ := r.fleet.agent(vm.Status.NodeName)
	kind := res.VMM // the VMM it runs under: the one it asked for, else its node's best
	if kind == "" && source != nil && len(source.Status.VMMs) > 0 {
		kind = source.Status.VMMs[0].Kind
	}
	var nodes []placement.Node
	for _, n := range r.candidates() {
		if n.Node.Name == vm.Status.NodeName || target != "" && n.Node.Name != target || n.Report == nil ||
			n.Report.Status.MigrationEndpoint == "" || !sameArtifact(source, n.Report, func(s *impv1.ImpNodeStatus) *impv1.Artifact { return s.Kernel }) ||
			!sameArtifact(source, n.Report, func(s *impv1.ImpNodeStatus) *impv1.Artifact { return s.Initramfs }) ||
			!sameGuest(source, n.Report, kind) {
			continue
		}
		nodes = append(nodes, n)
	}
	if len(nodes) == 0 {
		return "", &placement.Unschedulable{Message: "no other node takes migrations with the source's kernel and initramfs, and its VMM's version and guest CPU" +
			onlyTarget(target)}
	}
	// The copy counts against the namespace's quota while it is held, as a new VM would;
	// the VM's claims stay the VM's (the migration holds none).
	req := placement.Request{VCPUs: int64(res.VCPUs), MemoryBytes: res.Memory.Value(), VMM: res.VMM, Labels: vm.Spec.RequiredNodeLabels(),
		Tolerations: vm.Spec.Tolerations, Namespace: vm.Namespace, DiskBytes: res.NodeDiskBytes(), Quotas: quotas, VM: vm.Name + " (migrating)"}
	return r.Ledger.Place(hold, req, nodes)
}

// Keep holds node's room for the copy of vm under hold again (the operator restarted with a
// migration under way: its ledger is made from the VMs alone).
func (m Migrations) Keep(vm *impv1.ImpVM, hold types.UID, node string) {
	res := vm.Status.Resources
	if res == nil {
		return
	}
	if n, ok := m.R.Ledger.NodeOf(hold); ok && n == node {
		return
	}
	h := placement.Holding{Node: node, Namespace: vm.Namespace, VCPUs: int64(res.VCPUs), Memory: res.Memory.Value(), Disk: res.NodeDiskBytes(),
		VM: vm.Name + " (migrating)"}
	if res.MemoryOverhead != nil {
		h.Overhead = res.MemoryOverhead.Value()
	}
	m.R.Ledger.Hold(hold, h)
}

// Release lets go of the room held under hold, if any.
func (m Migrations) Release(hold types.UID) {
	if _, held := m.R.Ledger.NodeOf(hold); held {
		m.R.Ledger.Release(hold)
		m.R.signalFreed()
	}
}

// Moved makes the VM's address name node, its new one, once a migration committed: each node's
// agent routes the network's overlay to the VM there from then on.
func (m Migrations) Moved(ctx context.Context, vm *impv1.ImpVM, node string) error {
	ref := vm.Spec.NetworkRef
	if ref == nil {
		return nil
	}
	net := &impv1.ImpNetwork{}
	if err := m.R.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: ref.Name}, net); err != nil {
		return fmt.Errorf("getting ImpNetwork %s of migrated VM %s: %w", ref.Name, vm.Name, err)
	}
	if _, err := m.R.IPAM.Allocate(ctx, net, vm, node); err != nil {
		return fmt.Errorf("moving the address of migrated VM %s to node %s: %w", vm.Name, node, err)
	}
	return nil
}

// sameArtifact says whether the artifact of of the two reports is the same file (by its hash),
// or neither reports one.
func sameArtifact(a, b *impv1.ImpNode, of func(*impv1.ImpNodeStatus) *impv1.Artifact) bool {
	if a == nil || b == nil {
		return a == b
	}
	x, y := of(&a.Status), of(&b.Status)
	if x == nil || y == nil {
		return x == y
	}
	return x.SHA256 == y.SHA256
}

// sameGuest says whether the VMM of kind on b is a's: the same version and acceleration,
// giving its guests the same CPU (VMMCapability.GuestCPU). A node reporting no such VMM is no
// target.
func sameGuest(a, b *impv1.ImpNode, kind impv1.VMMKind) bool {
	find := func(n *impv1.ImpNode) (impv1.VMMCapability, bool) {
		if n != nil {
			for _, c := range n.Status.VMMs {
				if c.Kind == kind {
					return impv1.VMMCapability{Kind: c.Kind, Acceleration: c.Acceleration, Version: c.Version, GuestCPU: c.GuestCPU}, true
				}
			}
		}
		return impv1.VMMCapability{}, false
	}
	x, okA := find(a)
	y, okB := find(b)
	return okA && okB && x == y
}

func onlyTarget(target string) string {
	if target == "" {
		return ""
	}
	return " (asked for node " + target + ")"
}
