package impvmsnapshot

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/robfig/cron/v3"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// defaultRetention is how many snapshots a recurring one keeps when it does not say.
const defaultRetention = 3

// scheduledAtAnnotation is the time (Unix seconds) a recurring snapshot made a snapshot for.
const scheduledAtAnnotation = "imp.dev/scheduled-at"

// maxMissed bounds how far a schedule is followed to find the latest time missed.
const maxMissed = 100000

// schedule runs a recurring snapshot: at each time of its schedule a snapshot of the VM (one
// for the latest time missed, however many were), then its retention.
func (r *Reconciler) schedule(ctx context.Context, snap *impv1.ImpVMSnapshot) (ctrl.Result, error) {
	sched, err := cron.ParseStandard(snap.Spec.Schedule)
	if err != nil {
		return ctrl.Result{}, r.setStatus(ctx, snap, func(st *impv1.ImpVMSnapshotStatus) {
			st.Phase, st.Reason, st.Message = impv1.SnapshotFailed, impv1.ReasonInvalidSchedule, fmt.Sprintf("schedule %q: %v", snap.Spec.Schedule, err)
		})
	}
	now := r.clock().Now().UTC()
	last := snap.CreationTimestamp.UTC()
	if t := snap.Status.LastScheduleTime; t != nil {
		last = t.UTC()
	}
	// The latest time at or before now that has not had its snapshot.
	var due time.Time
	for t, i := sched.Next(last), 0; !t.After(now) && i < maxMissed; t, i = sched.Next(t), i+1 {
		due = t
	}
	if !due.IsZero() {
		if err := r.makeScheduled(ctx, snap, due); err != nil {
			return ctrl.Result{}, err
		}
		last = due
	}
	if err := r.retain(ctx, snap); err != nil {
		return ctrl.Result{}, err
	}
	next := sched.Next(last)
	if err := r.setStatus(ctx, snap, func(st *impv1.ImpVMSnapshotStatus) {
		st.Phase, st.Reason, st.Message = impv1.SnapshotScheduled, "", fmt.Sprintf("a snapshot of %s at %s", snap.Spec.VMName, snap.Spec.Schedule)
		if !due.IsZero() {
			st.LastScheduleTime = &metav1.Time{Time: due}
		}
		st.NextScheduleTime = &metav1.Time{Time: next}
	}); err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{RequeueAfter: next.Sub(now)}, nil
}

// makeScheduled creates the snapshot of a recurring one for time at: named for it, so that an
// operator that restarts in between makes it once.
func (r *Reconciler) makeScheduled(ctx context.Context, snap *impv1.ImpVMSnapshot, at time.Time) error {
	child := &impv1.ImpVMSnapshot{
		ObjectMeta: metav1.ObjectMeta{
			Namespace:   snap.Namespace,
			Name:        scheduledName(snap.Name, at),
			Labels:      map[string]string{impv1.ScheduleLabel: snap.Name},
			Annotations: map[string]string{scheduledAtAnnotation: strconv.FormatInt(at.Unix(), 10)},
		},
		Spec: impv1.ImpVMSnapshotSpec{VMName: snap.Spec.VMName, Registry: snap.Spec.Registry},
	}
	if err := controllerutil.SetControllerReference(snap, child, r.Client.Scheme()); err != nil {
		return err
	}
	if err := r.Client.Create(ctx, child); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating the snapshot of %s for %s: %w", snap.Name, at, err)
	}
	return nil
}

// scheduledName is the name of a recurring snapshot's snapshot for time at (within 253
// characters: a name of 242 and 11 digits of Unix time).
func scheduledName(name string, at time.Time) string {
	if len(name) > 241 {
		name = name[:241]
	}
	return fmt.Sprintf("%s-%d", name, at.Unix())
}

