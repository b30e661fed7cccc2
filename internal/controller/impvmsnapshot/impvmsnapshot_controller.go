// Package impvmsnapshot is the operator's half of ImpVMSnapshots: it holds each with a finalizer,
// gives it to its VM's node (status.nodeName) once the VM runs or is suspended there, where the
// node's agent takes it, and lets it go once that node removed its files or is gone.
package impvmsnapshot

import (
	"context"
	"errors"
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/impquota"
	"github.com/syscode-labs/imp/internal/runsecret"
	"github.com/syscode-labs/imp/internal/snapshotsecret"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvmsnapshots,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=imp.dev,resources=impvmsnapshots/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmsnapshots/finalizers,verbs=update
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impquotas,verbs=get;list;watch
// Secrets: its key Secret in IMP's namespace is written under the chart's Role there
// (imp-operator-run-secrets); a tenant's registry credentials are read as a VM's pull secrets are.
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch

// indexVM indexes ImpVMSnapshots by the VM they are of.
const indexVM = "spec.vmName"

// Reconciler is the operator's ImpVMSnapshot controller.
type Reconciler struct {
	Client client.Client
	// APIReader lists the namespace's snapshots past the cache, for the quota: the cache may
	// not have the last one given to a node yet.
	APIReader client.Reader
	// Clock is what schedules follow (the real clock when nil).
	Clock clock.PassiveClock
	// SecretNamespace is IMP's namespace, where a pushed snapshot's key Secret lives
	// (snapshotsecret).
	SecretNamespace string
}

func (r *Reconciler) secretNamespace() string {
	if r.SecretNamespace == "" {
		return runsecret.DefaultNamespace
	}
	return r.SecretNamespace
}

func (r *Reconciler) clock() clock.PassiveClock {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
}

// Reconcile holds, assigns or releases one snapshot.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	snap := &impv1.ImpVMSnapshot{}
	if err := r.Client.Get(ctx, req.NamespacedName, snap); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !snap.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, r.release(ctx, snap)
	}
	if !controllerutil.ContainsFinalizer(snap, impv1.SnapshotFinalizer) {
		patch := client.MergeFromWithOptions(snap.DeepCopy(), client.MergeFromWithOptimisticLock{})
		controllerutil.AddFinalizer(snap, impv1.SnapshotFinalizer)
		if err := r.Client.Patch(ctx, snap, patch); err != nil {
			return ctrl.Result{}, fmt.Errorf("holding ImpVMSnapshot %s: %w", snap.Name, err)
		}
	}
	if snap.Spec.Schedule != "" {
		return r.schedule(ctx, snap)
	}
	if snap.Status.NodeName != "" {
		return ctrl.Result{}, nil // the node's agent has it
	}
	vm := &impv1.ImpVM{}
	err := r.Client.Get(ctx, types.NamespacedName{Namespace: snap.Namespace, Name: snap.Spec.VMName}, vm)
	switch {
	case apierrors.IsNotFound(err):
		return ctrl.Result{}, r.pending(ctx, snap, "", impv1.ReasonSnapshotVMNotFound, fmt.Sprintf("ImpVM %q does not exist in namespace %s", snap.Spec.VMName, snap.Namespace))
	case err != nil:
		return ctrl.Result{}, fmt.Errorf("getting ImpVM %s: %w", snap.Spec.VMName, err)
	}
	rt := vm.Status.Runtime
	if vm.Status.NodeName == "" || rt == nil || (rt.State != impv1.RuntimeRunning && rt.State != impv1.RuntimeSuspended) || !vm.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, r.pending(ctx, snap, "", impv1.ReasonSnapshotVMNotRunning, fmt.Sprintf("ImpVM %s neither runs nor is suspended on a node: the snapshot is taken once it does", vm.Name))
	}
	if why, err := r.quotaRoom(ctx, snap); err != nil {
		return ctrl.Result{}, err
	} else if why != "" {
		return ctrl.Result{}, r.pending(ctx, snap, "", impv1.ReasonQuotaExceeded, why)
	}
	if snap.Spec.Registry != nil {
		var missing snapshotsecret.ErrNoCredentials
		if err := snapshotsecret.Ensure(ctx, r.Client, r.APIReader, r.secretNamespace(), snap); errors.As(err, &missing) {
			return ctrl.Result{}, r.pending(ctx, snap, "", impv1.ReasonRegistrySecretNotFound, missing.Error()+" in namespace "+snap.Namespace)
		} else if err != nil {
			return ctrl.Result{}, err
		}
	}
	// Its node's agent takes it from here.
	return ctrl.Result{}, r.pending(ctx, snap, vm.Status.NodeName, "", fmt.Sprintf("to be taken on node %s", vm.Status.NodeName))
}

