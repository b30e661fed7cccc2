// Package impwarmpool is the operator's ImpWarmPool controller: it keeps a pool's replicas
// members (copies of the pool's template, ImpVMs owned by the pool, named <pool>-<random>)
// running, replaces those of an older template revision per the update strategy, deletes the
// members handed to claims once their claims' nodes took them over, and reports how many are
// idle. Handing a member to a claim is not done here: the ImpVM controller binds a claim to an
// idle member through the warm pool ledger (internal/warmpool), which this controller consults
// before it deletes a member, so that a member is never deleted under a claim nor handed out
// while it is deleted.
package impwarmpool

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/warmpool"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impwarmpools,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impwarmpools/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impwarmpools/finalizers,verbs=update
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups=imp.dev,resources=impvmtemplates,verbs=get;list;watch

// CreateRetry is how long a pool whose member was refused waits before it tries again (unless
// a change to the pool, its members, its template or the namespace's quotas wakes it first).
const CreateRetry = 30 * time.Second

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Members is what the controller needs of the warm pool ledger.
type Members interface {
	// Retire takes an idle member out of those handed out, for good; false when a claim holds
	// it.
	Retire(member types.UID) bool
	// Claim is the claim bound to member, if any.
	Claim(member types.UID) (warmpool.Claim, bool)
	// Idle is the number of the pool's members that can be handed out now.
	Idle(pool types.NamespacedName) int
}

var _ Members = (*warmpool.Ledger)(nil)

// Reconciler is the operator's ImpWarmPool controller.
type Reconciler struct {
	Client client.Client
	// APIReader lists a pool's members from the API server, not the cache: a count that lags
	// the pool's own last creates would make more.
	APIReader client.Reader
	Recorder  EventRecorder
	Members   Members
	// Clock times refills (the real clock when nil).
	Clock clock.PassiveClock

	refills refills
}

func (r *Reconciler) clock() clock.PassiveClock {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
}

// member is one of a pool's VMs as the controller sees it.
type member struct {
	vm      *impv1.ImpVM
	claim   *warmpool.Claim // bound to a claim: consumed
	stale   bool            // of an older template revision
	idle    bool
	placed  bool
	ended   bool
	created time.Time
}

// Reconcile brings one pool's members toward its spec.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	pool := &impv1.ImpWarmPool{}
	if err := r.APIReader.Get(ctx, req.NamespacedName, pool); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !pool.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil // idle members are its dependents: collected; claimed VMs are their claimants'
	}
	orig := pool.DeepCopy()
	pool.Status.ObservedGeneration = pool.Generation
	pool.Status.Selector = labels.SelectorFromSet(labels.Set{impv1.WarmPoolLabel: pool.Name}).String()

	members, err := r.members(ctx, pool)
	if err != nil {
		return ctrl.Result{}, err
	}
	if err := r.deleteHandedOver(ctx, pool, members); err != nil {
		return ctrl.Result{}, err
	}

	tmpl, failure, err := r.template(ctx, pool)
	if err != nil {
		return ctrl.Result{}, err
	}
	requeue := time.Duration(0)
	if tmpl != nil {
		rev := tmpl.Status.Revision
		for _, m := range members {
			m.stale = m.vm.Labels[impv1.WarmPoolRevisionLabel] != rev
		}
		if err := r.scale(ctx, pool, members); err != nil {
			return ctrl.Result{}, err
		}
		if f := r.fill(ctx, pool, rev, members); f != nil {
			failure = f
			requeue = CreateRetry
		}
	}
	r.refills.observe(req.NamespacedName, members, r.clock().Now())
	r.computeStatus(pool, tmpl, members, failure)
	if err := r.writeStatus(ctx, orig, pool); apierrors.IsConflict(err) {
		return ctrl.Result{Requeue: true}, nil
	} else if err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{RequeueAfter: requeue}, nil
}

// failure is why the pool cannot make members.
type failure struct {
	reason, message string
}

