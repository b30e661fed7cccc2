// Package impvmpool is the operator's ImpVMPool controller: it keeps a pool's replicas members
// (ImpVMs named <pool>-<index>, owned by the pool), replaces those that finished, scales in in
// a stated order, and rolls a template change through the members within maxSurge and
// maxUnavailable, keeping each template as a ControllerRevision for `kubectl imp rollout undo`.
package impvmpool

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvmpools,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmpools/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmpools/finalizers,verbs=update
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups=apps,resources=controllerrevisions,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=imp.dev,resources=impquotas,verbs=get;list;watch

// CreateRetry is how long a pool whose member was refused waits before it tries again (unless
// a change to the pool, its members or the namespace's quotas wakes it first).
const CreateRetry = 30 * time.Second

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Reconciler is the operator's ImpVMPool controller.
type Reconciler struct {
	Client client.Client
	// APIReader lists a pool's members from the API server, not the cache: a count that lags
	// the pool's own last deletions would delete again.
	APIReader client.Reader
	Recorder  EventRecorder
	// Clock times minReadySeconds and the pace of creates (the real clock when nil).
	Clock clock.PassiveClock
	// CreatesPerSecond and CreateBurst bound the members the pools of one namespace make
	// (DefaultCreatesPerSecond and DefaultCreateBurst when 0).
	CreatesPerSecond float64
	CreateBurst      int

	pace pacer
}

func (r *Reconciler) clock() clock.PassiveClock {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
}

// Reconcile brings one pool's members toward its spec.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	// From the API server: the pool's status as it is is the base of the status patch, which
	// carries only the fields that differ from it. The cache can lag this controller's own last
	// writes, and a patch against an older status left fields of two computations side by side
	// (available above replicas), which no later event of the pool corrected.
	pool := &impv1.ImpVMPool{}
	if err := r.APIReader.Get(ctx, req.NamespacedName, pool); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !pool.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil // its members and revisions are its dependents: collected
	}
	orig := pool.DeepCopy()
	pool.Status.ObservedGeneration = pool.Generation

	sel, err := selectorOf(pool)
	if err != nil {
		msg := fmt.Sprintf("the selector %s: %v; no member is made", metav1.FormatLabelSelector(pool.Spec.Selector), err)
		meta.SetStatusCondition(&pool.Status.Conditions, metav1.Condition{Type: impv1.PoolReplicaFailureCondition,
			Status: metav1.ConditionTrue, Reason: impv1.ReasonSelectorMismatch, Message: msg, ObservedGeneration: pool.Generation})
		r.Recorder.Eventf(pool, nil, "Warning", impv1.ReasonSelectorMismatch, "Validate", msg)
		return ctrl.Result{}, r.writeStatus(ctx, orig, pool)
	}
	pool.Status.Selector = sel.String()

	rev, revs, err := r.ensureRevision(ctx, pool)
	if err != nil {
		return ctrl.Result{}, err
	}
	members, vms, err := r.members(ctx, pool, sel)
	if err != nil {
		return ctrl.Result{}, err
	}
	now := r.clock().Now() // after the list: a member Ready by then is available at minReadySeconds 0
	b := boundsOf(pool)
	p := planFor(b, rev, members, now)

	for _, name := range p.delete {
		vm := vms[name]
		if err := r.Client.Delete(ctx, vm, client.Preconditions{UID: &vm.UID}); client.IgnoreNotFound(err) != nil {
			return ctrl.Result{}, fmt.Errorf("deleting member %s of ImpVMPool %s: %w", name, pool.Name, err)
		}
		markDeleting(members, name)
	}
	create, failure, err := r.withinQuota(ctx, pool.Namespace, p.create)
	if err != nil {
		return ctrl.Result{}, err
	}
	if failure != nil {
		r.Recorder.Eventf(pool, nil, "Warning", failure.reason, "Create", failure.message)
	}
	n, paced := r.pace.take(pool.Namespace, len(create), now, cmp.Or(r.CreatesPerSecond, DefaultCreatesPerSecond), cmp.Or(r.CreateBurst, DefaultCreateBurst))
	if f := r.create(ctx, pool, sel, rev, create[:n]); f != nil {
		failure = f
	}

	// Status, from the members as they now are.
	if err := r.pruneRevisions(ctx, pool, rev, revs, members); err != nil {
		return ctrl.Result{}, err
	}
	computeStatus(pool, b, rev, members, vms, failure, now)
	if err := r.writeStatus(ctx, orig, pool); apierrors.IsConflict(err) {
		return ctrl.Result{Requeue: true}, nil // written meanwhile (a scale): computed again
	} else if err != nil {
		return ctrl.Result{}, err
	}
	requeue := p.requeue
	sooner := func(after time.Duration) {
		if after > 0 && (requeue == 0 || after < requeue) {
			requeue = after
		}
	}
	sooner(paced) // the namespace's next create
	if failure != nil {
		sooner(CreateRetry)
	}
	return ctrl.Result{RequeueAfter: requeue}, nil
}

