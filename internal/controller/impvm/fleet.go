package impvm

import (
	"context"
	"strings"
	"sync"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/workqueue"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/placement"
)

// fleet is placement's view of the nodes: each Node, its agent's report and the last renewal
// of its agent's heartbeat Lease, kept by the reconciler's watches as their events arrive.
// Placing a VM reads it, where it used to list every Node, ImpNode and Lease from the cache:
// three lists, each copying every object, per placement, which at 1,000 nodes took most of
// the operator's CPU (make bench-controlplane, profiled).
//
// Each watch records its event before it enqueues the VMs the event concerns, so a reconcile
// that an event causes sees that event. The objects are the cache's own: never modified.
type fleet struct {
	mu     sync.RWMutex
	byName map[string]*fleetEntry
	// list is the entries that have a Node, made again when one comes or goes: placing a VM
	// walks it, with no lookup per node.
	list []*fleetEntry
}

// fleetEntry is one node's: its Node, its agent's report and its Lease's last renewal, each
// nil when there is none.
type fleetEntry struct {
	node    *corev1.Node
	report  *impv1.ImpNode
	renewed *metav1.MicroTime
}

// update changes node's entry with set under the write lock, then drops an entry left empty
// and makes the list again when the entry gained or lost its Node.
func (f *fleet) update(node string, set func(e *fleetEntry)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.byName == nil {
		f.byName = map[string]*fleetEntry{}
	}
	e := f.byName[node]
	if e == nil {
		e = &fleetEntry{}
		f.byName[node] = e
	}
	had := e.node != nil
	set(e)
	if e.node == nil && e.report == nil && e.renewed == nil {
		delete(f.byName, node)
	}
	if had != (e.node != nil) {
		f.list = f.list[:0:0]
		for _, e := range f.byName {
			if e.node != nil {
				f.list = append(f.list, e)
			}
		}
	}
}

func (f *fleet) recordNode(o client.Object, gone bool) {
	if n, ok := o.(*corev1.Node); ok {
		f.update(n.Name, func(e *fleetEntry) { e.node = unlessGone(n, gone) })
	}
}

func (f *fleet) recordReport(o client.Object, gone bool) {
	if r, ok := o.(*impv1.ImpNode); ok {
		f.update(r.Name, func(e *fleetEntry) { e.report = unlessGone(r, gone) })
	}
}

// unlessGone is v, or nil when gone.
func unlessGone[V any](v *V, gone bool) *V {
	if gone {
		return nil
	}
	return v
}

// recordLease keeps the renewal of a node's heartbeat Lease in namespace ns.
func (f *fleet) recordLease(ns string) func(client.Object, bool) {
	return func(o client.Object, gone bool) {
		l, ok := o.(*coordinationv1.Lease)
		if !ok || l.Namespace != ns {
			return
		}
		node, ok := leaseNode(l)
		if !ok { // no longer a heartbeat (its holder or label changed): its renewals do not count
			if node, ok = strings.CutPrefix(l.Name, impv1.AgentLeasePrefix); !ok {
				return
			}
			gone = true
		}
		f.update(node, func(e *fleetEntry) { e.renewed = unlessGone(l.Spec.RenewTime, gone) })
	}
}

// each calls fn for every node, with its report (nil when it has none) and its Lease's last
// renewal (nil when none), under the fleet's read lock.
func (f *fleet) each(fn func(n *corev1.Node, report *impv1.ImpNode, renewed *metav1.MicroTime)) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	for _, e := range f.list {
		fn(e.node, e.report, e.renewed)
	}
}

// agent is node's agent report (nil when it has none) and its Lease's last renewal.
func (f *fleet) agent(node string) (*impv1.ImpNode, *metav1.MicroTime) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if e := f.byName[node]; e != nil {
		return e.report, e.renewed
	}
	return nil, nil
}

// len is the number of nodes.
func (f *fleet) len() int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return len(f.list)
}

// candidates lists every node with its agent's report, and whether that agent went silent.
func (r *Reconciler) candidates() []placement.Node {
	now := r.Clock.Now()
	out := make([]placement.Node, 0, r.fleet.len())
	r.fleet.each(func(n *corev1.Node, report *impv1.ImpNode, renewed *metav1.MicroTime) {
		c := placement.Node{Node: n, Report: report}
		if report != nil {
			beat := lastBeat(renewed, report.Status.HeartbeatTime)
			c.AgentSilent = r.beats.silentFor(n.Name, beat, now) > r.Options.AgentHeartbeatTimeout
		}
		out = append(out, c)
	})
	return out
}

// recording is a watch's handler: each event's object goes to record (gone: deleted) before
// the requests fn maps it to are enqueued, for the events p passes.
func recording(record func(o client.Object, gone bool), p predicate.Predicate, fn handler.MapFunc) handler.EventHandler {
	enqueue := handler.EnqueueRequestsFromMapFunc(fn)
	type queue = workqueue.TypedRateLimitingInterface[reconcile.Request]
	return handler.Funcs{
		CreateFunc: func(ctx context.Context, e event.CreateEvent, q queue) {
			record(e.Object, false)
			if p.Create(e) {
				enqueue.Create(ctx, e, q)
			}
		},
		UpdateFunc: func(ctx context.Context, e event.UpdateEvent, q queue) {
			record(e.ObjectNew, false)
			if p.Update(e) {
				enqueue.Update(ctx, e, q)
			}
		},
		DeleteFunc: func(ctx context.Context, e event.DeleteEvent, q queue) {
			record(e.Object, true)
			if p.Delete(e) {
				enqueue.Delete(ctx, e, q)
			}
		},
		GenericFunc: func(ctx context.Context, e event.GenericEvent, q queue) {
			if p.Generic(e) {
				enqueue.Generic(ctx, e, q)
			}
		},
	}
}
