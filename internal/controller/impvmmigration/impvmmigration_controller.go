// Package impvmmigration is the operator's side of moving a running VM to another node
// (ImpVMMigration, docs/migration.md). It decides everything that cannot be taken back and
// nothing that runs a guest: which migration has the VM (one at a time, written on the VM with
// its resourceVersion, so that of two made at once one wins), where it goes (placement, the
// same rules, room and quota as a new VM), when the source may send (Transferring), and the
// commit — the VM's status.nodeName moved to the target, in one write, only once the target's
// agent reports the whole state loaded and the source's reports its guest paused. Before the
// commit any failure, timeout or deletion ends the migration and the source runs on; after it
// the source never runs the VM again. The agents only report their side (status.source,
// status.target), which the chart's admission policy restricts to each agent's own.
package impvmmigration

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/failpoint"
	"github.com/syscode-labs/imp/internal/placement"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvmmigrations,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmmigrations/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmmigrations/finalizers,verbs=update
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms/status,verbs=get;update;patch

// Finalizer keeps a migration until the operator has let go of its VM (a migration deleted
// before its commit leaves the VM to its source) and of the room it held on its target.
const Finalizer = "imp.dev/migration"

// DefaultTimeout bounds a migration from its start to its commit (spec.timeoutSeconds).
const DefaultTimeout = 10 * time.Minute

// Reasons a migration fails (status.reason, the Ready condition, Events).
const (
	ReasonVMNotFound   = "VMNotFound"
	ReasonVMNotRunning = "VMNotRunning"
	ReasonCannotMove   = "CannotMove"
	ReasonBusy         = "MigrationInProgress"
	ReasonNoTarget     = "NoTarget"
	ReasonTargetFailed = "TargetFailed"
	ReasonSourceFailed = "SourceFailed"
	ReasonTimedOut     = "TimedOut"
	ReasonDeleted      = "Deleted"
	ReasonVMChanged    = "VMChanged"
	ReasonSucceeded    = "Succeeded"
	ReasonMigrating    = "Migrating"
	// ReasonQueued: a migration waits, Pending, for one of its namespace's under way to end.
	ReasonQueued = "Queued"
)

// DefaultPerNamespace is how many migrations of one namespace are under way at once unless
// told otherwise (Reconciler.PerNamespace); the others wait Pending, in the order they came.
const DefaultPerNamespace = 4

// queuedRetry is how often a queued migration looks again.
const queuedRetry = 2 * time.Second

// Placer chooses and holds the room of a migration's target (impvm.Migrations), and moves the
// VM's address once it is committed.
type Placer interface {
	Target(ctx context.Context, vm *impv1.ImpVM, hold types.UID, target string) (string, error)
	Keep(vm *impv1.ImpVM, hold types.UID, node string)
	Release(hold types.UID)
	Moved(ctx context.Context, vm *impv1.ImpVM, node string) error
}

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Reconciler runs ImpVMMigrations, one per request.
type Reconciler struct {
	Client    client.Client
	APIReader client.Reader // what the API server says now: the claim and the commit are decided on it
	Recorder  EventRecorder
	Clock     clock.PassiveClock
	Placer    Placer
	// PerNamespace bounds the migrations of one namespace under way at once (each holds room
	// on its target and sends a VM's memory over the network): a tenant's many migrations
	// wait their turn. 0: DefaultPerNamespace; less than 0: unbounded.
	PerNamespace int
}

func (r *Reconciler) now() metav1.Time {
	if r.Clock == nil {
		return metav1.Now()
	}
	return metav1.NewTime(r.Clock.Now())
}

// SetupWithManager registers the reconciler with mgr: migrations, and the VMs they move (a VM's
// runtime tells a committed migration that its target runs it).
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&impv1.ImpVMMigration{}).
		Watches(&impv1.ImpVM{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			vm, ok := o.(*impv1.ImpVM)
			if !ok || vm.Status.Migration == nil {
				return nil
			}
			return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: vm.Namespace, Name: vm.Status.Migration.Name}}}
		})).
		Named("impvmmigration").
		Complete(r)
}

// Reconcile moves a migration on by one step. Every write is made on the version read: one
// that conflicts (the cache behind the API server, an agent's report in between) is decided
// again on the newer version.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (res ctrl.Result, err error) {
	res, err = r.reconcile(ctx, req)
	if apierrors.IsConflict(err) {
		return ctrl.Result{Requeue: true}, nil
	}
	return res, err
}

