package impvm

import (
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/placement"
)

// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims;persistentvolumes,verbs=get;list;watch
// +kubebuilder:rbac:groups=storage.k8s.io,resources=storageclasses,verbs=get;list;watch

// claimWait is how often a VM waiting for a PVC (to exist, to be bound, to be let go by
// another VM) looks again: PVCs are not watched.
const claimWait = 5 * time.Second

// claimPlacement resolves the VM's PVCs for its placement: the claims it must hold alone
// (ReadWriteOnce, ReadWriteOncePod), and the nodes their volumes can attach to (a bound
// volume's node affinity; an unbound claim of WaitForFirstConsumer binding anywhere, its volume
// made where the VM goes). ok is false when the VM must wait (the reason in s): a missing claim,
// or an unbound one of immediate binding.
func (r *Reconciler) claimPlacement(ctx context.Context, s *scope, nodes []placement.Node) (exclusive []string, fit []placement.Node, ok bool, err error) {
	vm := s.vm
	fit = nodes
	for _, name := range vm.Spec.Claims() {
		pvc := &corev1.PersistentVolumeClaim{}
		if err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: name}, pvc); err != nil {
			if apierrors.IsNotFound(err) {
				s.schedReason, s.schedMsg = impv1.ReasonVolumeClaimNotFound, fmt.Sprintf("PersistentVolumeClaim %q does not exist in namespace %s", name, vm.Namespace)
				s.requeueAfter(claimWait)
				return nil, nil, false, nil
			}
			return nil, nil, false, fmt.Errorf("getting PersistentVolumeClaim %s: %w", name, err)
		}
		if !slices.Contains(pvc.Spec.AccessModes, corev1.ReadWriteMany) && !slices.Contains(pvc.Spec.AccessModes, corev1.ReadOnlyMany) {
			exclusive = append(exclusive, vm.Namespace+"/"+name)
		}
		if pvc.Spec.VolumeName == "" {
			wffc, err := r.waitsForConsumer(ctx, pvc)
			if err != nil {
				return nil, nil, false, err
			}
			if !wffc {
				s.schedReason, s.schedMsg = impv1.ReasonVolumeClaimNotBound, fmt.Sprintf("PersistentVolumeClaim %s is not bound to a volume yet", name)
				s.requeueAfter(claimWait)
				return nil, nil, false, nil
			}
			continue // its volume is made on the VM's node
		}
		pv := &corev1.PersistentVolume{}
		if err := r.APIReader.Get(ctx, types.NamespacedName{Name: pvc.Spec.VolumeName}, pv); err != nil {
			if apierrors.IsNotFound(err) {
				s.schedReason, s.schedMsg = impv1.ReasonVolumeClaimNotBound, fmt.Sprintf("PersistentVolumeClaim %s is bound to PersistentVolume %s, which does not exist", name, pvc.Spec.VolumeName)
				s.requeueAfter(claimWait)
				return nil, nil, false, nil
			}
			return nil, nil, false, fmt.Errorf("getting PersistentVolume %s: %w", pvc.Spec.VolumeName, err)
		}
		if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
			continue
		}
		sel := nodeaffinity.NewLazyErrorNodeSelector(pv.Spec.NodeAffinity.Required)
		var keep []placement.Node
		for _, n := range fit {
			if ok, _ := sel.Match(n.Node); ok {
				keep = append(keep, n)
			}
		}
		fit = keep
	}
	return exclusive, fit, true, nil
}

// waitsForConsumer reports whether pvc's StorageClass binds it when a pod uses it
// (WaitForFirstConsumer), so that its volume is made on the node the VM is placed on.
func (r *Reconciler) waitsForConsumer(ctx context.Context, pvc *corev1.PersistentVolumeClaim) (bool, error) {
	name := ""
	if pvc.Spec.StorageClassName != nil {
		name = *pvc.Spec.StorageClassName
	}
	if name == "" {
		return false, nil
	}
	sc := &storagev1.StorageClass{}
	if err := r.APIReader.Get(ctx, types.NamespacedName{Name: name}, sc); err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("getting StorageClass %s: %w", name, err)
	}
	return sc.VolumeBindingMode != nil && *sc.VolumeBindingMode == storagev1.VolumeBindingWaitForFirstConsumer, nil
}

// reconcileVolumes keeps a placed VM with PVCs from starting until its holder pod runs on its
// node with the claims attached (status.volumeHolder, the volumeholder controller's): until
// then it waits, VolumesNotReady.
func (r *Reconciler) reconcileVolumes(_ context.Context, s *scope) error {
	vm := s.vm
	if len(vm.Spec.Claims()) == 0 || vm.Status.NodeName == "" || isTerminal(vm.Status.Phase) || s.waitReason != "" {
		return nil
	}
	h := vm.Status.VolumeHolder
	switch {
	case h == nil || h.NodeName != vm.Status.NodeName:
		s.waitReason, s.waitMsg = impv1.ReasonVolumesNotReady, fmt.Sprintf("the pod holding the VM's PersistentVolumeClaims on node %s is being made", vm.Status.NodeName)
	case !h.Ready:
		s.waitReason, s.waitMsg = impv1.ReasonVolumesNotReady, fmt.Sprintf("pod %s, holding the VM's PersistentVolumeClaims: %s", h.PodName, h.Message)
	}
	return nil
}
