// Package pressure is the operator's pressure lifecycle (opt-in, chart value
// pressureLifecycle.enabled): while a node reports MemoryPressure it suspends the node's
// resident ImpVMs one at a time, largest memory first, waiting for each to release its memory
// and for the node's condition to be read again before the next; it stops as soon as the
// pressure clears, and it never resumes a VM — a person does (kubectl imp resume).
package pressure

import (
	"context"
	"fmt"
	"sort"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/impvm"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvmsuspensions,verbs=get;list;watch;create
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Reconciler is the pressure lifecycle, one node per request.
type Reconciler struct {
	Client   client.Client
	Recorder EventRecorder
	Clock    clock.PassiveClock
	// Settle is how long after a VM's memory was released the node's condition must have
	// had to reflect it before another VM is suspended (the kubelet re-evaluates pressure
	// every ten seconds).
	Settle time.Duration
	// Timeout is how long a suspension may take before the next VM is considered anyway.
	Timeout time.Duration
}

// Reconcile suspends the node's next VM while it reports MemoryPressure.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var node corev1.Node
	if err := r.Client.Get(ctx, req.NamespacedName, &node); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !underPressure(&node) {
		return ctrl.Result{}, nil // never resume: people do
	}
	var vms impv1.ImpVMList
	if err := r.Client.List(ctx, &vms, client.MatchingFields{impvm.NodeIndex: node.Name}); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing the node's VMs: %w", err)
	}
	now := r.Clock.Now()
	var candidates []*impv1.ImpVM
	for i := range vms.Items {
		vm := &vms.Items[i]
		sp := vm.Status.Suspension
		switch {
		case sp != nil && sp.Reason == impv1.SuspendReasonPressure && sp.Since == nil:
			// A suspension in flight: wait for its memory, up to the timeout.
			var susp impv1.ImpVMSuspension
			if err := r.Client.Get(ctx, client.ObjectKeyFromObject(vm), &susp); err == nil && now.Sub(susp.CreationTimestamp.Time) < r.Timeout {
				return ctrl.Result{RequeueAfter: time.Second}, nil
			}
		case sp != nil && sp.Since != nil && sp.Reason == impv1.SuspendReasonPressure:
			if left := sp.Since.Add(r.Settle).Sub(now); left > 0 {
				return ctrl.Result{RequeueAfter: left}, nil // let the condition catch up
			}
		case sp == nil && vm.Status.Phase == impv1.VMRunning && vm.DeletionTimestamp.IsZero() && vm.Status.Resources != nil:
			candidates = append(candidates, vm)
		}
	}
	if len(candidates) == 0 {
		return ctrl.Result{}, nil
	}
	// Largest memory first; ties by namespace and name, so the choice is the same every time.
	sort.Slice(candidates, func(i, j int) bool {
		a, b := candidates[i], candidates[j]
		if c := a.Status.Resources.Memory.Cmp(b.Status.Resources.Memory); c != 0 {
			return c > 0
		}
		return a.Namespace+"/"+a.Name < b.Namespace+"/"+b.Name
	})
	vm := candidates[0]
	var existing impv1.ImpVMSuspension
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}, &existing); err == nil {
		return ctrl.Result{RequeueAfter: time.Second}, nil // the VM reconciler has yet to see it
	} else if !apierrors.IsNotFound(err) {
		return ctrl.Result{}, err
	}
	mem := vm.Status.Resources.Memory.String()
	susp := &impv1.ImpVMSuspension{
		ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: vm.Name,
			// Gone with its VM.
			OwnerReferences: []metav1.OwnerReference{{APIVersion: impv1.GroupVersion.String(), Kind: "ImpVM", Name: vm.Name, UID: vm.UID}}},
		Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonPressure,
			Message: fmt.Sprintf("node %s reports MemoryPressure; the largest resident VM (%s)", node.Name, mem)},
	}
	if err := r.Client.Create(ctx, susp); err != nil && !apierrors.IsAlreadyExists(err) {
		return ctrl.Result{}, fmt.Errorf("suspending %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	r.Recorder.Eventf(&node, vm, corev1.EventTypeWarning, "PressureDetected", "Suspend",
		"MemoryPressure: suspending ImpVM %s/%s (%s), the largest resident VM", vm.Namespace, vm.Name, mem)
	ctrl.LoggerFrom(ctx).Info("suspending under memory pressure", "vm", vm.Namespace+"/"+vm.Name, "memory", mem)
	return ctrl.Result{RequeueAfter: time.Second}, nil
}

func underPressure(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeMemoryPressure {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// SetupWithManager registers the reconciler: requests are nodes, from Node changes and from
// changes of the VMs placed on them.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		Named("pressure").
		For(&corev1.Node{}).
		Watches(&impv1.ImpVM{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			if n := o.(*impv1.ImpVM).Status.NodeName; n != "" {
				return []reconcile.Request{{NamespacedName: types.NamespacedName{Name: n}}}
			}
			return nil
		})).
		Complete(r)
}