func (r *Reconciler) reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	mig := &impv1.ImpVMMigration{}
	if err := r.Client.Get(ctx, req.NamespacedName, mig); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	st := &mig.Status
	if !mig.DeletionTimestamp.IsZero() {
		if !st.Phase.Finished() && !st.Phase.Committed() {
			if err := r.fail(ctx, mig, ReasonDeleted, "the migration was deleted before its commit: the VM runs on its source"); err != nil {
				return ctrl.Result{}, err
			}
		}
		// Whatever its phase, the VM lets go of it before it goes (deleted after its commit,
		// the VM is the target's, whose agent runs it on by its node alone).
		if err := r.letGo(ctx, mig); err != nil {
			return ctrl.Result{}, err
		}
		r.Placer.Release(mig.UID)
		if controllerutil.RemoveFinalizer(mig, Finalizer) {
			return ctrl.Result{}, client.IgnoreNotFound(r.Client.Update(ctx, mig))
		}
		return ctrl.Result{}, nil
	}
	if st.Phase.Finished() {
		r.Placer.Release(mig.UID)
		return ctrl.Result{}, r.letGo(ctx, mig) // an operator that stopped between the two writes
	}
	if controllerutil.AddFinalizer(mig, Finalizer) {
		if err := r.Client.Update(ctx, mig); err != nil {
			return ctrl.Result{}, err
		}
	}
	if !st.Phase.Committed() && st.StartedAt != nil && r.now().Sub(st.StartedAt.Time) > timeout(mig) {
		return ctrl.Result{}, r.fail(ctx, mig, ReasonTimedOut, fmt.Sprintf("not committed within %v: the VM runs on its source", timeout(mig)))
	}
	switch st.Phase {
	case "", impv1.MigrationPending:
		return r.begin(ctx, mig)
	case impv1.MigrationScheduling:
		return r.schedule(ctx, mig)
	case impv1.MigrationPreparing, impv1.MigrationTransferring:
		return r.await(ctx, mig)
	case impv1.MigrationCommitted:
		return r.finish(ctx, mig)
	}
	return ctrl.Result{}, nil
}

func timeout(mig *impv1.ImpVMMigration) time.Duration {
	if t := mig.Spec.TimeoutSeconds; t != nil {
		return time.Duration(*t) * time.Second
	}
	return DefaultTimeout
}

// vm is the migration's VM as the API server has it now: nil when it is gone or is another VM
// of the name.
func (r *Reconciler) vm(ctx context.Context, mig *impv1.ImpVMMigration) (*impv1.ImpVM, error) {
	vm := &impv1.ImpVM{}
	if err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: mig.Namespace, Name: mig.Spec.VMName}, vm); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		return nil, fmt.Errorf("getting VM %s of migration %s: %w", mig.Spec.VMName, mig.Name, err)
	}
	if mig.Status.VMUID != "" && vm.UID != mig.Status.VMUID {
		return nil, nil
	}
	return vm, nil
}

// movable says why vm cannot be moved now, or "".
func movable(vm *impv1.ImpVM) (reason, message string) {
	st, rt := &vm.Status, vm.Status.Runtime
	switch {
	case !vm.DeletionTimestamp.IsZero():
		return ReasonVMNotRunning, "the VM is being deleted"
	case vm.Spec.Boot == impv1.BootOS: // nor this
		return ReasonCannotMove, "the VM boots an OS (spec.boot OS): moving it is not built yet (docs/os.md)"
	case claimOf(vm) != "": // said first: no waiting for a run makes it movable
		return ReasonCannotMove, "the VM's volume " + claimOf(vm) + ": moving a PersistentVolumeClaim's volume is not built yet (docs/migration.md)"
	case st.Suspension != nil:
		return ReasonVMNotRunning, "the VM is suspended: resume it first (a suspended VM's state stays on its node)"
	case st.Phase != impv1.VMRunning || st.NodeName == "" || rt == nil || rt.Instance != st.Instance || rt.Run != st.RestartCount ||
		rt.State != impv1.RuntimeRunning || !rt.GuestReady:
		return ReasonVMNotRunning, "the VM is not running with its guest ready (phase " + string(st.Phase) + ")"
	case impv1.WarmPoolOf(vm) != "":
		return ReasonCannotMove, "the VM is a warm pool's member: its pool places its members"
	case vm.HostUID() != vm.UID:
		return ReasonCannotMove, "the VM runs on a warm pool member's run (a claim served warm): moving it is not built yet"
	case vm.Spec.NodeName != "":
		return ReasonCannotMove, "the VM asks for node " + vm.Spec.NodeName + " (spec.nodeName)"
	case st.Resources != nil && st.Resources.VMM == impv1.VMMFirecracker:
		return ReasonCannotMove, "the VM runs under Firecracker: moving it is not built yet (docs/migration.md)"
	}
	return "", ""
}