// quotaRoom says which ImpQuota of the namespace the snapshot would break, or "": the number
// of snapshots, and the storage they take with this one counted at its most (its VM's memory
// and disk size).
func (r *Reconciler) quotaRoom(ctx context.Context, snap *impv1.ImpVMSnapshot) (string, error) {
	var quotas impv1.ImpQuotaList
	if err := r.Client.List(ctx, &quotas, client.InNamespace(snap.Namespace)); err != nil {
		return "", fmt.Errorf("listing ImpQuotas: %w", err)
	}
	if len(quotas.Items) == 0 {
		return "", nil
	}
	var snaps impv1.ImpVMSnapshotList
	if err := r.APIReader.List(ctx, &snaps, client.InNamespace(snap.Namespace)); err != nil {
		return "", fmt.Errorf("listing the namespace's snapshots: %w", err)
	}
	var vms impv1.ImpVMList
	if err := r.Client.List(ctx, &vms, client.InNamespace(snap.Namespace)); err != nil {
		return "", fmt.Errorf("listing the namespace's VMs: %w", err)
	}
	others := slices.DeleteFunc(snaps.Items, func(s impv1.ImpVMSnapshot) bool { return s.UID == snap.UID })
	n, storage := impquota.UsedBySnapshots(others, vms.Items)
	storage.Add(impquota.SnapshotEstimate(snap.Spec.VMName, vms.Items))
	for _, q := range quotas.Items {
		h := q.Spec.Hard
		if h.Snapshots != nil && n+1 > *h.Snapshots {
			return fmt.Sprintf("ImpQuota %s allows %d snapshots; the namespace has %d", q.Name, *h.Snapshots, n), nil
		}
		if h.SnapshotStorage != nil && storage.Cmp(*h.SnapshotStorage) > 0 {
			return fmt.Sprintf("ImpQuota %s allows %s of snapshot storage; with this one (at most its VM's memory and disk) the namespace's would take %s", q.Name, h.SnapshotStorage, storage.String()), nil
		}
	}
	return "", nil
}

// pending writes the snapshot's phase Pending, with the node it is given to ("" for none yet).
func (r *Reconciler) pending(ctx context.Context, snap *impv1.ImpVMSnapshot, node, reason, msg string) error {
	return r.setStatus(ctx, snap, func(st *impv1.ImpVMSnapshotStatus) {
		st.Phase, st.NodeName, st.Reason, st.Message = impv1.SnapshotPending, node, reason, msg
	})
}

