// Package impnode assigns each ImpNode its block of endpoint addresses (spec.endpointCIDR), as
// Kubernetes' node IPAM assigns a Node its podCIDR: the lowest block of the cluster's endpoint
// range that no other ImpNode holds and no VM still has an address of, once, for the ImpNode's
// life. A node's agent gives each VM
// that declares ports an address of its block, and every node routes each block to its node.
package impnode

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Reconciler assigns endpoint blocks. It runs one reconcile at a time, so two nodes never get
// the same block from one operator; the operator is leader-elected.
type Reconciler struct {
	Client client.Client
	// Range is the cluster's endpoint range, BlockBits each node's block's prefix length.
	Range     netip.Prefix
	BlockBits int

	// assigned are the blocks this process assigned that the cache may not show yet, by node.
	mu       sync.Mutex
	assigned map[string]netip.Prefix
}

// +kubebuilder:rbac:groups=imp.dev,resources=impnodes,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=list;watch
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch

// Reconcile gives the ImpNode a block when it has none.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	node := &impv1.ImpNode{}
	if err := r.Client.Get(ctx, req.NamespacedName, node); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if node.Spec.EndpointCIDR != "" || !node.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil
	}
	// The ImpNodes from the cache, with the blocks this process assigned that it does not show
	// yet (one reconcile at a time, and the operator is leader-elected: no one else assigns).
	var all impv1.ImpNodeList
	if err := r.Client.List(ctx, &all); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing ImpNodes: %w", err)
	}
	all.Items = r.withAssigned(all.Items)
	for _, n := range all.Items {
		if n.Name == node.Name && n.Spec.EndpointCIDR != "" {
			return ctrl.Result{}, nil // assigned already, by this process: the cache is behind
		}
	}
	// The VMs that report an endpoint, from the cache: an address reported is old news by the
	// time its node comes back or another joins (listing every VM from the API server here, one
	// node at a time as a fleet joins, was a third of the operator's CPU while it placed VMs).
	var vms impv1.ImpVMList
	if err := r.Client.List(ctx, &vms, client.MatchingFields{indexEndpoint: "true"}); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing ImpVMs: %w", err)
	}
	var nodes corev1.NodeList
	if err := r.Client.List(ctx, &nodes); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing Nodes: %w", err)
	}
	present := map[string]bool{}
	for _, n := range nodes.Items {
		present[n.Name] = true
	}
	used := usedBlocks(all.Items, vms.Items, node.Name, present)
	block, ok := r.formerBlock(node.Name, vms.Items, used)
	var err error
	if !ok {
		block, err = FreeBlock(r.Range, r.BlockBits, used)
	}
	if err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "no endpoint block for the node", "node", klog.KObj(node))
		return ctrl.Result{RequeueAfter: time.Minute}, nil // a block frees when a node goes

	}
	patch := fmt.Appendf(nil, `{"spec":{"endpointCIDR":%q}}`, block)
	if err := r.Client.Patch(ctx, node, client.RawPatch(types.MergePatchType, patch)); err != nil {
		return ctrl.Result{}, fmt.Errorf("assigning %s to ImpNode %s: %w", block, node.Name, err)
	}
	r.mu.Lock()
	if r.assigned == nil {
		r.assigned = map[string]netip.Prefix{}
	}
	r.assigned[node.Name] = block
	r.mu.Unlock()
	ctrl.LoggerFrom(ctx).Info("assigned the node its endpoint block", "node", klog.KObj(node), "block", block)
	return ctrl.Result{}, nil
}

// withAssigned is the cached ImpNodes nodes with the blocks this process assigned that the
// cache does not show yet; an assignment the cache shows, or whose node is gone from it, is
// forgotten.
func (r *Reconciler) withAssigned(nodes []impv1.ImpNode) []impv1.ImpNode {
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := map[string]bool{}
	for i := range nodes {
		n := &nodes[i]
		seen[n.Name] = true
		block, ok := r.assigned[n.Name]
		switch {
		case !ok:
		case n.Spec.EndpointCIDR != "":
			delete(r.assigned, n.Name) // the cache has caught up (or another block stands)
		default:
			n.Spec.EndpointCIDR = block.String()
		}
	}
	for name := range r.assigned {
		if !seen[name] {
			delete(r.assigned, name)
		}
	}
	return nodes
}

