package impvmpool

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// memberName is the name of a pool's member of index idx.
func memberName(pool *impv1.ImpVMPool, idx int) string {
	return pool.Name + "-" + strconv.Itoa(idx)
}

// newMember is the ImpVM of a pool's template at index idx, of revision rev.
func newMember(pool *impv1.ImpVMPool, rev string, idx int) *impv1.ImpVM {
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: pool.Namespace, Name: memberName(pool, idx),
		Labels: map[string]string{}, Annotations: map[string]string{}}, Spec: *pool.Spec.Template.Spec.DeepCopy()}
	for k, v := range pool.Spec.Template.Metadata.Labels {
		vm.Labels[k] = v
	}
	for k, v := range pool.Spec.Template.Metadata.Annotations {
		vm.Annotations[k] = v
	}
	vm.Labels[impv1.PoolLabel], vm.Labels[impv1.PoolRevisionLabel], vm.Labels[impv1.PoolIndexLabel] = pool.Name, rev, strconv.Itoa(idx)
	withClaims(pool, vm, idx)
	vm.OwnerReferences = []metav1.OwnerReference{*metav1.NewControllerRef(pool, impv1.GroupVersion.WithKind("ImpVMPool"))}
	return vm
}

// isQuota: the API server's refusal came from IMP's quota policy (charts/imp quota-policy.yaml,
// whose messages name the ImpQuota).
func isQuota(err error) bool {
	return strings.Contains(err.Error(), "ImpQuota ")
}

// computeStatus recomputes the pool's status from its members (after this reconcile's deletions).
func computeStatus(pool *impv1.ImpVMPool, b bounds, rev string, members []member, vms map[string]*impv1.ImpVM,
	failure *createFailure, now time.Time) {
	st := &pool.Status
	st.Replicas, st.ReadyReplicas, st.AvailableReplicas, st.UpdatedReplicas = 0, 0, 0, 0
	var waiting []string
	old := 0
	for _, m := range members {
		if m.deleting || m.foreign {
			continue
		}
		st.Replicas++
		if m.ready {
			st.ReadyReplicas++
		}
		if ok, _ := m.available(now, b.minReady); ok {
			st.AvailableReplicas++
		}
		if m.rev == rev {
			st.UpdatedReplicas++
		} else {
			old++
		}
		if c := meta.FindStatusCondition(vms[m.name].Status.Conditions, impv1.ScheduledCondition); !m.placed && c != nil &&
			c.Status == metav1.ConditionFalse && c.Reason == impv1.ReasonQuotaExceeded {
			waiting = append(waiting, m.name+": "+c.Message)
		}
	}
	st.UpdateRevision = rev
	if old == 0 || st.CurrentRevision == "" {
		st.CurrentRevision = rev
	}
	gen := pool.Generation
	set := func(typ string, ok bool, reason, msg string) {
		s := metav1.ConditionFalse
		if ok {
			s = metav1.ConditionTrue
		}
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: typ, Status: s, Reason: reason, Message: msg, ObservedGeneration: gen})
	}
	minAvailable := max(b.replicas-b.maxUnavailable, 0)
	if b.onDelete {
		minAvailable = b.replicas
	}
	if int(st.AvailableReplicas) >= minAvailable {
		set(impv1.PoolAvailableCondition, true, impv1.ReasonMinimumAvailable, fmt.Sprintf("%d of %d members available (at least %d wanted)", st.AvailableReplicas, b.replicas, minAvailable))
	} else {
		set(impv1.PoolAvailableCondition, false, impv1.ReasonMinimumUnavailable, fmt.Sprintf("%d of %d members available (at least %d wanted)", st.AvailableReplicas, b.replicas, minAvailable))
	}
	switch {
	case old > 0 && b.onDelete:
		set(impv1.PoolProgressingCondition, true, impv1.ReasonWaitingForDeletion, fmt.Sprintf("%d members of older revisions wait to be deleted (updateStrategy OnDelete); %d of revision %s", old, st.UpdatedReplicas, rev))
	case old > 0:
		set(impv1.PoolProgressingCondition, true, impv1.ReasonRolling, fmt.Sprintf("%d of %d members of revision %s; %d of older revisions", st.UpdatedReplicas, b.replicas, rev, old))
	case int(st.Replicas) != b.replicas || int(st.AvailableReplicas) != b.replicas:
		set(impv1.PoolProgressingCondition, true, impv1.ReasonScaling, fmt.Sprintf("%d members, %d available, of %d", st.Replicas, st.AvailableReplicas, b.replicas))
	default:
		set(impv1.PoolProgressingCondition, true, impv1.ReasonRolloutComplete, fmt.Sprintf("%d members of revision %s, all available", b.replicas, rev))
	}
	switch {
	case failure != nil:
		set(impv1.PoolReplicaFailureCondition, true, failure.reason, failure.message)
	case len(waiting) > 0:
		set(impv1.PoolReplicaFailureCondition, true, impv1.ReasonQuotaExceeded, fmt.Sprintf("%d members wait for quota; %s", len(waiting), waiting[0]))
	default:
		set(impv1.PoolReplicaFailureCondition, false, impv1.ReasonMembersCreated, "every member could be made")
	}
}

// writeStatus patches the pool's status if it changed. This controller alone writes it, one
// reconcile of a pool at a time, and computes all of it afresh, against orig as the API server
// had it: a merge patch carries only what differs from orig, so orig's resourceVersion is its
// precondition (a write meanwhile, the scale subresource's, is a conflict, not a mix).
func (r *Reconciler) writeStatus(ctx context.Context, orig, pool *impv1.ImpVMPool) error {
	if equality.Semantic.DeepEqual(orig.Status, pool.Status) {
		return nil
	}
	if err := r.Client.Status().Patch(ctx, pool, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("writing the status of ImpVMPool %s: %w", pool.Name, err)
	}
	return nil
}