// claimOf names the VM's first volume of a PersistentVolumeClaim ("NAME (claim CLAIM)"), "" for
// none: its disk volumes of its own (emptyDisk) are mirrored with its writable disk, its volumes
// of files (secret, configMap, downwardAPI) made again on the target, but a claim's volume
// would have to be attached there.
func claimOf(vm *impv1.ImpVM) string {
	for _, v := range vm.Spec.Volumes {
		if v.PersistentVolumeClaim != nil {
			return v.Name + " (claim " + v.PersistentVolumeClaim.ClaimName + ")"
		}
	}
	return ""
}

// begin checks the VM and makes it the migration's: its status.migration written on the version
// read, so that of two migrations begun at once, one has it and the other fails.
func (r *Reconciler) begin(ctx context.Context, mig *impv1.ImpVMMigration) (ctrl.Result, error) {
	vm, err := r.vm(ctx, mig)
	if err != nil {
		return ctrl.Result{}, err
	}
	if vm == nil {
		return ctrl.Result{}, r.fail(ctx, mig, ReasonVMNotFound, fmt.Sprintf("ImpVM %s does not exist in namespace %s", mig.Spec.VMName, mig.Namespace))
	}
	if m := vm.Status.Migration; m != nil && m.UID != mig.UID {
		if over, err := r.over(ctx, vm, m); err != nil || over {
			return ctrl.Result{Requeue: over}, err // the VM is let go of a migration that ended: looked at again
		}
		return ctrl.Result{}, r.fail(ctx, mig, ReasonBusy, fmt.Sprintf("ImpVMMigration %s is moving the VM: one migration at a time", m.Name))
	}
	if reason, msg := movable(vm); reason != "" {
		return ctrl.Result{}, r.fail(ctx, mig, reason, msg)
	}
	if mig.Spec.TargetNode == vm.Status.NodeName {
		return ctrl.Result{}, r.fail(ctx, mig, ReasonNoTarget, "the target node is the VM's own node "+vm.Status.NodeName)
	}
	if vm.Status.Migration == nil {
		// Its namespace's turn first (a VM already the migration's began before it stopped).
		if msg, err := r.ahead(ctx, mig); err != nil || msg != "" {
			if err != nil {
				return ctrl.Result{}, err
			}
			if c := meta.FindStatusCondition(mig.Status.Conditions, impv1.ReadyCondition); c == nil || c.Message != msg {
				err = r.setStatus(ctx, mig, func(st *impv1.ImpVMMigrationStatus) {
					st.Phase = impv1.MigrationPending
					setReady(st, metav1.ConditionFalse, ReasonQueued, msg, mig.Generation)
				})
			}
			return ctrl.Result{RequeueAfter: queuedRetry}, err
		}
		orig := vm.DeepCopy()
		vm.Status.Migration = &impv1.MigrationStatus{Name: mig.Name, UID: mig.UID, Phase: impv1.MigrationScheduling, SourceNode: vm.Status.NodeName,
			Instance: vm.Status.Instance, Run: vm.Status.RestartCount}
		if err := r.Client.Status().Patch(ctx, vm, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
			if apierrors.IsConflict(err) {
				return ctrl.Result{Requeue: true}, nil // looked at again as it is now
			}
			return ctrl.Result{}, fmt.Errorf("making VM %s the migration's: %w", vm.Name, err)
		}
	}
	now := r.now()
	return ctrl.Result{}, r.setStatus(ctx, mig, func(st *impv1.ImpVMMigrationStatus) {
		st.Phase, st.VMUID, st.SourceNode, st.StartedAt = impv1.MigrationScheduling, vm.UID, vm.Status.Migration.SourceNode, &now
		setReady(st, metav1.ConditionFalse, ReasonMigrating, "choosing the target node", mig.Generation)
	})
}

