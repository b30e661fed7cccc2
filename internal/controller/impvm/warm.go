package impvm

import (
	"context"
	"errors"
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/placement"
	"github.com/syscode-labs/imp/internal/warmpool"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impwarmpools,verbs=get;list;watch

// indexWarmPool indexes claims by the ImpWarmPool they name.
const indexWarmPool = "spec.warmPoolRef.name"

// WarmMembers is what the VM controller needs of the warm pool ledger (internal/warmpool).
type WarmMembers interface {
	// Take binds claim to an idle member of pool that accept accepts; the same member again
	// for a claim that holds one.
	Take(pool types.NamespacedName, claim warmpool.Claim, accept func(warmpool.Member) bool) (warmpool.Member, bool)
	// Claim is the claim bound to member, if any.
	Claim(member types.UID) (warmpool.Claim, bool)
	// Holds is true when claim is bound to a member.
	Holds(claim types.UID) bool
	// Nodes is where each member of pool is placed, as the cache has it.
	Nodes(pool types.NamespacedName) map[types.UID]string
	// Synced: the ledger has seen every VM of the operator's first list. Until then no claim
	// is bound (a binding it has not seen yet could be made twice).
	Synced() bool
}

var _ WarmMembers = (*warmpool.Ledger)(nil)

// warmPool gets the pool a claim names, in its namespace (another namespace's cannot be
// named). False, with the scope's reason set, while there is none.
func (r *Reconciler) warmPool(ctx context.Context, s *scope) (*impv1.ImpWarmPool, bool, error) {
	vm := s.vm
	pool := &impv1.ImpWarmPool{}
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: vm.Spec.WarmPoolRef.Name}, pool); err != nil {
		if apierrors.IsNotFound(err) {
			s.schedReason, s.schedMsg = impv1.ReasonWarmPoolNotFound, fmt.Sprintf("ImpWarmPool %q does not exist in namespace %s", vm.Spec.WarmPoolRef.Name, vm.Namespace)
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("getting ImpWarmPool %s: %w", vm.Spec.WarmPoolRef.Name, err)
	}
	if !pool.DeletionTimestamp.IsZero() {
		s.schedReason, s.schedMsg = impv1.ReasonWarmPoolNotFound, fmt.Sprintf("ImpWarmPool %s is being deleted", pool.Name)
		return nil, false, nil
	}
	s.pool = pool
	return pool, true, nil
}

// takeMember binds a claim to an idle member of its pool that it can become: on a node among
// nodes whose agent hands members over, that fits the claim's own selectors and tolerations,
// on the claim's network. The member's holding on its node becomes the claim's. Nil when
// there is none: the claim is restored.
func (r *Reconciler) takeMember(s *scope, req placement.Request, nodes []placement.Node) *warmpool.Member {
	vm, pool := s.vm, s.pool
	if r.Warm == nil || pool == nil || !r.Warm.Synced() {
		return nil
	}
	if vm.Status.Instance != 0 { // not after a failed handover, nor a lost node
		s.warmMsg = "a member is handed at a claim's first placement only: restored from its template"
		return nil
	}
	if _, placed := r.Ledger.NodeOf(vm.UID); placed && !r.Warm.Holds(vm.UID) {
		return nil // placed to be restored by a reconcile whose write did not land: the same decision
	}
	network := ""
	if vm.Spec.NetworkRef != nil {
		network = vm.Spec.NetworkRef.Name
	}
	if pool.Spec.NetworkRef != nil && pool.Spec.NetworkRef.Name != network {
		s.warmMsg = fmt.Sprintf("the members of ImpWarmPool %s are on ImpNetwork %s, the claim on %q: restored instead", pool.Name, pool.Spec.NetworkRef.Name, network)
		return nil
	}
	byName := make(map[string]placement.Node, len(nodes))
	for _, n := range nodes {
		byName[n.Node.Name] = n
	}
	fits := placement.Request{Labels: req.Labels, Tolerations: req.Tolerations}
	m, ok := r.Warm.Take(client.ObjectKeyFromObject(pool), warmpool.Claim{UID: vm.UID, Namespace: vm.Namespace, Name: vm.Name}, func(m warmpool.Member) bool {
		n, ok := byName[m.Node]
		if !ok || n.Report == nil || !n.Report.HasFeature(impv1.FeatureWarmHandover) || m.Network != network || m.Resources == nil || m.Template == nil {
			return false
		}
		if vm.SetsWorkload() && !m.Template.BeforeWorkload {
			return false // a member of an earlier revision, its workload running: not this claim's
		}
		ok, _ = placement.Fits(fits, n)
		return ok
	})
	if !ok {
		return nil
	}
	if _, held := r.Ledger.Hand(m.UID, vm.UID, vm.Name); !held {
		// The member holds nothing the ledger knows of (it cannot be: a member is placed).
		// Its own placement is counted for the claim, on its node.
		res := m.Resources
		h := placement.Holding{Node: m.Node, Namespace: vm.Namespace, VCPUs: int64(res.VCPUs), Memory: res.Memory.Value(), Disk: res.NodeDiskBytes(), VM: vm.Name}
		if res.MemoryOverhead != nil {
			h.Overhead = res.MemoryOverhead.Value()
		}
		r.Ledger.Hold(vm.UID, h)
	}
	return &m
}

