// Package idle is the operator's side of idle VMs (spec.idle): a VM whose node reports it idle
// for its suspendAfter (status.runtime.idleSince) gets an ImpVMSuspension with reason Idle, and
// one whose node reports that something arrived for it while so suspended
// (status.runtime.wakeRequested), or whose policy was removed, gets it deleted: the VM resumes
// as after any suspension. It never touches a suspension of another reason. The node's side
// (what counts as activity, holding what arrives) is the agent's (internal/agent/idle,
// internal/agent/wake). See docs/suspend.md.
package idle

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvmsuspensions,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Reconciler suspends idle VMs and wakes them, one VM per request.
type Reconciler struct {
	Client   client.Client
	Recorder EventRecorder
	Clock    clock.PassiveClock
}

func (r *Reconciler) clock() clock.PassiveClock {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
}

// Reconcile suspends the VM once its node reported it idle for its suspendAfter, and resumes
// it once its node asks for it to be woken.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	vm := &impv1.ImpVM{}
	if err := r.Client.Get(ctx, req.NamespacedName, vm); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !vm.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil
	}
	st, rt := &vm.Status, vm.Status.Runtime
	if sp := st.Suspension; sp != nil {
		if sp.Reason != impv1.SuspendReasonIdle {
			return ctrl.Result{}, nil // a person's or the pressure lifecycle's: never woken here
		}
		return ctrl.Result{}, r.wake(ctx, vm)
	}
	current := rt != nil && rt.Instance == st.Instance && rt.Run == st.RestartCount
	if rt == nil || rt.IdleSince == nil {
		// Active: an Idle suspension of its own not applied yet (refused, say, by a quota) is
		// not applied later to a VM at work.
		if err := r.dropStale(ctx, vm); err != nil {
			return ctrl.Result{}, err
		}
	}
	if vm.Spec.Idle == nil || !current || rt.State != impv1.RuntimeRunning || rt.IdleSince == nil ||
		st.Phase != impv1.VMRunning || impv1.WarmPoolOf(vm) != "" {
		return ctrl.Result{}, nil // a warm pool's idle member waits paused, as its pool keeps it
	}
	after := vm.Spec.Idle.SuspendAfter.Duration
	if left := rt.IdleSince.Add(after).Sub(r.clock().Now()); left > 0 {
		return ctrl.Result{RequeueAfter: left}, nil // the node's clock is ahead of this one's
	}
	susp := &impv1.ImpVMSuspension{
		ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: vm.Name,
			// Gone with its VM.
			OwnerReferences: []metav1.OwnerReference{{APIVersion: impv1.GroupVersion.String(), Kind: "ImpVM", Name: vm.Name, UID: vm.UID}}},
		Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonIdle,
			Message: fmt.Sprintf("no activity since %s (idle.suspendAfter %v); what arrives for it wakes it", rt.IdleSince.UTC().Format(time.RFC3339), after)},
	}
	switch err := r.Client.Create(ctx, susp); {
	case apierrors.IsAlreadyExists(err):
		return ctrl.Result{}, nil // the VM reconciler has yet to see it
	case err != nil:
		return ctrl.Result{}, fmt.Errorf("suspending idle VM %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Idle", "Suspend", "No activity for %v: suspending the VM until something arrives for it", after)
	return ctrl.Result{}, nil
}

// dropStale deletes an Idle suspension of vm that its status does not show (not applied): the
// VM is active again.
func (r *Reconciler) dropStale(ctx context.Context, vm *impv1.ImpVM) error {
	susp := &impv1.ImpVMSuspension{}
	if err := r.Client.Get(ctx, client.ObjectKeyFromObject(vm), susp); err != nil {
		return client.IgnoreNotFound(err)
	}
	if susp.Spec.Reason != impv1.SuspendReasonIdle || !susp.DeletionTimestamp.IsZero() {
		return nil
	}
	uid := susp.UID
	return client.IgnoreNotFound(r.Client.Delete(ctx, susp, client.Preconditions{UID: &uid}))
}

// wake deletes the VM's Idle suspension once its node asked for it to be woken (something
// arrived for it after the suspension was made), or once the VM has no idle policy any more.
func (r *Reconciler) wake(ctx context.Context, vm *impv1.ImpVM) error {
	susp := &impv1.ImpVMSuspension{}
	if err := r.Client.Get(ctx, client.ObjectKeyFromObject(vm), susp); err != nil {
		return client.IgnoreNotFound(err)
	}
	if susp.Spec.Reason != impv1.SuspendReasonIdle || !susp.DeletionTimestamp.IsZero() {
		return nil
	}
	why := ""
	switch rt := vm.Status.Runtime; {
	case vm.Spec.Idle == nil:
		why = "its idle policy was removed"
	case rt != nil && rt.WakeRequested != nil:
		// Any wake request the run reports: the node clears it whenever the run runs again, so
		// one is never left from an earlier suspension (and the node's clock is not compared
		// with the API server's).
		why = "something arrived for it on node " + vm.Status.NodeName
	default:
		return nil
	}
	uid := susp.UID
	if err := r.Client.Delete(ctx, susp, client.Preconditions{UID: &uid}); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("waking VM %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Waking", "Resume", "Waking the idle VM: %s", why)
	return nil
}

// Waker wakes an idle-suspended VM for a session through the API: an exec, console,
// port-forward or followed log (the subresource server, internal/subresources).
type Waker struct {
	Client   client.Client
	Recorder EventRecorder
}

// Wake deletes vm's suspension if its reason is Idle, and says whether it was.
func (w Waker) Wake(ctx context.Context, vm *impv1.ImpVM, user string) (bool, error) {
	susp := &impv1.ImpVMSuspension{}
	if err := w.Client.Get(ctx, client.ObjectKeyFromObject(vm), susp); err != nil {
		return false, client.IgnoreNotFound(err)
	}
	if susp.Spec.Reason != impv1.SuspendReasonIdle {
		return false, nil
	}
	if !susp.DeletionTimestamp.IsZero() {
		return true, nil
	}
	uid := susp.UID
	if err := w.Client.Delete(ctx, susp, client.Preconditions{UID: &uid}); client.IgnoreNotFound(err) != nil {
		return false, fmt.Errorf("waking VM %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	if w.Recorder != nil {
		w.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Waking", "Resume", "Waking the idle VM: a session through the API (%s)", user)
	}
	return true, nil
}

// SetupWithManager registers the reconciler: requests are VMs with an idle policy or an Idle
// suspension (no other VM wakes it), and the VMs of Idle suspensions.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	concerned := predicate.NewPredicateFuncs(func(o client.Object) bool {
		vm := o.(*impv1.ImpVM)
		return vm.Spec.Idle != nil || (vm.Status.Suspension != nil && vm.Status.Suspension.Reason == impv1.SuspendReasonIdle)
	})
	return ctrl.NewControllerManagedBy(mgr).
		Named("idle").
		For(&impv1.ImpVM{}, builder.WithPredicates(concerned)).
		Watches(&impv1.ImpVMSuspension{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			if o.(*impv1.ImpVMSuspension).Spec.Reason != impv1.SuspendReasonIdle {
				return nil
			}
			return []reconcile.Request{{NamespacedName: client.ObjectKeyFromObject(o)}}
		})).
		Complete(r)
}