func (r *Reconciler) perNamespace() int {
	if r.PerNamespace == 0 {
		return DefaultPerNamespace
	}
	return r.PerNamespace
}

// ahead says why mig waits ("" when it may begin): its namespace's migrations under way, and
// those created before it and still waiting, which go first, are as many as the namespace may
// have at once. As the API server has them: the cache may not have seen the last one begun.
func (r *Reconciler) ahead(ctx context.Context, mig *impv1.ImpVMMigration) (string, error) {
	limit := r.perNamespace()
	if limit < 0 {
		return "", nil
	}
	var list impv1.ImpVMMigrationList
	if err := r.APIReader.List(ctx, &list, client.InNamespace(mig.Namespace)); err != nil {
		return "", fmt.Errorf("listing the migrations of namespace %s: %w", mig.Namespace, err)
	}
	var busy, before []string
	for i := range list.Items {
		o := &list.Items[i]
		switch {
		case o.UID == mig.UID || o.Status.Phase.Finished() || !o.DeletionTimestamp.IsZero():
		case o.Status.Phase != "" && o.Status.Phase != impv1.MigrationPending:
			busy = append(busy, o.Name)
		case o.CreationTimestamp.Before(&mig.CreationTimestamp) || o.CreationTimestamp.Equal(&mig.CreationTimestamp) && o.Name < mig.Name:
			before = append(before, o.Name)
		}
	}
	if len(busy)+len(before) < limit {
		return "", nil
	}
	sort.Strings(busy)
	msg := fmt.Sprintf("queued: namespace %s may have %d migrations under way at once; under way: %d", mig.Namespace, limit, len(busy))
	if len(busy) > 0 {
		msg += " (" + strings.Join(busy, ", ") + ")"
	}
	if len(before) > 0 {
		msg += fmt.Sprintf("; queued before this one: %d", len(before))
	}
	return msg, nil
}

// schedule chooses the target and holds its room; it tries again while no node has room, until
// the migration's timeout.
func (r *Reconciler) schedule(ctx context.Context, mig *impv1.ImpVMMigration) (ctrl.Result, error) {
	vm, err := r.owned(ctx, mig)
	if vm == nil || err != nil {
		return ctrl.Result{}, err
	}
	if reason, msg := movable(vm); reason != "" {
		return ctrl.Result{}, r.fail(ctx, mig, reason, msg)
	}
	node, err := r.Placer.Target(ctx, vm, mig.UID, mig.Spec.TargetNode)
	var unsched *placement.Unschedulable
	var quota *placement.QuotaExceeded
	if errors.As(err, &unsched) || errors.As(err, &quota) {
		if err := r.setStatus(ctx, mig, func(st *impv1.ImpVMMigrationStatus) {
			st.Message = "no target yet: " + err.Error()
			setReady(st, metav1.ConditionFalse, ReasonNoTarget, st.Message, mig.Generation)
		}); err != nil {
			return ctrl.Result{}, err
		}
		return ctrl.Result{RequeueAfter: 5 * time.Second}, nil
	}
	if err != nil {
		return ctrl.Result{}, err
	}
	if err := r.setVM(ctx, mig, vm, func(m *impv1.MigrationStatus) { m.Phase, m.TargetNode = impv1.MigrationPreparing, node }); err != nil {
		return ctrl.Result{}, err
	}
	r.Recorder.Eventf(mig, vm, corev1.EventTypeNormal, "Scheduled", "Migrate", "VM %s moves from node %s to node %s", vm.Name, vm.Status.NodeName, node)
	return ctrl.Result{}, r.setStatus(ctx, mig, func(st *impv1.ImpVMMigrationStatus) {
		st.Phase, st.TargetNode, st.Message = impv1.MigrationPreparing, node, ""
		setReady(st, metav1.ConditionFalse, ReasonMigrating, "the target node prepares the VM's place", mig.Generation)
	})
}

