package nodenet

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
)

// Blocks routes the other nodes' endpoint blocks (ImpNode spec.endpointCIDR) via their
// addresses (status.overlayAddress, the node's underlay address), so that this node and its
// pods reach VMs of every node at their endpoint addresses, as a CNI routes the pod CIDRs of
// other nodes. A node without an overlay address gets no route: its VMs are reachable from its
// own node only.
type Blocks struct {
	Client   client.Client
	NodeName string
	Net      *hostnet.Host
}

// Reconcile makes the routes match every ImpNode, whichever changed.
func (b Blocks) Reconcile(ctx context.Context, _ ctrl.Request) (ctrl.Result, error) {
	var nodes impv1.ImpNodeList
	if err := b.Client.List(ctx, &nodes); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing ImpNodes: %w", err)
	}
	want := map[netip.Prefix]netip.Addr{}
	for _, n := range nodes.Items {
		if n.Name == b.NodeName || !n.DeletionTimestamp.IsZero() {
			continue
		}
		p, perr := netip.ParsePrefix(n.Spec.EndpointCIDR)
		via, aerr := netip.ParseAddr(n.Status.OverlayAddress)
		if perr != nil || aerr != nil || !via.Is4() {
			continue
		}
		want[p.Masked()] = via
	}
	failed, err := b.Net.SyncBlocks(want)
	if err != nil {
		return ctrl.Result{}, err
	}
	for p, err := range failed {
		ctrl.LoggerFrom(ctx).Error(err, "the node's VMs in this endpoint block are not reachable from here", "block", p)
	}
	return ctrl.Result{RequeueAfter: time.Minute}, nil // heals routes someone removed
}

// SetupWithManager has mgr keep the routes.
func (b Blocks) SetupWithManager(mgr ctrl.Manager) error {
	changed := predicate.Funcs{
		UpdateFunc: func(e event.UpdateEvent) bool {
			o, n := e.ObjectOld.(*impv1.ImpNode), e.ObjectNew.(*impv1.ImpNode)
			return o.Spec.EndpointCIDR != n.Spec.EndpointCIDR || o.Status.OverlayAddress != n.Status.OverlayAddress
		},
	}
	// Every ImpNode's change asks for the one sync of all of them: one key, so a burst of
	// changes (or the minute's heal) is one sync, not one per node.
	all := handler.EnqueueRequestsFromMapFunc(func(context.Context, client.Object) []reconcile.Request {
		return []reconcile.Request{{NamespacedName: types.NamespacedName{Name: "endpoint-blocks"}}}
	})
	return ctrl.NewControllerManagedBy(mgr).Named("endpoint-blocks").
		Watches(&impv1.ImpNode{}, all, builder.WithPredicates(changed)).
		Complete(b)
}
