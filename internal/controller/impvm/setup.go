package impvm

import (
	"context"
	"fmt"
	"strings"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/workqueue"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/tracing"
)

// Field indexes of the operator's ImpVM cache. NodeIndex is shared with the operator's other
// reconcilers.
const (
	NodeIndex     = "status.nodeName"
	indexClass    = "spec.classRef.name"
	indexNetwork  = "spec.networkRef.name"
	indexUnplaced = "imp.dev/unplaced"
)

// SetupWithManager registers the reconciler, its indexes and watches with mgr.
func (r *Reconciler) SetupWithManager(ctx context.Context, mgr ctrl.Manager, concurrency int) error {
	idx := mgr.GetFieldIndexer()
	for name, fn := range map[string]func(*impv1.ImpVM) []string{
		NodeIndex: func(vm *impv1.ImpVM) []string { return nonEmpty(vm.Status.NodeName) },
		indexClass: func(vm *impv1.ImpVM) []string {
			if vm.Spec.ClassRef == nil {
				return nil
			}
			return []string{vm.Spec.ClassRef.Name}
		},
		indexNetwork: func(vm *impv1.ImpVM) []string {
			if vm.Spec.NetworkRef == nil {
				return nil
			}
			return []string{vm.Spec.NetworkRef.Name}
		},
		indexSnapshot: func(vm *impv1.ImpVM) []string {
			if vm.Spec.SnapshotRef == nil {
				return nil
			}
			return []string{vm.Spec.SnapshotRef.Name}
		},
		indexTemplate: func(vm *impv1.ImpVM) []string { return nonEmpty(vm.TemplateName()) },
		// A claim is indexed by its pool: a pool made or changed wakes its claims waiting.
		indexWarmPool: func(vm *impv1.ImpVM) []string {
			if vm.Spec.WarmPoolRef == nil {
				return nil
			}
			return []string{vm.Spec.WarmPoolRef.Name}
		},
		indexUnplaced: func(vm *impv1.ImpVM) []string {
			if vm.Status.NodeName == "" && !isTerminal(vm.Status.Phase) && vm.DeletionTimestamp.IsZero() {
				return []string{"true"}
			}
			return nil
		},
	} {
		if err := idx.IndexField(ctx, &impv1.ImpVM{}, name, func(o client.Object) []string { return fn(o.(*impv1.ImpVM)) }); err != nil {
			return fmt.Errorf("indexing ImpVMs by %s: %w", name, err)
		}
	}
	r.freed = make(chan event.GenericEvent, 1)
	if r.Options.Traces != nil {
		r.traces.tracer = r.Options.Traces.Tracer(tracing.OperatorScope)
	}

	delay := r.Options.StartingReportDelay
	return ctrl.NewControllerManagedBy(mgr).
		For(&impv1.ImpVM{}, builder.WithPredicates(predicate.Not(startingReport(delay)))).
		// An agent's Starting or booting report waits: what overtakes it is written instead.
		Watches(&impv1.ImpVM{}, enqueueAfter(delay), builder.WithPredicates(startingReport(delay))).
		Named("impvm").
		WithOptions(controller.Options{MaxConcurrentReconciles: concurrency}).
		// Every Node, report and heartbeat goes to placement's view of the fleet; those that
		// can change where VMs go, or whether their node is lost, enqueue them.
		Watches(&corev1.Node{}, recording(r.fleet.recordNode, nodeChanged(), r.forNode)).
		Watches(&impv1.ImpNode{}, recording(r.fleet.recordReport, reportChanged(r.Options.AgentHeartbeatTimeout), r.forNode)).
		// An agent's heartbeat that resumes after a silence: its node may take VMs again.
		Watches(&coordinationv1.Lease{}, recording(r.fleet.recordLease(r.runSecretNamespace()), beatResumed(r.Options.AgentHeartbeatTimeout), r.forLease)).
		Watches(&impv1.ImpVMClass{}, handler.EnqueueRequestsFromMapFunc(r.forClass)).
		// A suspension has its VM's name: the request is the VM's.
		Watches(&impv1.ImpVMSuspension{}, &handler.EnqueueRequestForObject{}).
		Watches(&impv1.ImpNetwork{}, handler.EnqueueRequestsFromMapFunc(r.forNetwork)).
		// A snapshot Ready: the VMs waiting to start from it.
		Watches(&impv1.ImpVMSnapshot{}, handler.EnqueueRequestsFromMapFunc(r.forSnapshot)).
		// A template's snapshot Ready: its copies waiting for one.
		Watches(&impv1.ImpVMTemplate{}, handler.EnqueueRequestsFromMapFunc(r.forTemplate)).
		// A warm pool made or changed: its claims waiting.
		Watches(&impv1.ImpWarmPool{}, handler.EnqueueRequestsFromMapFunc(r.forWarmPool)).
		// A quota raised or removed: the namespace's waiting VMs may fit; a suspension it
		// held back may go ahead.
		Watches(&impv1.ImpQuota{}, handler.EnqueueRequestsFromMapFunc(r.forQuota)).
		WatchesRawSource(source.Channel(r.freed, handler.EnqueueRequestsFromMapFunc(r.unplaced))).
		Complete(r)
}