// owned is the migration's VM, read as the API server has it, if it is still the migration's;
// otherwise the migration fails (nil, and the error of failing).
func (r *Reconciler) owned(ctx context.Context, mig *impv1.ImpVMMigration) (*impv1.ImpVM, error) {
	vm, err := r.vm(ctx, mig)
	if err != nil {
		return nil, err
	}
	if vm == nil {
		return nil, r.fail(ctx, mig, ReasonVMNotFound, "the VM is gone")
	}
	if m := vm.Status.Migration; m == nil || m.UID != mig.UID {
		return nil, r.fail(ctx, mig, ReasonVMChanged, "the VM is no longer this migration's")
	}
	if !vm.DeletionTimestamp.IsZero() {
		return nil, r.fail(ctx, mig, ReasonVMNotRunning, "the VM is being deleted")
	}
	return vm, nil
}

// await follows the agents: the target prepared (Preparing → Transferring, the source may
// send), then the whole state on the target and the source's guest paused (the commit). Either
// agent failing fails the migration.
func (r *Reconciler) await(ctx context.Context, mig *impv1.ImpVMMigration) (ctrl.Result, error) {
	vm, err := r.owned(ctx, mig)
	if vm == nil || err != nil {
		return ctrl.Result{}, err
	}
	if committedOn(vm, mig) {
		return ctrl.Result{}, r.recordCommit(ctx, mig) // the operator stopped, or its copy was older, after the commit
	}
	st := &mig.Status
	r.Placer.Keep(vm, mig.UID, st.TargetNode)
	src, tgt := st.Source, st.Target
	switch {
	case tgt != nil && tgt.State == impv1.MigrationAgentFailed:
		return ctrl.Result{}, r.fail(ctx, mig, ReasonTargetFailed, "the target node failed: "+tgt.Message)
	case src != nil && src.State == impv1.MigrationAgentFailed:
		return ctrl.Result{}, r.fail(ctx, mig, ReasonSourceFailed, "the source node failed: "+src.Message)
	case vm.Status.NodeName != st.SourceNode:
		return ctrl.Result{}, r.fail(ctx, mig, ReasonVMChanged, "the VM left its source node "+st.SourceNode)
	case vm.Status.Instance != vm.Status.Migration.Instance || vm.Status.RestartCount != vm.Status.Migration.Run || vm.Status.Phase != impv1.VMRunning:
		// Restarted, stopped or ended meanwhile: the state the target took is not the VM's.
		return ctrl.Result{}, r.fail(ctx, mig, ReasonVMChanged, "the VM's run changed during the migration (a restart, a stop or its end)")
	}
	if reason, msg := movable(vm); reason != "" && (src == nil || src.State != impv1.MigrationAgentPaused) {
		// The VM stopped running of itself (it exited, was suspended): nothing to move. A guest
		// paused for the last of its state is the migration's doing.
		return ctrl.Result{}, r.fail(ctx, mig, reason, msg)
	}
	if st.Phase == impv1.MigrationPreparing {
		if tgt == nil || tgt.State != impv1.MigrationAgentReady {
			return r.requeueForTimeout(mig), nil
		}
		if err := r.setVM(ctx, mig, vm, func(m *impv1.MigrationStatus) { m.Phase = impv1.MigrationTransferring }); err != nil {
			return ctrl.Result{}, err
		}
		return ctrl.Result{}, r.setStatus(ctx, mig, func(st *impv1.ImpVMMigrationStatus) {
			st.Phase = impv1.MigrationTransferring
			setReady(st, metav1.ConditionFalse, ReasonMigrating, "the source sends the VM's state", mig.Generation)
		})
	}
	if tgt == nil || tgt.State != impv1.MigrationAgentLoaded || src == nil || src.State != impv1.MigrationAgentPaused {
		if src != nil && src.Bytes != st.BytesMoved {
			return r.requeueForTimeout(mig), r.setStatus(ctx, mig, func(st *impv1.ImpVMMigrationStatus) { st.BytesMoved = src.Bytes })
		}
		return r.requeueForTimeout(mig), nil
	}
	return ctrl.Result{}, r.commit(ctx, mig, vm)
}

// requeueForTimeout comes back when the migration's timeout passes, if nothing else wakes it.
func (r *Reconciler) requeueForTimeout(mig *impv1.ImpVMMigration) ctrl.Result {
	if mig.Status.StartedAt == nil {
		return ctrl.Result{}
	}
	return ctrl.Result{RequeueAfter: max(time.Second, timeout(mig)-r.now().Sub(mig.Status.StartedAt.Time)+time.Second)}
}