// handoverFailed: the claim's node could not hand it the member it was bound to: it reported
// the placement's run WarmHandoverFailed. The claim leaves the node, to be placed again, restored
// (a member is handed at a first placement only); the member, bound for good, is its pool's to
// delete.
func (r *Reconciler) handoverFailed(s *scope) bool {
	vm := s.vm
	rt, w := vm.Status.Runtime, vm.Status.Warm
	if !vm.IsClaim() || w == nil || rt == nil || rt.Instance != vm.Status.Instance || rt.Reason != impv1.ReasonWarmHandoverFailed {
		return false
	}
	r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, impv1.ReasonWarmHandoverFailed, "Place", "Node %s could not hand member %s of ImpWarmPool %s to the VM (%s): placing it again, restored",
		vm.Status.NodeName, w.Member, w.Pool, rt.Message)
	vm.Status.NodeName, vm.Status.NextRestartAt, vm.Status.Warm = "", nil, nil
	r.Ledger.Release(vm.UID)
	r.signalFreed()
	return true
}

// warmNote is, for a claim placed to be restored, why it was not handed a member, for its
// placement's Event.
func (s *scope) warmNote() string {
	switch {
	case s.warmMsg != "":
		return "; " + s.warmMsg
	case s.pool != nil && s.vm.IsClaim():
		return "; no idle member of ImpWarmPool " + s.pool.Name + " it can become: restored from its template"
	}
	return ""
}

// giveBack returns a claim's holding to the member it was bound to, when the claim's placement
// could not be completed (no address): the member, bound for good, holds its node until its
// pool deletes it.
func (r *Reconciler) giveBack(vm *impv1.ImpVM, m *warmpool.Member) {
	r.Ledger.Hand(vm.UID, m.UID, m.Name)
	r.Ledger.Release(vm.UID)
}

// warmStatus records, in the claim's placement, the member it became: the member's resources
// and template as the member was placed with them (the guest is the member's).
func warmStatus(vm *impv1.ImpVM, pool *impv1.ImpWarmPool, m *warmpool.Member) {
	vm.Status.Resources = m.Resources.DeepCopy()
	vm.Status.Resources.Claims = nil
	vm.Status.Template = m.Template.DeepCopy()
	if vm.Status.Template.Name == "" { // a member placed before templates were named
		vm.Status.Template.Name = pool.Spec.TemplateRef.Name
	}
	vm.Status.Start = impv1.StartWarm
	vm.Status.Warm = &impv1.WarmStatus{Pool: pool.Name, Member: m.Name, MemberUID: string(m.UID)}
}

// startOf is how a VM placed otherwise than warm starts.
func startOf(vm *impv1.ImpVM) impv1.VMStart {
	if vm.Spec.SnapshotRef != nil || vm.IsCopy() {
		return impv1.StartRestored
	}
	return impv1.StartBooted
}