// template is the pool's template, when members can be made of it.
func (r *Reconciler) template(ctx context.Context, pool *impv1.ImpWarmPool) (*impv1.ImpVMTemplate, *failure, error) {
	t := &impv1.ImpVMTemplate{}
	err := r.Client.Get(ctx, types.NamespacedName{Namespace: pool.Namespace, Name: pool.Spec.TemplateRef.Name}, t)
	switch {
	case apierrors.IsNotFound(err) || (err == nil && !t.DeletionTimestamp.IsZero()):
		return nil, &failure{reason: impv1.ReasonTemplateNotFound, message: fmt.Sprintf("ImpVMTemplate %q does not exist in namespace %s (or is being deleted): no member is made", pool.Spec.TemplateRef.Name, pool.Namespace)}, nil
	case err != nil:
		return nil, nil, fmt.Errorf("getting ImpVMTemplate %s: %w", pool.Spec.TemplateRef.Name, err)
	case (pool.Spec.NetworkRef != nil) != (t.Spec.VM.NetworkRef != nil):
		has := map[bool]string{true: "has a network interface", false: "has no network interface"}
		return nil, &failure{reason: impv1.ReasonTemplateIncompatible,
			message: fmt.Sprintf("the VM of ImpVMTemplate %s %s: the pool's networkRef must be set if, and only if, it has one", t.Name, has[t.Spec.VM.NetworkRef != nil])}, nil
	case t.Status.Revision == "":
		return nil, &failure{reason: impv1.ReasonTemplateNotReady, message: fmt.Sprintf("ImpVMTemplate %s has not been looked at yet", t.Name)}, nil
	}
	return t, nil, nil
}

// members lists the pool's members from the API server: the VMs it controls that carry its
// label. A VM with the label and another controller is not a member: never counted, deleted or
// handed out.
func (r *Reconciler) members(ctx context.Context, pool *impv1.ImpWarmPool) ([]*member, error) {
	var list impv1.ImpVMList
	if err := r.APIReader.List(ctx, &list, client.InNamespace(pool.Namespace), client.MatchingLabels{impv1.WarmPoolLabel: pool.Name}); err != nil {
		return nil, fmt.Errorf("listing the members of ImpWarmPool %s: %w", pool.Name, err)
	}
	var out []*member
	for i := range list.Items {
		vm := &list.Items[i]
		if !metav1.IsControlledBy(vm, pool) || impv1.WarmPoolOf(vm) != pool.Name || !vm.DeletionTimestamp.IsZero() {
			continue
		}
		m := &member{vm: vm, idle: warmpool.Idle(vm), placed: vm.Status.NodeName != "", created: vm.CreationTimestamp.Time,
			ended: vm.Status.Phase == impv1.VMSucceeded || vm.Status.Phase == impv1.VMFailed}
		if c, ok := r.Members.Claim(vm.UID); ok {
			m.claim = &c
		}
		out = append(out, m)
	}
	return out, nil
}

// deleteHandedOver deletes the members bound to a claim once the claim's node took the member
// over (it reported on the claim's run, either way) or the claim is gone, and members that
// ended. A member being handed over is left alone.
func (r *Reconciler) deleteHandedOver(ctx context.Context, pool *impv1.ImpWarmPool, members []*member) error {
	for _, m := range members {
		switch {
		case m.ended && m.claim == nil:
			if !r.Members.Retire(m.vm.UID) {
				continue // bound meanwhile: its claim decides
			}
		case m.claim != nil:
			claim := &impv1.ImpVM{}
			err := r.Client.Get(ctx, types.NamespacedName{Namespace: pool.Namespace, Name: m.claim.Name}, claim)
			if err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("getting claim %s: %w", m.claim.Name, err)
			}
			gone := apierrors.IsNotFound(err) || claim.UID != m.claim.UID || !claim.DeletionTimestamp.IsZero()
			if !gone && !handedOver(claim, m.vm.UID) {
				continue
			}
		default:
			continue
		}
		if err := r.delete(ctx, m.vm); err != nil {
			return err
		}
		m.vm.DeletionTimestamp = ptr.To(metav1.Now())
	}
	return nil
}

// handedOver: the member is the claim's no more to wait for. The claim's node reported on the
// placement that names the member (it took the member over, or failed to); or the claim was
// placed otherwise since (restored, after a handover that failed). A claim whose status does not
// name the member yet is being bound to it: the binding's write is on its way.
func handedOver(claim *impv1.ImpVM, member types.UID) bool {
	rt, w := claim.Status.Runtime, claim.Status.Warm
	switch {
	case w != nil && w.MemberUID == string(member):
		return rt != nil && rt.Instance == claim.Status.Instance
	case w != nil:
		return true
	}
	return claim.Status.Start != ""
}

func (r *Reconciler) delete(ctx context.Context, vm *impv1.ImpVM) error {
	if err := r.Client.Delete(ctx, vm, client.Preconditions{UID: &vm.UID}); client.IgnoreNotFound(err) != nil && !apierrors.IsConflict(err) {
		return fmt.Errorf("deleting member %s: %w", vm.Name, err)
	}
	return nil
}