// commit is the migration's one decision that cannot be taken back: the VM's nodeName becomes
// the target's, with its migration Committed, in one write on the version read. From then on
// the source's agent lets its run go and the target's runs the guest on.
func (r *Reconciler) commit(ctx context.Context, mig *impv1.ImpVMMigration, vm *impv1.ImpVM) error {
	st := &mig.Status
	orig := vm.DeepCopy()
	vm.Status.NodeName = st.TargetNode
	vm.Status.Migration.Phase = impv1.MigrationCommitted
	if err := r.Client.Status().Patch(ctx, vm, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("committing the migration of VM %s: %w", vm.Name, err) // a conflict: decided again on the newer version
	}
	failpoint.Crash("migration-committed") // the VM moved, the migration not yet told
	r.Recorder.Eventf(vm, mig, corev1.EventTypeNormal, "Migrated", "Migrate", "The VM moved from node %s to node %s (paused %v)",
		st.SourceNode, st.TargetNode, downtime(st.Source))
	return r.recordCommit(ctx, mig)
}

// committedOn says whether vm records the commit of mig: the VM's status is where the commit is
// made, and what it says there holds whatever the migration's status still says.
func committedOn(vm *impv1.ImpVM, mig *impv1.ImpVMMigration) bool {
	m := vm.Status.Migration
	return m != nil && m.UID == mig.UID && m.Phase == impv1.MigrationCommitted
}

// recordCommit writes the commit made on the VM into the migration's status.
func (r *Reconciler) recordCommit(ctx context.Context, mig *impv1.ImpVMMigration) error {
	now := r.now()
	return r.setStatus(ctx, mig, func(st *impv1.ImpVMMigrationStatus) {
		st.Phase, st.CommittedAt, st.Reason, st.Message = impv1.MigrationCommitted, &now, "", ""
		if src := st.Source; src != nil {
			st.Downtime = src.Downtime
			st.BytesMoved = max(st.BytesMoved, src.Bytes)
		}
		setReady(st, metav1.ConditionFalse, ReasonMigrating, "committed: the target runs the VM on", mig.Generation)
	})
}

func downtime(src *impv1.MigrationAgentReport) time.Duration {
	if src == nil || src.Downtime == nil {
		return 0
	}
	return src.Downtime.Round(time.Millisecond)
}

// finish follows a committed migration: the VM's address moved to the target, and once the
// target runs the guest, the migration has succeeded and the VM is let go.
func (r *Reconciler) finish(ctx context.Context, mig *impv1.ImpVMMigration) (ctrl.Result, error) {
	vm, err := r.vm(ctx, mig)
	if err != nil {
		return ctrl.Result{}, err
	}
	if vm != nil {
		if err := r.Placer.Moved(ctx, vm, mig.Status.TargetNode); err != nil {
			return ctrl.Result{}, err
		}
	}
	running := vm == nil || (mig.Status.Target != nil && mig.Status.Target.State == impv1.MigrationAgentRunning)
	if vm != nil && vm.Status.NodeName != mig.Status.TargetNode {
		running = true // placed again since (its target failed it after the commit): over
	}
	if !running {
		return ctrl.Result{}, nil // the target's report wakes it
	}
	now := r.now()
	if err := r.setStatus(ctx, mig, func(st *impv1.ImpVMMigrationStatus) {
		st.Phase, st.CompletedAt, st.Reason, st.Message = impv1.MigrationSucceeded, &now, ReasonSucceeded, ""
		setReady(st, metav1.ConditionTrue, ReasonSucceeded, fmt.Sprintf("the VM runs on node %s", st.TargetNode), mig.Generation)
	}); err != nil {
		return ctrl.Result{}, err
	}
	observeEnd(&mig.Status)
	r.Placer.Release(mig.UID)
	return ctrl.Result{}, r.letGo(ctx, mig)
}