// retain deletes what a recurring snapshot keeps no more: beyond the newest retention Ready
// snapshots, every older one, and every failure but the newest snapshot. Those still being taken
// stay.
func (r *Reconciler) retain(ctx context.Context, snap *impv1.ImpVMSnapshot) error {
	children, err := r.scheduled(ctx, snap)
	if err != nil {
		return err
	}
	keep := int32(defaultRetention)
	if snap.Spec.Retention != nil {
		keep = *snap.Spec.Retention
	}
	// Newest first.
	slices.SortFunc(children, func(a, b impv1.ImpVMSnapshot) int { return scheduledAt(&b).Compare(scheduledAt(&a)) })
	ready := int32(0)
	for i := range children {
		c := &children[i]
		if !c.DeletionTimestamp.IsZero() {
			continue
		}
		drop := false
		switch c.Status.Phase {
		case impv1.SnapshotReady:
			ready++
			drop = ready > keep
		case impv1.SnapshotFailed:
			drop = i > 0 || ready >= keep
		default: // being taken
			drop = ready >= keep
		}
		if drop {
			if err := r.Client.Delete(ctx, c); client.IgnoreNotFound(err) != nil {
				return fmt.Errorf("deleting %s, past the retention of %s: %w", c.Name, snap.Name, err)
			}
		}
	}
	return nil
}

// scheduled lists the snapshots the recurring snapshot made.
func (r *Reconciler) scheduled(ctx context.Context, snap *impv1.ImpVMSnapshot) ([]impv1.ImpVMSnapshot, error) {
	var list impv1.ImpVMSnapshotList
	if err := r.Client.List(ctx, &list, client.InNamespace(snap.Namespace), client.MatchingLabels{impv1.ScheduleLabel: snap.Name}); err != nil {
		return nil, fmt.Errorf("listing the snapshots of %s: %w", snap.Name, err)
	}
	return slices.DeleteFunc(list.Items, func(c impv1.ImpVMSnapshot) bool { return !metav1.IsControlledBy(&c, snap) }), nil
}

// scheduledAt is the time a recurring snapshot made c for.
func scheduledAt(c *impv1.ImpVMSnapshot) time.Time {
	if s, err := strconv.ParseInt(c.Annotations[scheduledAtAnnotation], 10, 64); err == nil {
		return time.Unix(s, 0)
	}
	return c.CreationTimestamp.Time
}

// setStatus changes the snapshot's status with change, and its Ready condition with it (True
// only for a recurring snapshot, the agent reports a taken one), when that changes anything;
// with the optimistic lock, never over an agent's report of the same snapshot.
func (r *Reconciler) setStatus(ctx context.Context, snap *impv1.ImpVMSnapshot, change func(*impv1.ImpVMSnapshotStatus)) error {
	orig := snap.DeepCopy()
	change(&snap.Status)
	status := metav1.ConditionFalse
	if snap.Status.Phase == impv1.SnapshotScheduled {
		status = metav1.ConditionTrue
	}
	reason := snap.Status.Reason
	if reason == "" {
		reason = string(snap.Status.Phase)
	}
	apimeta.SetStatusCondition(&snap.Status.Conditions, metav1.Condition{Type: impv1.SnapshotReadyCondition, Status: status,
		Reason: reason, Message: snap.Status.Message, ObservedGeneration: snap.Generation})
	if equality.Semantic.DeepEqual(orig.Status, snap.Status) {
		return nil
	}
	if err := r.Client.Status().Patch(ctx, snap, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("reporting ImpVMSnapshot %s: %w", snap.Name, err)
	}
	return nil
}

// dropScheduled deletes the snapshots of a recurring snapshot being deleted (the garbage
// collector would too, by their owner references; this does not wait for it).
func (r *Reconciler) dropScheduled(ctx context.Context, snap *impv1.ImpVMSnapshot) error {
	children, err := r.scheduled(ctx, snap)
	if err != nil {
		return err
	}
	for i := range children {
		if err := r.Client.Delete(ctx, &children[i]); client.IgnoreNotFound(err) != nil {
			return fmt.Errorf("deleting %s with %s: %w", children[i].Name, snap.Name, err)
		}
	}
	return nil
}