// release lets a deleted snapshot go once nothing of it is left on a node: none was given
// it, its node removed its files, or its node is gone.
func (r *Reconciler) release(ctx context.Context, snap *impv1.ImpVMSnapshot) error {
	if !controllerutil.ContainsFinalizer(snap, impv1.SnapshotFinalizer) {
		return nil
	}
	if snap.Spec.Schedule != "" {
		if err := r.dropScheduled(ctx, snap); err != nil {
			return err
		}
	}
	gone := snap.Status.NodeName == "" || snap.Status.FilesRemoved
	if !gone {
		node := &corev1.Node{}
		err := r.Client.Get(ctx, types.NamespacedName{Name: snap.Status.NodeName}, node)
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("getting node %s: %w", snap.Status.NodeName, err)
		}
		gone = apierrors.IsNotFound(err)
	}
	if !gone {
		return nil // its node's agent removes the files, then says so
	}
	if err := snapshotsecret.Delete(ctx, r.Client, r.secretNamespace(), snap.UID); err != nil {
		return fmt.Errorf("removing the key of ImpVMSnapshot %s: %w", snap.Name, err)
	}
	patch := client.MergeFromWithOptions(snap.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.RemoveFinalizer(snap, impv1.SnapshotFinalizer)
	if err := client.IgnoreNotFound(r.Client.Patch(ctx, snap, patch)); err != nil {
		return fmt.Errorf("releasing ImpVMSnapshot %s: %w", snap.Name, err)
	}
	return nil
}

// SetupWithManager registers the controller: snapshots, and the VMs they wait for.
func (r *Reconciler) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	if err := mgr.GetFieldIndexer().IndexField(ctx, &impv1.ImpVMSnapshot{}, indexVM, func(o client.Object) []string {
		return []string{o.(*impv1.ImpVMSnapshot).Spec.VMName}
	}); err != nil {
		return fmt.Errorf("indexing ImpVMSnapshots by VM: %w", err)
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&impv1.ImpVMSnapshot{}).
		Named("impvmsnapshot").
		Watches(&impv1.ImpVM{}, handler.EnqueueRequestsFromMapFunc(r.forVM)).
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.forNode)).
		// A quota raised, a snapshot gone: the namespace's waiting snapshots may fit.
		Watches(&impv1.ImpQuota{}, handler.EnqueueRequestsFromMapFunc(r.waiting)).
		Watches(&impv1.ImpVMSnapshot{}, handler.EnqueueRequestsFromMapFunc(r.waiting)).
		// A recurring snapshot's snapshot Ready, failed or gone: its retention.
		Watches(&impv1.ImpVMSnapshot{}, handler.EnqueueRequestForOwner(mgr.GetScheme(), mgr.GetRESTMapper(), &impv1.ImpVMSnapshot{}, handler.OnlyControllerOwner())).
		Complete(r)
}

// forVM: the snapshots of the VM that wait for it.
func (r *Reconciler) forVM(ctx context.Context, o client.Object) []reconcile.Request {
	var list impv1.ImpVMSnapshotList
	// Read for their names only: the cache's objects, not copies (this runs on every VM event).
	if err := r.Client.List(ctx, &list, client.InNamespace(o.GetNamespace()), client.MatchingFields{indexVM: o.GetName()}, client.UnsafeDisableDeepCopy); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "listing the VM's snapshots")
		return nil
	}
	var out []reconcile.Request
	for i := range list.Items {
		if list.Items[i].Status.NodeName == "" {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
		}
	}
	return out
}

// waiting: the snapshots of o's namespace that no node was given yet.
func (r *Reconciler) waiting(ctx context.Context, o client.Object) []reconcile.Request {
	var list impv1.ImpVMSnapshotList
	if err := r.Client.List(ctx, &list, client.InNamespace(o.GetNamespace())); err != nil {
		return nil
	}
	var out []reconcile.Request
	for i := range list.Items {
		if s := &list.Items[i]; s.Status.NodeName == "" && s.DeletionTimestamp.IsZero() {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(s)})
		}
	}
	return out
}

// forNode: a deleted node's deleted snapshots, which nothing else lets go.
func (r *Reconciler) forNode(ctx context.Context, o client.Object) []reconcile.Request {
	var list impv1.ImpVMSnapshotList
	if err := r.Client.List(ctx, &list); err != nil {
		return nil
	}
	var out []reconcile.Request
	for i := range list.Items {
		if s := &list.Items[i]; s.Status.NodeName == o.GetName() && !s.DeletionTimestamp.IsZero() {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(s)})
		}
	}
	return out
}