// fail ends a migration before its commit: the VM is no longer the migration's (its source's
// agent resumes a guest it paused), the target's room is released, and the migration says why.
func (r *Reconciler) fail(ctx context.Context, mig *impv1.ImpVMMigration, reason, msg string) error {
	if mig.Status.Phase.Committed() {
		return fmt.Errorf("migration %s is committed: it cannot fail", mig.Name)
	}
	vm, err := r.vm(ctx, mig)
	if err != nil {
		return err
	}
	if vm != nil && committedOn(vm, mig) {
		return r.recordCommit(ctx, mig) // committed already (this copy of the migration is older than the commit)
	}
	// Failed first, then the VM let go: a migration Finished lets its VM go on every pass, so
	// an operator that stops in between loses nothing, and the reason is the first one.
	now := r.now()
	if len(msg) > 1024 {
		msg = msg[:1024]
	}
	if err := r.setStatus(ctx, mig, func(st *impv1.ImpVMMigrationStatus) {
		st.Phase, st.CompletedAt, st.Reason, st.Message = impv1.MigrationFailed, &now, reason, msg
		setReady(st, metav1.ConditionFalse, reason, msg, mig.Generation)
	}); err != nil {
		return err
	}
	observeEnd(&mig.Status)
	r.Recorder.Eventf(mig, nil, corev1.EventTypeWarning, reason, "Migrate", "%s", msg)
	r.Placer.Release(mig.UID)
	return r.letGo(ctx, mig)
}

// over lets vm go of the migration m its status names when that migration ended before the VM
// was let go of it (it failed, or is gone; an operator that stopped between the two writes, or
// a migration begun just after another ended), and says whether it did. A committed one is the
// VM's record of its move: only its own end lets go of it.
func (r *Reconciler) over(ctx context.Context, vm *impv1.ImpVM, m *impv1.MigrationStatus) (bool, error) {
	if m.Phase.Committed() {
		return false, nil
	}
	other := &impv1.ImpVMMigration{}
	err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: m.Name}, other)
	if err != nil && !apierrors.IsNotFound(err) {
		return false, err
	}
	if err == nil && other.UID == m.UID && !other.Status.Phase.Finished() {
		return false, nil
	}
	orig := vm.DeepCopy()
	vm.Status.Migration = nil
	if err := r.Client.Status().Patch(ctx, vm, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return false, fmt.Errorf("letting VM %s go of migration %s, which ended: %w", vm.Name, m.Name, err)
	}
	return true, nil
}

// letGo removes the migration from its VM's status, if the VM names it.
func (r *Reconciler) letGo(ctx context.Context, mig *impv1.ImpVMMigration) error {
	vm := &impv1.ImpVM{}
	if err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: mig.Namespace, Name: mig.Spec.VMName}, vm); err != nil {
		return client.IgnoreNotFound(err)
	}
	if m := vm.Status.Migration; m == nil || m.UID != mig.UID {
		return nil
	}
	orig := vm.DeepCopy()
	vm.Status.Migration = nil
	if err := r.Client.Status().Patch(ctx, vm, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("letting VM %s go from migration %s: %w", vm.Name, mig.Name, err)
	}
	return nil
}

// setVM changes the VM's status.migration on the version read.
func (r *Reconciler) setVM(ctx context.Context, mig *impv1.ImpVMMigration, vm *impv1.ImpVM, set func(m *impv1.MigrationStatus)) error {
	orig := vm.DeepCopy()
	set(vm.Status.Migration)
	if err := r.Client.Status().Patch(ctx, vm, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("telling VM %s where migration %s stands: %w", vm.Name, mig.Name, err)
	}
	return nil
}

// setStatus writes what set changes of the migration's status, the agents' reports left as
// they are (a merge patch names only what changed), on the version read: a copy older than an
// agent's report or the operator's own last write writes nothing (a conflict).
func (r *Reconciler) setStatus(ctx context.Context, mig *impv1.ImpVMMigration, set func(st *impv1.ImpVMMigrationStatus)) error {
	orig := mig.DeepCopy()
	set(&mig.Status)
	if err := r.Client.Status().Patch(ctx, mig, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("writing the status of migration %s: %w", mig.Name, err)
	}
	return nil
}

func setReady(st *impv1.ImpVMMigrationStatus, status metav1.ConditionStatus, reason, msg string, gen int64) {
	if len(msg) > 1024 {
		msg = msg[:1024]
	}
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: status, Reason: reason, Message: msg, ObservedGeneration: gen})
}