// selectorOf is the pool's selector, which must select each member's labels: the template's
// with those the pool sets (imp.dev/pool, -revision, -index). A selector on those keys is
// refused: it would select some members and not others, and a pool whose members fall out of
// its selector would make more for ever.
func selectorOf(pool *impv1.ImpVMPool) (labels.Selector, error) {
	sel, err := metav1.LabelSelectorAsSelector(pool.Spec.Selector)
	if err != nil {
		return nil, err
	}
	reqs, _ := sel.Requirements()
	for _, r := range reqs {
		if strings.HasPrefix(r.Key(), impv1.PoolLabel) {
			return nil, fmt.Errorf("it selects on %s, a label the pool sets on its members itself", r.Key())
		}
	}
	if !sel.Matches(labels.Set(newMember(pool, "", 0).Labels)) {
		return nil, errors.New("it does not select template.metadata.labels")
	}
	return sel, nil
}

func markDeleting(members []member, name string) {
	for i := range members {
		if members[i].name == name {
			members[i].deleting = true
		}
	}
}

// members lists the pool's VMs: those it controls that carry its label and match its selector,
// from the API server. Any other VM holding a member's name (<pool>-<index>) — another's VM, or
// a member whose labels were changed out of the selector — is foreign: never counted, deleted
// or adopted, only skipped when an index is chosen.
func (r *Reconciler) members(ctx context.Context, pool *impv1.ImpVMPool, sel labels.Selector) ([]member, map[string]*impv1.ImpVM, error) {
	var list impv1.ImpVMList
	if err := r.APIReader.List(ctx, &list, client.InNamespace(pool.Namespace), client.MatchingLabels{impv1.PoolLabel: pool.Name}); err != nil {
		return nil, nil, fmt.Errorf("listing the members of ImpVMPool %s: %w", pool.Name, err)
	}
	var all impv1.ImpVMList
	if err := r.Client.List(ctx, &all, client.InNamespace(pool.Namespace), client.UnsafeDisableDeepCopy); err != nil {
		return nil, nil, fmt.Errorf("listing the VMs of namespace %s: %w", pool.Namespace, err)
	}
	var out []member
	vms := map[string]*impv1.ImpVM{}
	seen := map[string]bool{}
	for i := range list.Items {
		vm := &list.Items[i]
		seen[vm.Name] = true
		idx, err := strconv.Atoi(vm.Labels[impv1.PoolIndexLabel])
		if !metav1.IsControlledBy(vm, pool) || !sel.Matches(labels.Set(vm.Labels)) || err != nil || vm.Name != memberName(pool, idx) {
			if idx, ok := indexOf(pool, vm.Name); ok {
				out = append(out, member{name: vm.Name, index: idx, foreign: true})
			}
			continue
		}
		m := member{name: vm.Name, index: idx, rev: vm.Labels[impv1.PoolRevisionLabel], created: vm.CreationTimestamp.Time,
			deleting: !vm.DeletionTimestamp.IsZero(), placed: vm.Status.NodeName != "",
			finished: vm.Status.Phase == impv1.VMFailed || vm.Status.Phase == impv1.VMSucceeded}
		if c := meta.FindStatusCondition(vm.Status.Conditions, impv1.ReadyCondition); c != nil && c.Status == metav1.ConditionTrue {
			m.ready, m.readySince = true, c.LastTransitionTime.Time
		}
		out = append(out, m)
		vms[vm.Name] = vm
	}
	for _, vm := range all.Items {
		if idx, ok := indexOf(pool, vm.Name); ok && !seen[vm.Name] {
			out = append(out, member{name: vm.Name, index: idx, foreign: true})
		}
	}
	return out, vms, nil
}

// indexOf is the index of a member's name: <pool>-<digits>, without leading zeros.
func indexOf(pool *impv1.ImpVMPool, name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, pool.Name+"-")
	if !ok {
		return 0, false
	}
	idx, err := strconv.Atoi(rest)
	if err != nil || idx < 0 || strconv.Itoa(idx) != rest {
		return 0, false
	}
	return idx, true
}

// createFailure is why a member could not be made.
type createFailure struct {
	reason, message string
}

