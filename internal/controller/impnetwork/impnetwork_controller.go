// Package impnetwork is the operator's ImpNetwork reconciler: it assigns the network's overlay
// VNI, reports its gateway, how many addresses are allocated and free and whether every node
// with its VMs has plumbed it, and deletes address claims whose VM is gone.
package impnetwork

import (
	"context"
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impnetworks,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impnetworks/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impipaddresses,verbs=get;list;watch;delete
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impnodes,verbs=get;list;watch

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Forgetter drops what an allocator remembers of a network.
type Forgetter interface {
	Forget(types.NamespacedName)
}

// Reconciler reconciles ImpNetworks.
type Reconciler struct {
	Client    client.Client
	APIReader client.Reader // uncached: a claim is deleted only when the API confirms its VM is gone
	Recorder  EventRecorder
	IPAM      Forgetter
	// Reserved are ranges no network may overlap.
	Reserved []netip.Prefix

	vniMu sync.Mutex // one VNI assignment at a time
}

// Reconcile computes one network's status.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	net := &impv1.ImpNetwork{}
	if err := r.Client.Get(ctx, req.NamespacedName, net); err != nil {
		if apierrors.IsNotFound(err) {
			r.IPAM.Forget(req.NamespacedName)
		}
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if net.Status.ObservedGeneration != net.Generation {
		r.IPAM.Forget(req.NamespacedName) // the CIDR or gateway may have changed
	}
	orig := net.DeepCopy()

	var claims impv1.ImpIPAddressList
	if err := r.Client.List(ctx, &claims, client.InNamespace(net.Namespace), client.MatchingLabels{impv1.NetworkLabel: net.Name}); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing addresses: %w", err)
	}
	allocated := 0
	for i := range claims.Items {
		gone, err := r.deleteIfOrphaned(ctx, &claims.Items[i])
		if err != nil {
			return ctrl.Result{}, err
		}
		if !gone {
			allocated++
		}
	}

	st := &net.Status
	st.Allocated = int32(allocated)
	cond := metav1.Condition{Type: impv1.NetworkReadyCondition, ObservedGeneration: net.Generation}
	gw, gwErr := net.Spec.GatewayAddr()
	capacity, capErr := net.Spec.HostCapacity()
	reserved, overlaps := net.Spec.ReservedOverlap(r.Reserved)
	switch {
	case overlaps:
		st.Gateway, st.Free = "", 0
		cond.Status, cond.Reason = metav1.ConditionFalse, impv1.ReasonReservedCIDR
		cond.Message = fmt.Sprintf("cidr %s overlaps %s, which the cluster reserves (network.reservedCIDRs)", net.Spec.CIDR, reserved)
	case gwErr != nil:
		st.Gateway, st.Free = "", 0
		cond.Status, cond.Reason, cond.Message = metav1.ConditionFalse, impv1.ReasonInvalidGateway, gwErr.Error()
	case capErr != nil:
		st.Free = 0
		cond.Status, cond.Reason, cond.Message = metav1.ConditionFalse, impv1.ReasonInvalidGateway, capErr.Error()
	default:
		st.Gateway = gw.String()
		st.Free = int32(max(capacity-int64(allocated), 0))
		cond.Status, cond.Reason, cond.Message = metav1.ConditionTrue, impv1.ReasonNetworkValid, fmt.Sprintf("%d of %d addresses free", st.Free, capacity)
		if st.Free == 0 {
			cond.Status, cond.Reason = metav1.ConditionFalse, impv1.ReasonAddressesExhausted
		}
	}
	was := meta.FindStatusCondition(orig.Status.Conditions, impv1.NetworkReadyCondition)
	meta.SetStatusCondition(&st.Conditions, cond)
	if err := r.nodesReady(ctx, net); err != nil {
		return ctrl.Result{}, err
	}
	st.ObservedGeneration = net.Generation
	if cond.Status == metav1.ConditionFalse && (was == nil || was.Reason != cond.Reason) {
		r.Recorder.Eventf(net, nil, corev1.EventTypeWarning, cond.Reason, "Allocate", "%s", cond.Message)
	}
	if equality.Semantic.DeepEqual(orig.Status, net.Status) {
		return ctrl.Result{}, nil
	}
	if err := r.Client.Status().Patch(ctx, net, client.MergeFrom(orig)); err != nil && !apierrors.IsNotFound(err) {
		return ctrl.Result{}, fmt.Errorf("patching status: %w", err)
	}
	if st.VNI == 0 {
		return ctrl.Result{}, r.assignVNI(ctx, net)
	}
	return ctrl.Result{}, nil
}