// live are the members that count toward replicas: not bound to a claim, not being deleted,
// not ended.
func live(members []*member) []*member {
	var out []*member
	for _, m := range members {
		if m.claim == nil && m.vm.DeletionTimestamp.IsZero() && !m.ended {
			out = append(out, m)
		}
	}
	return out
}

// scale deletes members beyond replicas (and, with Recreate, those of an older revision), in
// this order: unplaced, not idle, stale, newest. A member a claim took meanwhile is skipped.
func (r *Reconciler) scale(ctx context.Context, pool *impv1.ImpWarmPool, members []*member) error {
	var doomed, keep []*member
	for _, m := range live(members) {
		if m.stale && pool.Spec.UpdateStrategy.Type == impv1.WarmPoolRecreate {
			doomed = append(doomed, m)
		} else {
			keep = append(keep, m)
		}
	}
	if surplus := len(keep) - int(ptr.Deref(pool.Spec.Replicas, 1)); surplus > 0 {
		slices.SortStableFunc(keep, func(a, b *member) int {
			for _, less := range []func(*member) bool{
				func(m *member) bool { return !m.placed },
				func(m *member) bool { return !m.idle },
				func(m *member) bool { return m.stale },
			} {
				if less(a) != less(b) {
					if less(a) {
						return -1
					}
					return 1
				}
			}
			return b.created.Compare(a.created)
		})
		doomed = append(doomed, keep[:surplus]...)
	}
	for _, m := range doomed {
		if !r.Members.Retire(m.vm.UID) {
			continue
		}
		if err := r.delete(ctx, m.vm); err != nil {
			return err
		}
		m.vm.DeletionTimestamp = ptr.To(metav1.Now())
	}
	return nil
}

// fill makes members of rev up to replicas, in batches that double (1, 2, 4, ...) as a
// ReplicaSet's do, so that a refusal (a quota) costs one request rather than one per member.
func (r *Reconciler) fill(ctx context.Context, pool *impv1.ImpWarmPool, rev string, members []*member) *failure {
	want := int(ptr.Deref(pool.Spec.Replicas, 1)) - len(live(members))
	for batch := 1; want > 0; batch *= 2 {
		n := min(batch, want)
		want -= n
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { errs[i] = r.Client.Create(ctx, newMember(pool, rev)) })
		}
		wg.Wait()
		for _, err := range errs {
			if err == nil {
				continue
			}
			f := &failure{reason: impv1.ReasonCreateFailed, message: fmt.Sprintf("creating a member: %v", err)}
			if apierrors.IsForbidden(err) && isQuota(err) {
				f.reason = impv1.ReasonQuotaExceeded
			}
			r.Recorder.Eventf(pool, nil, "Warning", f.reason, "Create", f.message)
			return f
		}
	}
	return nil
}

// isQuota: the API server's refusal names an ImpQuota (the admission policy's message).
func isQuota(err error) bool { return strings.Contains(err.Error(), "ImpQuota ") }

// newMember is a member of pool: a copy of its template, of revision rev.
func newMember(pool *impv1.ImpWarmPool, rev string) *impv1.ImpVM {
	return &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: pool.Namespace, GenerateName: pool.Name + "-",
			Labels:          map[string]string{impv1.WarmPoolLabel: pool.Name, impv1.WarmPoolRevisionLabel: rev},
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(pool, impv1.GroupVersion.WithKind("ImpWarmPool"))},
		},
		Spec: impv1.ImpVMSpec{
			TemplateRef:  &impv1.TemplateReference{Name: pool.Spec.TemplateRef.Name},
			NetworkRef:   pool.Spec.NetworkRef.DeepCopy(),
			NodeSelector: pool.Spec.NodeSelector,
			Tolerations:  pool.Spec.Tolerations,
			RunStrategy:  impv1.RunStrategyAlways,
		},
	}
}

// SetupWithManager registers the controller: a pool is reconciled when its spec changes, when
// one of its members changes, when a claim of it is placed or reported on by its node, when
// its template changes revision, and when an ImpQuota of its namespace changes its limits.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager, concurrency int) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&impv1.ImpWarmPool{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Named("impwarmpool").
		// One handler for its members and its claims: every VM event passes through it.
		Watches(&impv1.ImpVM{}, handler.EnqueueRequestsFromMapFunc(poolOf)).
		Watches(&impv1.ImpVMTemplate{}, handler.EnqueueRequestsFromMapFunc(r.poolsOfNamespace)).
		Watches(&impv1.ImpQuota{}, handler.EnqueueRequestsFromMapFunc(r.poolsOfNamespace),
			builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		WithOptions(controller.Options{MaxConcurrentReconciles: max(concurrency, 1)}).
		Complete(r)
}