// create makes members of rev at indices, in batches that double (1, 2, 4, ...) as a
// ReplicaSet's do, so that a refusal (a quota) costs one request rather than one per member.
// A name already taken by a VM the pool does not control is reported, not retried with
// another index (the member's name is its identity).
func (r *Reconciler) create(ctx context.Context, pool *impv1.ImpVMPool, sel labels.Selector, rev string, indices []int) *createFailure {
	for batch := 1; len(indices) > 0; batch *= 2 {
		n := min(batch, len(indices))
		todo := indices[:n]
		indices = indices[n:]
		errs := make([]error, n)
		made := make([]*impv1.ImpVM, n)
		var wg sync.WaitGroup
		for i, idx := range todo {
			made[i] = newMember(pool, rev, idx)
			wg.Go(func() {
				if errs[i] = r.ensureClaims(ctx, pool, idx); errs[i] == nil {
					errs[i] = r.Client.Create(ctx, made[i])
				}
			})
		}
		wg.Wait()
		for i, err := range errs {
			name := memberName(pool, todo[i])
			f := &createFailure{reason: impv1.ReasonCreateFailed, message: fmt.Sprintf("creating member %s: %v", name, err)}
			switch {
			case err == nil && sel.Matches(labels.Set(made[i].Labels)):
				continue
			case err == nil:
				// Admission (a mutating webhook or policy) moved it out of the selector: it
				// would never count, and the pool would make more for ever. Undone, and stop.
				vm := made[i]
				if err := r.Client.Delete(ctx, vm, client.Preconditions{UID: &vm.UID}); client.IgnoreNotFound(err) != nil {
					ctrl.LoggerFrom(ctx).Error(err, "deleting a member admission relabelled", "vm", name)
				}
				f.message = "admission changed the labels of member " + name + " so that the selector no longer selects it (a mutating webhook or policy?): the pool makes no more members until that stops"
			case apierrors.IsAlreadyExists(err):
				vm := &impv1.ImpVM{}
				err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: pool.Namespace, Name: name}, vm)
				if apierrors.IsNotFound(err) || (err == nil && metav1.IsControlledBy(vm, pool)) {
					continue // made by an earlier reconcile whose list this one's lagged, or gone since
				}
				f.message = "the name " + name + " is taken by an ImpVM the pool does not control: rename or delete it"
			case apierrors.IsForbidden(err) && isQuota(err):
				f.reason = impv1.ReasonQuotaExceeded
			}
			r.Recorder.Eventf(pool, nil, "Warning", f.reason, "Create", f.message)
			return f
		}
	}
	return nil
}

// SetupWithManager registers the controller: a pool is reconciled when its spec changes, when
// one of its members changes (placed, Ready, finished, gone), and when an ImpQuota of its
// namespace changes its limits (a member refused for quota may now be made).
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager, concurrency int) error {
	return ctrl.NewControllerManagedBy(mgr).
		// Not its own status writes: a spec change (the scale subresource's included).
		For(&impv1.ImpVMPool{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Named("impvmpool").
		Owns(&impv1.ImpVM{}, builder.WithPredicates(memberChanged)).
		// A quota's limits changed, not its usage (which every VM of the namespace moves).
		Watches(&impv1.ImpQuota{}, handler.EnqueueRequestsFromMapFunc(r.poolsOfNamespace),
			builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		WithOptions(controller.Options{MaxConcurrentReconciles: max(concurrency, 1)}).
		Complete(r)
}

// memberChanged passes a member's events that can change what its pool does or reports:
// made, gone, being deleted, relabelled, placed, its phase, and its Ready and Scheduled
// conditions; not the rest of its status (addresses, runtime reports, heartbeats).
var memberChanged = predicate.Funcs{UpdateFunc: func(e event.UpdateEvent) bool {
	a, okA := e.ObjectOld.(*impv1.ImpVM)
	b, okB := e.ObjectNew.(*impv1.ImpVM)
	if !okA || !okB {
		return true
	}
	cond := func(vm *impv1.ImpVM, t string) metav1.Condition {
		if c := meta.FindStatusCondition(vm.Status.Conditions, t); c != nil {
			return metav1.Condition{Status: c.Status, Reason: c.Reason, Message: c.Message, LastTransitionTime: c.LastTransitionTime}
		}
		return metav1.Condition{}
	}
	return !a.DeletionTimestamp.Equal(b.DeletionTimestamp) || !maps.Equal(a.Labels, b.Labels) ||
		a.Status.NodeName != b.Status.NodeName || a.Status.Phase != b.Status.Phase ||
		cond(a, impv1.ReadyCondition) != cond(b, impv1.ReadyCondition) || cond(a, impv1.ScheduledCondition) != cond(b, impv1.ScheduledCondition)
}}

func (r *Reconciler) poolsOfNamespace(ctx context.Context, o client.Object) []reconcile.Request {
	var list impv1.ImpVMPoolList
	if err := r.Client.List(ctx, &list, client.InNamespace(o.GetNamespace())); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "listing the pools of a namespace", "namespace", o.GetNamespace())
		return nil
	}
	out := make([]reconcile.Request, 0, len(list.Items))
	for i := range list.Items {
		out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
	}
	return out
}