func nonEmpty(s string) []string {
	if s == "" {
		return nil
	}
	return []string{s}
}

// forNode: the VMs on the node (it may be lost) and every unplaced VM (it may fit now).
func (r *Reconciler) forNode(ctx context.Context, o client.Object) []reconcile.Request {
	return append(r.list(ctx, false, client.MatchingFields{NodeIndex: o.GetName()}), r.unplaced(ctx, o)...)
}

// forLease: forNode of the node whose agent's heartbeat Lease it is.
func (r *Reconciler) forLease(ctx context.Context, o client.Object) []reconcile.Request {
	node, ok := leaseNode(o.(*coordinationv1.Lease))
	if !ok || o.GetNamespace() != r.runSecretNamespace() {
		return nil
	}
	return r.forNode(ctx, &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: node}})
}

// leaseNode is the node of an agent's heartbeat Lease.
func leaseNode(l *coordinationv1.Lease) (string, bool) {
	node, ok := strings.CutPrefix(l.Name, impv1.AgentLeasePrefix)
	if !ok || l.Labels[impv1.AgentLeaseLabel] == "" || l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != node {
		return "", false
	}
	return node, true
}

// beatResumed passes a heartbeat Lease's creation, and a renewal after a silence longer than
// silence; not the renewals of an agent that beats.
func beatResumed(silence time.Duration) predicate.Predicate {
	return predicate.Funcs{
		UpdateFunc: func(e event.UpdateEvent) bool {
			o, n := e.ObjectOld.(*coordinationv1.Lease).Spec.RenewTime, e.ObjectNew.(*coordinationv1.Lease).Spec.RenewTime
			return o == nil || (n != nil && n.Sub(o.Time) > silence)
		},
		DeleteFunc:  func(event.DeleteEvent) bool { return false },
		GenericFunc: func(event.GenericEvent) bool { return false },
	}
}

// forClass and forNetwork: only VMs still waiting for a node can be affected (a placed VM
// keeps the resources and address it was placed with). Network status changes with every
// address allocated: enqueueing its placed VMs too would make allocations quadratic.
func (r *Reconciler) forClass(ctx context.Context, o client.Object) []reconcile.Request {
	return r.list(ctx, true, client.MatchingFields{indexClass: o.GetName()})
}

func (r *Reconciler) forNetwork(ctx context.Context, o client.Object) []reconcile.Request {
	return r.list(ctx, true, client.InNamespace(o.GetNamespace()), client.MatchingFields{indexNetwork: o.GetName()})
}

// forQuota: every VM of the quota's namespace (quotas change rarely).
func (r *Reconciler) forQuota(ctx context.Context, o client.Object) []reconcile.Request {
	return r.list(ctx, false, client.InNamespace(o.GetNamespace()))
}

func (r *Reconciler) unplaced(ctx context.Context, _ client.Object) []reconcile.Request {
	return r.list(ctx, false, client.MatchingFields{indexUnplaced: "true"})
}

