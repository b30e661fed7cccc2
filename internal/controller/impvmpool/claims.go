package impvmpool

import (
	"context"
	"fmt"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims,verbs=get;list;watch;create

// ClaimName is the name of a member's claim of template t: <t>-<pool>-<index>.
func ClaimName(t, pool string, idx int) string { return t + "-" + pool + "-" + strconv.Itoa(idx) }

// ensureClaims makes the claims of the member at idx that do not exist yet. A claim that
// exists is the member's, whoever made it: that is how a member made again at its index (or
// a pool made again) finds its data, as a StatefulSet's pods do.
func (r *Reconciler) ensureClaims(ctx context.Context, pool *impv1.ImpVMPool, idx int) error {
	for _, t := range pool.Spec.VolumeClaimTemplates {
		pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: pool.Namespace, Name: ClaimName(t.Name, pool.Name, idx),
			Labels: map[string]string{}}, Spec: *t.Spec.DeepCopy()}
		for k, v := range t.Labels {
			pvc.Labels[k] = v
		}
		pvc.Labels[impv1.PoolLabel], pvc.Labels[impv1.PoolIndexLabel] = pool.Name, strconv.Itoa(idx)
		if pool.Spec.ClaimRetention != nil && pool.Spec.ClaimRetention.WhenDeleted == "Delete" {
			pvc.OwnerReferences = []metav1.OwnerReference{*metav1.NewControllerRef(pool, impv1.GroupVersion.WithKind("ImpVMPool"))}
		}
		if err := r.Client.Create(ctx, pvc); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("creating claim %s of member %s: %w", pvc.Name, memberName(pool, idx), err)
		}
	}
	return nil
}

// withClaims gives vm (the member at idx) its own claims: each volume whose claimName names
// one of the pool's claim templates.
func withClaims(pool *impv1.ImpVMPool, vm *impv1.ImpVM, idx int) {
	for i := range vm.Spec.Volumes {
		c := vm.Spec.Volumes[i].PersistentVolumeClaim
		if c == nil {
			continue
		}
		for _, t := range pool.Spec.VolumeClaimTemplates {
			if c.ClaimName == t.Name {
				c.ClaimName = ClaimName(t.Name, pool.Name, idx)
			}
		}
	}
}