// poolOf is the pool of a member (its label, with the pool as its controller), or the pool a
// claim served warm names (its member is deleted once handed over); none for any other VM.
func poolOf(_ context.Context, o client.Object) []reconcile.Request {
	vm, ok := o.(*impv1.ImpVM)
	if !ok {
		return nil
	}
	pool := impv1.WarmPoolOf(vm)
	if w := vm.Status.Warm; pool == "" && w != nil && vm.IsClaim() {
		pool = w.Pool
	}
	if pool == "" {
		return nil
	}
	return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: vm.Namespace, Name: pool}}}
}

func (r *Reconciler) poolsOfNamespace(ctx context.Context, o client.Object) []reconcile.Request {
	var list impv1.ImpWarmPoolList
	if err := r.Client.List(ctx, &list, client.InNamespace(o.GetNamespace())); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "listing the warm pools of a namespace", "namespace", o.GetNamespace())
		return nil
	}
	out := make([]reconcile.Request, 0, len(list.Items))
	for i := range list.Items {
		if t, ok := o.(*impv1.ImpVMTemplate); ok && list.Items[i].Spec.TemplateRef.Name != t.Name {
			continue
		}
		out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
	}
	return out
}

// computeStatus is the pool's status from its members as they now are.
func (r *Reconciler) computeStatus(pool *impv1.ImpWarmPool, tmpl *impv1.ImpVMTemplate, members []*member, f *failure) {
	st := &pool.Status
	st.Replicas = int32(len(live(members)))
	st.Idle = int32(r.Members.Idle(client.ObjectKeyFromObject(pool)))
	st.Claimed = 0
	for _, m := range members {
		if m.claim != nil && m.vm.DeletionTimestamp.IsZero() {
			st.Claimed++
		}
	}
	if tmpl != nil {
		st.Revision = tmpl.Status.Revision
	}
	want := ptr.Deref(pool.Spec.Replicas, 1)
	ready := metav1.Condition{Type: impv1.WarmPoolReadyCondition, Status: metav1.ConditionTrue, Reason: impv1.ReasonWarmPoolFilled,
		Message: fmt.Sprintf("%d of %d members idle", st.Idle, want), ObservedGeneration: pool.Generation}
	if st.Idle < want {
		ready.Status, ready.Reason = metav1.ConditionFalse, impv1.ReasonWarmPoolFilling
	}
	meta.SetStatusCondition(&st.Conditions, ready)
	rf := metav1.Condition{Type: impv1.WarmPoolReplicaFailureCondition, Status: metav1.ConditionFalse, Reason: impv1.ReasonMembersCreated,
		Message: "no member creation is failing", ObservedGeneration: pool.Generation}
	if f == nil {
		f = waitingForQuota(members)
	}
	if f != nil {
		rf.Status, rf.Reason, rf.Message = metav1.ConditionTrue, f.reason, f.message
	}
	meta.SetStatusCondition(&st.Conditions, rf)
}

// waitingForQuota is a member made but not placed because the namespace's ImpQuota is full
// (idle members count in it as any VM): the pool is short for that reason.
func waitingForQuota(members []*member) *failure {
	for _, m := range live(members) {
		if c := meta.FindStatusCondition(m.vm.Status.Conditions, impv1.ScheduledCondition); !m.placed && c != nil && c.Status == metav1.ConditionFalse && c.Reason == impv1.ReasonQuotaExceeded {
			return &failure{reason: impv1.ReasonQuotaExceeded, message: fmt.Sprintf("member %s waits for room in the namespace's quota: %s", m.vm.Name, c.Message)}
		}
	}
	return nil
}

func (r *Reconciler) writeStatus(ctx context.Context, orig, pool *impv1.ImpWarmPool) error {
	if equality.Semantic.DeepEqual(orig.Status, pool.Status) { // a condition unchanged keeps its time
		return nil
	}
	if err := r.Client.Status().Patch(ctx, pool, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("writing the status of ImpWarmPool %s: %w", pool.Name, err)
	}
	return nil
}