// list returns requests for the VMs opts select; with onlyUnplaced, for those without a node.
func (r *Reconciler) list(ctx context.Context, onlyUnplaced bool, opts ...client.ListOption) []reconcile.Request {
	var list impv1.ImpVMList
	// Read only for their names and nodes: the cache's own objects, not copies of every one
	// (a Lease's creation lists every unplaced VM).
	if err := r.Client.List(ctx, &list, append(opts, client.UnsafeDisableDeepCopy)...); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "listing VMs to reconcile")
		return nil
	}
	out := make([]reconcile.Request, 0, len(list.Items))
	for i := range list.Items {
		if onlyUnplaced && list.Items[i].Status.NodeName != "" {
			continue
		}
		out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
	}
	return out
}

// nodeChanged passes Node updates that can change placement: labels, taints, schedulability
// and condition statuses; heartbeats alone do not.
func nodeChanged() predicate.Predicate {
	return predicate.Funcs{UpdateFunc: func(e event.UpdateEvent) bool {
		o, n := e.ObjectOld.(*corev1.Node), e.ObjectNew.(*corev1.Node)
		return !equality.Semantic.DeepEqual(o.Labels, n.Labels) ||
			!equality.Semantic.DeepEqual(o.Spec.Taints, n.Spec.Taints) ||
			o.Spec.Unschedulable != n.Spec.Unschedulable ||
			!equality.Semantic.DeepEqual(conditionStatuses(o), conditionStatuses(n))
	}}
}

func conditionStatuses(n *corev1.Node) map[corev1.NodeConditionType]corev1.ConditionStatus {
	m := make(map[corev1.NodeConditionType]corev1.ConditionStatus, len(n.Status.Conditions))
	for _, c := range n.Status.Conditions {
		m[c.Type] = c.Status
	}
	return m
}

// reportChanged passes ImpNode updates other than heartbeats, and the heartbeat of an agent
// that had been silent for longer than silence: its node may take VMs again.
func reportChanged(silence time.Duration) predicate.Predicate {
	return predicate.Funcs{UpdateFunc: func(e event.UpdateEvent) bool {
		o, n := e.ObjectOld.(*impv1.ImpNode).Status.DeepCopy(), e.ObjectNew.(*impv1.ImpNode).Status.DeepCopy()
		if o.HeartbeatTime == nil || (n.HeartbeatTime != nil && n.HeartbeatTime.Sub(o.HeartbeatTime.Time) > silence) {
			return true
		}
		o.HeartbeatTime, n.HeartbeatTime = nil, nil
		for _, s := range []*impv1.ImpNodeStatus{o, n} {
			for i := range s.Conditions {
				s.Conditions[i].LastTransitionTime = metav1.Time{}
			}
		}
		return !equality.Semantic.DeepEqual(o, n)
	}}
}

// startingReport passes the updates that only bring an agent's report of a run starting, or
// of its guest booting (status.runtime and nothing else changed), when delay is not 0.
func startingReport(delay time.Duration) predicate.Predicate {
	return predicate.Funcs{
		CreateFunc:  func(event.CreateEvent) bool { return false },
		DeleteFunc:  func(event.DeleteEvent) bool { return false },
		GenericFunc: func(event.GenericEvent) bool { return false },
		UpdateFunc: func(e event.UpdateEvent) bool {
			o, n := e.ObjectOld.(*impv1.ImpVM), e.ObjectNew.(*impv1.ImpVM)
			rt := n.Status.Runtime
			if delay == 0 || rt == nil || !(rt.State == impv1.RuntimeStarting || rt.State == impv1.RuntimeRunning && !rt.GuestReady) {
				return false
			}
			if equality.Semantic.DeepEqual(o.Status.Runtime, rt) || o.Generation != n.Generation || !n.DeletionTimestamp.IsZero() ||
				!equality.Semantic.DeepEqual(o.Annotations, n.Annotations) || !equality.Semantic.DeepEqual(o.Labels, n.Labels) ||
				!equality.Semantic.DeepEqual(o.Finalizers, n.Finalizers) {
				return false
			}
			was, now := o.Status, n.Status
			was.Runtime, now.Runtime = nil, nil
			return equality.Semantic.DeepEqual(was, now)
		},
	}
}

// enqueueAfter enqueues the object's own request after delay.
func enqueueAfter(delay time.Duration) handler.EventHandler {
	return handler.Funcs{UpdateFunc: func(_ context.Context, e event.UpdateEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
		q.AddAfter(reconcile.Request{NamespacedName: client.ObjectKeyFromObject(e.ObjectNew)}, delay)
	}}
}