// boundMember is true for a warm pool member bound to a claim: what it held on its node is
// the claim's.
func (r *Reconciler) boundMember(vm *impv1.ImpVM) bool {
	if r.Warm == nil || impv1.WarmPoolOf(vm) == "" {
		return false
	}
	_, bound := r.Warm.Claim(vm.UID)
	return bound
}

// place places the VM among nodes. A warm pool's member whose pool spreads over nodes goes to a
// node holding fewest of the pool's members among those with room: nodes are tried by how many
// the pool has there, fewest first.
func (r *Reconciler) place(ctx context.Context, s *scope, req placement.Request, nodes []placement.Node) (string, error) {
	vm := s.vm
	groups := [][]placement.Node{nodes}
	if name := impv1.WarmPoolOf(vm); name != "" {
		groups = r.spread(ctx, vm, name, nodes)
	}
	var node string
	var err error
	for _, g := range groups {
		node, err = r.Ledger.Place(vm.UID, req, g)
		var unsched *placement.Unschedulable
		if !errors.As(err, &unsched) {
			break
		}
	}
	return node, err
}

// spread groups nodes by how many members of the pool each holds (placed, or decided and not
// yet written, not being deleted), fewest first; one group of all when the pool does not spread
// (or cannot be read).
func (r *Reconciler) spread(ctx context.Context, vm *impv1.ImpVM, pool string, nodes []placement.Node) [][]placement.Node {
	p := &impv1.ImpWarmPool{}
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: pool}, p); err != nil || p.Spec.Spread == impv1.WarmPoolSpreadNone || r.Warm == nil {
		return [][]placement.Node{nodes}
	}
	held := map[string]int{}
	for uid, node := range r.Warm.Nodes(client.ObjectKeyFromObject(p)) {
		if uid == vm.UID {
			continue
		}
		if node == "" { // placed by a reconcile whose write the cache has not seen yet
			node, _ = r.Ledger.NodeOf(uid)
		}
		if node != "" {
			held[node]++
		}
	}
	byCount := map[int][]placement.Node{}
	var counts []int
	for _, n := range nodes {
		c := held[n.Node.Name]
		if _, ok := byCount[c]; !ok {
			counts = append(counts, c)
		}
		byCount[c] = append(byCount[c], n)
	}
	slices.Sort(counts)
	out := make([][]placement.Node, 0, len(counts))
	for _, c := range counts {
		out = append(out, byCount[c])
	}
	return out
}

// forWarmPool: the claims of the pool that wait for a placement.
func (r *Reconciler) forWarmPool(ctx context.Context, o client.Object) []reconcile.Request {
	return r.list(ctx, true, client.InNamespace(o.GetNamespace()), client.MatchingFields{indexWarmPool: o.GetName()})
}

// claimsOfTemplate: the claims waiting for a placement whose pool makes copies of the template.
func (r *Reconciler) claimsOfTemplate(ctx context.Context, o client.Object) []reconcile.Request {
	var pools impv1.ImpWarmPoolList
	if err := r.Client.List(ctx, &pools, client.InNamespace(o.GetNamespace()), client.UnsafeDisableDeepCopy); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "listing the warm pools of a template's namespace")
		return nil
	}
	var out []reconcile.Request
	for i := range pools.Items {
		if pools.Items[i].Spec.TemplateRef.Name == o.GetName() {
			out = append(out, r.forWarmPool(ctx, &pools.Items[i])...)
		}
	}
	return out
}

// boundInList are the members the claims of list are bound to (status.warm): the ledger's
// first load counts what they held as their claims'.
func boundInList(list *impv1.ImpVMList) map[types.UID]bool {
	out := map[types.UID]bool{}
	for i := range list.Items {
		if w := list.Items[i].Status.Warm; list.Items[i].IsClaim() && w != nil {
			out[types.UID(w.MemberUID)] = true
		}
	}
	return out
}
