// Package evacuation moves the VMs off a node being evacuated (docs/migration.md): a Node with
// the taint imp.dev/evacuate:NoExecute (kubectl imp drain sets it) has its running VMs whose
// spec.evictionStrategy is Migrate moved by ImpVMMigrations, at most MaxConcurrent of the node's
// at a time; VMs with None stay where they are, running. A VM whose migration failed is tried
// again after Backoff, at most Attempts times. Its progress is in Events on the Node; the
// migrations it makes carry the label imp.dev/evacuation=<node>. The taint itself keeps new VMs
// off the node (placement tolerates no NoExecute taint a VM does not).
package evacuation

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/impvm"
)

// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmmigrations,verbs=get;list;watch;create

// Defaults of a Reconciler.
const (
	DefaultMaxConcurrent = 2
	DefaultBackoff       = 30 * time.Second
	DefaultAttempts      = 3
)

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Reconciler evacuates nodes, one Node per request.
type Reconciler struct {
	Client   client.Client
	Recorder EventRecorder
	Clock    clock.PassiveClock
	// MaxConcurrent is how many of a node's VMs move at once; Backoff how long after a failed
	// migration a VM is tried again; Attempts how many migrations of a VM an evacuation makes.
	MaxConcurrent int
	Backoff       time.Duration
	Attempts      int
}

// Evacuating says whether node is being evacuated.
func Evacuating(node *corev1.Node) bool {
	for _, t := range node.Spec.Taints {
		if t.Key == impv1.EvacuateTaint && t.Effect == corev1.TaintEffectNoExecute {
			return true
		}
	}
	return false
}

// SetupWithManager registers the reconciler: Nodes, the VMs on them, and the migrations it made.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.MaxConcurrent <= 0 {
		r.MaxConcurrent = DefaultMaxConcurrent
	}
	if r.Backoff <= 0 {
		r.Backoff = DefaultBackoff
	}
	if r.Attempts <= 0 {
		r.Attempts = DefaultAttempts
	}
	if r.Clock == nil {
		r.Clock = clock.RealClock{}
	}
	toNode := func(node string) []reconcile.Request {
		if node == "" {
			return nil
		}
		return []reconcile.Request{{NamespacedName: types.NamespacedName{Name: node}}}
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&corev1.Node{}, builder.WithPredicates(predicate.NewPredicateFuncs(func(o client.Object) bool {
			n, ok := o.(*corev1.Node)
			return ok && Evacuating(n)
		}))).
		Watches(&impv1.ImpVM{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			vm, ok := o.(*impv1.ImpVM)
			if !ok || vm.Spec.EvictionStrategy != impv1.EvictionMigrate {
				return nil
			}
			return toNode(vm.Status.NodeName)
		})).
		Watches(&impv1.ImpVMMigration{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			return toNode(o.GetLabels()[impv1.EvacuationLabel])
		})).
		Named("evacuation").
		Complete(r)
}

// Reconcile moves the node's next VMs off it, while it is being evacuated.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	node := &corev1.Node{}
	if err := r.Client.Get(ctx, req.NamespacedName, node); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !Evacuating(node) {
		return ctrl.Result{}, nil
	}
	var vms impv1.ImpVMList
	if err := r.Client.List(ctx, &vms, client.MatchingFields{impvm.NodeIndex: node.Name}); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing the VMs of node %s: %w", node.Name, err)
	}
	var migs impv1.ImpVMMigrationList
	if err := r.Client.List(ctx, &migs, client.MatchingLabels{impv1.EvacuationLabel: node.Name}); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing the migrations of node %s's evacuation: %w", node.Name, err)
	}
	type history struct {
		failed int
		last   time.Time // the last failure's end
	}
	past := map[types.NamespacedName]*history{}
	inFlight := 0
	for i := range migs.Items {
		m := &migs.Items[i]
		if !m.Status.Phase.Finished() {
			inFlight++
			continue
		}
		if m.Status.Phase != impv1.MigrationFailed {
			continue
		}
		key := types.NamespacedName{Namespace: m.Namespace, Name: m.Spec.VMName}
		h := past[key]
		if h == nil {
			h = &history{}
			past[key] = h
		}
		h.failed++
		if t := m.Status.CompletedAt; t != nil && t.After(h.last) {
			h.last = t.Time
		}
	}
	now := r.Clock.Now()
	var again time.Duration
	left := 0
	for i := range vms.Items {
		vm := &vms.Items[i]
		if vm.Spec.EvictionStrategy != impv1.EvictionMigrate || !vm.DeletionTimestamp.IsZero() ||
			vm.Status.Phase == impv1.VMSucceeded || vm.Status.Phase == impv1.VMFailed {
			continue // it stays (None), or has nothing left to move
		}
		left++
		if vm.Status.Migration != nil {
			continue // moving
		}
		h := past[client.ObjectKeyFromObject(vm)]
		if h != nil && h.failed >= r.Attempts {
			continue // given up: it stays, said once below
		}
		if h != nil {
			if wait := h.last.Add(r.Backoff).Sub(now); wait > 0 {
				again = shortest(again, wait)
				continue
			}
		}
		if rt := vm.Status.Runtime; vm.Status.Phase != impv1.VMRunning || rt == nil || !rt.GuestReady || vm.Status.Suspension != nil {
			continue // not running now: moved once it runs (its update brings the next pass)
		}
		if inFlight >= r.MaxConcurrent {
			continue // a later pass, as one ends
		}
		mig := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, GenerateName: vm.Name + "-evacuate-",
			Labels: map[string]string{impv1.EvacuationLabel: node.Name}}, Spec: impv1.ImpVMMigrationSpec{VMName: vm.Name}}
		if err := r.Client.Create(ctx, mig); err != nil {
			return ctrl.Result{}, fmt.Errorf("migrating VM %s/%s off node %s: %w", vm.Namespace, vm.Name, node.Name, err)
		}
		inFlight++
		r.Recorder.Eventf(node, vm, corev1.EventTypeNormal, "Evacuating", "Migrate", "Moving VM %s/%s off the node (ImpVMMigration %s)", vm.Namespace, vm.Name, mig.Name)
	}
	for key, h := range past {
		if h.failed == r.Attempts && now.Sub(h.last) < r.Backoff {
			r.Recorder.Eventf(node, nil, corev1.EventTypeWarning, "EvacuationGaveUp", "Migrate",
				"VM %s failed to migrate %d times: it stays on the node (its migrations say why)", key, h.failed)
		}
	}
	if left > 0 {
		return ctrl.Result{RequeueAfter: shortest(again, time.Minute)}, nil
	}
	return ctrl.Result{}, nil
}

func shortest(a, b time.Duration) time.Duration {
	if a <= 0 || b < a {
		return b
	}
	return a
}