// assignVNI gives the network a VXLAN network identifier no other network holds: a hash of its
// UID, or the next free one after it. It reads every network from the API server, not the
// cache, and assigns one at a time, so no two networks get the same.
func (r *Reconciler) assignVNI(ctx context.Context, net *impv1.ImpNetwork) error {
	r.vniMu.Lock()
	defer r.vniMu.Unlock()
	var all impv1.ImpNetworkList
	if err := r.APIReader.List(ctx, &all); err != nil {
		return fmt.Errorf("listing networks for a VNI: %w", err)
	}
	taken := map[int32]bool{}
	for _, n := range all.Items {
		if n.UID == net.UID {
			if n.Status.VNI != 0 {
				return nil // assigned already; the cache is behind
			}
			continue
		}
		taken[n.Status.VNI] = true
	}
	const span = 1<<24 - 1 // VNIs 1..2^24-1
	h := fnv.New32a()
	_, _ = h.Write([]byte(net.UID))
	vni := int32(h.Sum32()%span) + 1
	for taken[vni] {
		vni = vni%span + 1
	}
	patch := client.RawPatch(types.MergePatchType, []byte(fmt.Sprintf(`{"status":{"vni":%d}}`, vni)))
	if err := r.Client.Status().Patch(ctx, net, patch); err != nil {
		return client.IgnoreNotFound(err)
	}
	ctrl.LoggerFrom(ctx).Info("assigned the overlay VNI", "vni", vni)
	return nil
}

// nodesReady sets the NodesReady condition from what the nodes' agents report about the network.
func (r *Reconciler) nodesReady(ctx context.Context, net *impv1.ImpNetwork) error {
	var nodes impv1.ImpNodeList
	if err := r.Client.List(ctx, &nodes); err != nil {
		return fmt.Errorf("listing node reports: %w", err)
	}
	var ready, failed []string
	for _, node := range nodes.Items {
		for _, nn := range node.Status.Networks {
			if nn.Namespace != net.Namespace || nn.Name != net.Name {
				continue
			}
			if nn.Ready {
				ready = append(ready, node.Name)
			} else {
				failed = append(failed, node.Name+": "+nn.Message)
			}
		}
	}
	slices.Sort(failed)
	cond := metav1.Condition{Type: impv1.NetworkNodesReadyCondition, ObservedGeneration: net.Generation,
		Status: metav1.ConditionTrue, Reason: impv1.ReasonNodesReady, Message: fmt.Sprintf("plumbed on %d nodes", len(ready))}
	if len(failed) > 0 {
		cond.Status, cond.Reason = metav1.ConditionFalse, impv1.ReasonNodeNetworkFailed
		cond.Message = fmt.Sprintf("%d of %d nodes failed: %s", len(failed), len(failed)+len(ready), strings.Join(failed, "; "))
	}
	was := meta.FindStatusCondition(net.Status.Conditions, cond.Type)
	if cond.Status == metav1.ConditionFalse && (was == nil || was.Message != cond.Message) {
		r.Recorder.Eventf(net, nil, corev1.EventTypeWarning, cond.Reason, "Plumb", "%s", cond.Message)
	}
	meta.SetStatusCondition(&net.Status.Conditions, cond)
	return nil
}

// deleteIfOrphaned deletes a claim whose VM the API server says is gone. It is the backstop
// for a VM whose finalizer was removed by hand; normally the VM's deletion releases its claim.
func (r *Reconciler) deleteIfOrphaned(ctx context.Context, c *impv1.ImpIPAddress) (bool, error) {
	key := types.NamespacedName{Namespace: c.Namespace, Name: c.Spec.VMRef.Name}
	vm := &impv1.ImpVM{}
	if err := r.Client.Get(ctx, key, vm); err == nil && vm.UID == c.Spec.VMRef.UID {
		return false, nil // the cache knows the VM: no need to ask the API server
	}
	err := r.APIReader.Get(ctx, key, vm)
	switch {
	case err == nil && vm.UID == c.Spec.VMRef.UID:
		return false, nil
	case err != nil && !apierrors.IsNotFound(err):
		return false, fmt.Errorf("getting VM %s of address %s: %w", c.Spec.VMRef.Name, c.Spec.Address, err)
	}
	if err := r.Client.Delete(ctx, c, client.Preconditions{UID: &c.UID}); err != nil && !apierrors.IsNotFound(err) {
		return false, fmt.Errorf("deleting orphaned address %s: %w", c.Name, err)
	}
	ctrl.LoggerFrom(ctx).Info("deleted an address whose VM is gone", "address", c.Spec.Address, "vm", c.Spec.VMRef.Name)
	return true, nil
}

// SetupWithManager registers the reconciler with mgr.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&impv1.ImpNetwork{}).
		Named("impnetwork").
		Watches(&impv1.ImpIPAddress{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: o.(*impv1.ImpIPAddress).Spec.Network}}}
		})).
		// A node report names the networks it plumbs; one it stopped naming was in the old one.
		Watches(&impv1.ImpNode{}, handler.Funcs{
			CreateFunc: func(_ context.Context, e event.CreateEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
				enqueueNetworks(q, e.Object)
			},
			UpdateFunc: func(_ context.Context, e event.UpdateEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
				enqueueNetworks(q, e.ObjectOld, e.ObjectNew)
			},
			DeleteFunc: func(_ context.Context, e event.DeleteEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
				enqueueNetworks(q, e.Object)
			},
		}).
		Complete(r)
}

func enqueueNetworks(q workqueue.TypedRateLimitingInterface[reconcile.Request], nodes ...client.Object) {
	for _, o := range nodes {
		if node, ok := o.(*impv1.ImpNode); ok {
			for _, n := range node.Status.Networks {
				q.Add(reconcile.Request{NamespacedName: types.NamespacedName{Namespace: n.Namespace, Name: n.Name}})
			}
		}
	}
}
