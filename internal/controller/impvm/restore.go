package impvm

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/placement"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvmsnapshots,verbs=get;list;watch

// indexSnapshot indexes ImpVMs by the ImpVMSnapshot they start from.
const indexSnapshot = "spec.snapshotRef.name"

// restoreSource is what a VM that starts from a snapshot (spec.snapshotRef) is placed by: the
// snapshot's resources and VMM instead of its class's, and the snapshot's node alone. It
// returns false, with the scope's reason set, while the VM cannot be placed: the snapshot is
// not in the VM's namespace (which is where it is looked for: another namespace's cannot be
// named), not Ready, or not what the VM asks for.
func (r *Reconciler) restoreSource(ctx context.Context, s *scope, res *impv1.ResolvedResources) (node string, ok bool, err error) {
	vm := s.vm
	snap := &impv1.ImpVMSnapshot{}
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: vm.Spec.SnapshotRef.Name}, snap); err != nil {
		if apierrors.IsNotFound(err) {
			s.schedReason, s.schedMsg = impv1.ReasonSnapshotNotFound, fmt.Sprintf("ImpVMSnapshot %q does not exist in namespace %s", vm.Spec.SnapshotRef.Name, vm.Namespace)
			return "", false, nil
		}
		return "", false, fmt.Errorf("getting ImpVMSnapshot %s: %w", vm.Spec.SnapshotRef.Name, err)
	}
	if !snap.DeletionTimestamp.IsZero() {
		s.schedReason, s.schedMsg = impv1.ReasonSnapshotNotFound, fmt.Sprintf("ImpVMSnapshot %s is being deleted", snap.Name)
		return "", false, nil
	}
	src := snap.Status.Source
	if snap.Status.Phase != impv1.SnapshotReady || src == nil || snap.Status.NodeName == "" {
		msg := fmt.Sprintf("ImpVMSnapshot %s is %s", snap.Name, phaseOr(snap.Status.Phase))
		if snap.Status.Message != "" {
			msg += ": " + snap.Status.Message
		}
		s.schedReason, s.schedMsg = impv1.ReasonSnapshotNotReady, msg
		return "", false, nil
	}
	if vm.Spec.VMM != "" && vm.Spec.VMM != src.VMM {
		s.schedReason, s.schedMsg = impv1.ReasonSnapshotIncompatible, fmt.Sprintf("ImpVMSnapshot %s was taken under %s; the VM asks for %s", snap.Name, src.VMM, vm.Spec.VMM)
		return "", false, reconcile.TerminalError(fmt.Errorf("%s", s.schedMsg))
	}
	if (vm.Spec.NetworkRef != nil) != src.Network {
		has := map[bool]string{true: "had a network interface", false: "had no network interface"}
		s.schedReason, s.schedMsg = impv1.ReasonSnapshotIncompatible, fmt.Sprintf("the VM of ImpVMSnapshot %s %s; this VM must too (its devices are the snapshot's)", snap.Name, has[src.Network])
		return "", false, reconcile.TerminalError(fmt.Errorf("%s", s.schedMsg))
	}
	res.VCPUs, res.Memory, res.DiskSize, res.VMM = src.VCPUs, src.Memory.DeepCopy(), src.DiskSize.DeepCopy(), src.VMM
	if snap.Spec.Registry != nil && snap.Status.Digest != "" {
		return "", true, nil // pushed: any node that runs its VMM pulls it
	}
	return snap.Status.NodeName, true, nil
}

func phaseOr(p impv1.SnapshotPhase) string {
	if p == "" {
		return "not taken yet"
	}
	return string(p)
}

// onlyNode keeps the node named name of nodes.
func onlyNode(nodes []placement.Node, name string) []placement.Node {
	for _, n := range nodes {
		if n.Node.Name == name {
			return []placement.Node{n}
		}
	}
	return nil
}

// forSnapshot: the VMs of the snapshot's namespace that wait for it.
func (r *Reconciler) forSnapshot(ctx context.Context, o client.Object) []reconcile.Request {
	return r.list(ctx, true, client.InNamespace(o.GetNamespace()), client.MatchingFields{indexSnapshot: o.GetName()})
}