// usedBlocks is what the node assigning may not be given: every ImpNode's block and the
// addresses VMs still report. A block is free only when no VM still reports an address of it
// either: the ImpNode of a node that left goes before its VMs do. But an agent writes its own
// VMs' endpoints, so a VM's address counts only where its node could have given it: in its
// node's block; on a node whose ImpNode has no block yet, which is being given one; on a node
// that left the cluster (no Node, no ImpNode: its VMs keep what they had until they go). A
// node's agent reporting addresses outside its block (a compromised node), or whose ImpNode is
// gone while its Node is not, holds no block from the nodes that join. The assigning node's
// own VMs' addresses are formerBlock's to weigh, not a reason to keep it from its old block.
func usedBlocks(nodes []impv1.ImpNode, vms []impv1.ImpVM, assigning string, present map[string]bool) map[netip.Prefix]bool {
	used := map[netip.Prefix]bool{}
	blocks := map[string]netip.Prefix{} // ImpNode → its block; the zero prefix for none yet
	for _, n := range nodes {
		p, err := netip.ParsePrefix(n.Spec.EndpointCIDR)
		if err == nil {
			used[p] = true
		}
		blocks[n.Name] = p
	}
	for _, vm := range vms {
		rt, on := vm.Status.Runtime, vm.Status.NodeName
		if rt == nil || on == assigning {
			continue
		}
		a, err := netip.ParseAddr(rt.Endpoint)
		if err != nil {
			continue
		}
		block, known := blocks[on]
		switch {
		case known && block.IsValid() && !block.Contains(a): // outside its node's block
			continue
		case !known && present[on]: // the ImpNode is gone, not the node
			continue
		}
		used[netip.PrefixFrom(a, a.BitLen())] = true
	}
	return used
}

// formerBlock is the block a node without one had before (it left and came back with VMs that
// still report addresses of it), when that block is free: the lowest such block of r's.
func (r *Reconciler) formerBlock(node string, vms []impv1.ImpVM, used map[netip.Prefix]bool) (netip.Prefix, bool) {
	var best netip.Prefix
	for _, vm := range vms {
		if rt := vm.Status.Runtime; rt == nil || vm.Status.NodeName != node {
			continue
		}
		a, err := netip.ParseAddr(vm.Status.Runtime.Endpoint)
		if err != nil || !a.Is4() || !r.Range.Contains(a) || r.BlockBits < r.Range.Bits() {
			continue
		}
		p := netip.PrefixFrom(a, r.BlockBits).Masked()
		if slices.ContainsFunc(slices.Collect(maps.Keys(used)), p.Overlaps) {
			continue // another node's, or another's VMs still in it
		}
		if !best.IsValid() || p.Addr().Less(best.Addr()) {
			best = p
		}
	}
	return best, best.IsValid()
}

// FreeBlock is the lowest block of bits in rng that used does not hold.
func FreeBlock(rng netip.Prefix, bits int, used map[netip.Prefix]bool) (netip.Prefix, error) {
	rng = rng.Masked()
	if bits < rng.Bits() || bits > 30 {
		return netip.Prefix{}, fmt.Errorf("blocks of /%d do not fit the endpoint range %s", bits, rng)
	}
	for a := rng.Addr(); rng.Contains(a); {
		p := netip.PrefixFrom(a, bits)
		free := true
		for u := range used {
			free = free && !u.Overlaps(p) // a block of another size (the settings changed) too
		}
		if free {
			return p, nil
		}
		next, ok := advance(a, 32-bits)
		if !ok {
			break
		}
		a = next
	}
	return netip.Prefix{}, fmt.Errorf("every /%d of the endpoint range %s is assigned", bits, rng)
}

// advance is a plus 2^shift, false past the end of the IPv4 space.
func advance(a netip.Addr, shift int) (netip.Addr, bool) {
	b := a.As4()
	v := uint64(b[0])<<24 | uint64(b[1])<<16 | uint64(b[2])<<8 | uint64(b[3])
	v += 1 << shift
	if v > 0xffffffff {
		return netip.Addr{}, false
	}
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}), true
}

// indexEndpoint indexes the ImpVMs that report an endpoint address ("true").
const indexEndpoint = "imp.dev/endpoint"

// SetupWithManager watches ImpNodes, one reconcile at a time, and indexes the VMs that report
// an endpoint.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if err := mgr.GetFieldIndexer().IndexField(context.Background(), &impv1.ImpVM{}, indexEndpoint, func(o client.Object) []string {
		if rt := o.(*impv1.ImpVM).Status.Runtime; rt != nil && rt.Endpoint != "" {
			return []string{"true"}
		}
		return nil
	}); err != nil {
		return fmt.Errorf("indexing ImpVMs by endpoint: %w", err)
	}
	return ctrl.NewControllerManagedBy(mgr).
		Named("impnode").
		For(&impv1.ImpNode{}).
		WithOptions(controller.Options{MaxConcurrentReconciles: 1}).
		Complete(r)
}
