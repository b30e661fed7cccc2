// Package warmpool is the operator's memory of warm pools' members and of the claims they are
// bound to: which members are idle, and which claim holds which member. A member is handed to
// at most one claim, ever: the binding is recorded here the moment it is decided, before the
// API write that commits it (so that concurrent claims, and a cache that has not seen the
// write yet, never get the same member), and it is rebuilt from the claims' status.warm when
// the operator starts. A member once bound is never idle again, whatever its labels say later:
// it is consumed, handed over or deleted.
package warmpool

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Metrics; docs/metrics.md documents them.
var (
	claimsServed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imp_warmpool_claims_total",
		Help: "Claims (ImpVMs with spec.warmPoolRef) placed, by namespace, pool and how they start: warm (handed an idle member) or restored.",
	}, []string{"namespace", "pool", "start"})
	claimPlacement = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "imp_warmpool_claim_placement_seconds",
		Help:    "Time from the operator's first sight of a claim to its placement (bound to a member, or placed to be restored), by start.",
		Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
	}, []string{"start"})
)

func init() { metrics.Registry.MustRegister(claimsServed, claimPlacement) }

// Member is an idle member as the ledger knows it.
type Member struct {
	UID       types.UID
	Name      string
	Node      string
	Network   string // the member's ImpNetwork, "" for none
	Revision  string // of the pool's template
	Resources *impv1.ResolvedResources
	Template  *impv1.TemplateStatus
	Instance  int64
}

// Claim names a claim bound to a member.
type Claim struct {
	UID             types.UID
	Namespace, Name string
}

type member struct {
	Member
	pool types.NamespacedName
	idle bool
}

// Ledger is safe for concurrent use. Feed it every ImpVM the operator's cache sees (Observe)
// and every deletion (Forget).
type Ledger struct {
	mu      sync.Mutex
	members map[types.UID]*member                       // live members, by UID
	byPool  map[types.NamespacedName]map[types.UID]bool // pool → its live members
	holder  map[types.UID]Claim                         // member → the claim bound to it
	held    map[types.UID]types.UID                     // claim → its member
	retired map[types.UID]bool                          // members their pool is removing
	synced  func() bool                                 // the informer's first list was observed
	seen    map[types.UID]time.Time                     // unplaced claims: when the watch first showed them
	now     func() time.Time
}

// NewLedger returns an empty ledger.
func NewLedger() *Ledger {
	return &Ledger{members: map[types.UID]*member{}, byPool: map[types.NamespacedName]map[types.UID]bool{},
		holder: map[types.UID]Claim{}, held: map[types.UID]types.UID{}, retired: map[types.UID]bool{},
		seen: map[types.UID]time.Time{}, now: time.Now}
}

// Watch feeds the ledger from the cache's ImpVM informer: every VM added or changed is
// observed, every VM deleted forgotten.
func (l *Ledger) Watch(ctx context.Context, c cache.Cache) error {
	inf, err := c.GetInformer(ctx, &impv1.ImpVM{})
	if err != nil {
		return fmt.Errorf("getting the ImpVM informer for the warm pool ledger: %w", err)
	}
	l.mu.Lock()
	l.synced = func() bool { return false } // until the handler is registered and has seen the first list
	l.mu.Unlock()
	reg, err := inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc: func(o any) {
			if vm, ok := o.(*impv1.ImpVM); ok {
				l.Observe(vm)
				l.claimSeen(vm)
			}
		},
		UpdateFunc: func(old, o any) {
			if vm, ok := o.(*impv1.ImpVM); ok {
				l.Observe(vm)
				if was, ok := old.(*impv1.ImpVM); ok {
					l.claimPlaced(was, vm)
				}
			}
		},
		DeleteFunc: func(o any) {
			if d, ok := o.(toolscache.DeletedFinalStateUnknown); ok {
				o = d.Obj
			}
			if vm, ok := o.(*impv1.ImpVM); ok {
				l.Forget(vm)
			}
		},
	})
	if err != nil {
		return fmt.Errorf("watching ImpVMs for the warm pool ledger: %w", err)
	}
	l.mu.Lock()
	l.synced = reg.HasSynced
	l.mu.Unlock()
	return nil
}

// claimSeen notes when the watch first showed an unplaced claim.
func (l *Ledger) claimSeen(vm *impv1.ImpVM) {
	if !vm.IsClaim() || vm.Status.NodeName != "" {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.seen[vm.UID]; !ok {
		l.seen[vm.UID] = l.now()
	}
}

// claimPlaced counts a claim's placement, once: the watch shows each change of the API's
// object once (a reconcile that placed it again from a stale cache wrote nothing new).
func (l *Ledger) claimPlaced(was, vm *impv1.ImpVM) {
	if !vm.IsClaim() || was.Status.NodeName != "" || vm.Status.NodeName == "" {
		return
	}
	l.mu.Lock()
	since, ok := l.seen[vm.UID]
	delete(l.seen, vm.UID)
	now := l.now()
	l.mu.Unlock()
	if !ok {
		since = vm.CreationTimestamp.Time
	}
	start := string(vm.Status.Start)
	claimsServed.WithLabelValues(vm.Namespace, vm.Spec.WarmPoolRef.Name, start).Inc()
	claimPlacement.WithLabelValues(start).Observe(now.Sub(since).Seconds())
}

// Synced is true once the ledger observed every VM of its informer's first list (and for a
// ledger fed by hand).
func (l *Ledger) Synced() bool {
	l.mu.Lock()
	synced := l.synced
	l.mu.Unlock()
	return synced == nil || synced()
}

// Idle is true for a member that can be handed out as it is: placed, its current run running
// with its guest ready, not suspended, not being deleted.
func Idle(vm *impv1.ImpVM) bool {
	rt := vm.Status.Runtime
	return vm.DeletionTimestamp.IsZero() && vm.Status.NodeName != "" && vm.Status.Phase == impv1.VMRunning &&
		vm.Status.Suspension == nil && rt != nil && rt.Instance == vm.Status.Instance && rt.State == impv1.RuntimeRunning && rt.GuestReady
}

// Observe records what vm says: a claim's binding (status.warm), a member's state.
func (l *Ledger) Observe(vm *impv1.ImpVM) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if w := vm.Status.Warm; vm.IsClaim() && w != nil && w.MemberUID != "" {
		l.bind(types.UID(w.MemberUID), Claim{UID: vm.UID, Namespace: vm.Namespace, Name: vm.Name})
	}
	pool := impv1.WarmPoolOf(vm)
	if pool == "" || !vm.DeletionTimestamp.IsZero() {
		l.drop(vm.UID)
		return
	}
	key := types.NamespacedName{Namespace: vm.Namespace, Name: pool}
	if m, ok := l.members[vm.UID]; ok && m.pool != key {
		l.drop(vm.UID) // relabelled to another pool: it is that pool's now (unless bound)
	}
	m := &member{pool: key, idle: Idle(vm), Member: Member{UID: vm.UID, Name: vm.Name, Node: vm.Status.NodeName,
		Revision: vm.Labels[impv1.WarmPoolRevisionLabel], Resources: vm.Status.Resources, Template: vm.Status.Template, Instance: vm.Status.Instance}}
	if vm.Spec.NetworkRef != nil {
		m.Network = vm.Spec.NetworkRef.Name
	}
	l.members[vm.UID] = m
	if l.byPool[key] == nil {
		l.byPool[key] = map[types.UID]bool{}
	}
	l.byPool[key][vm.UID] = true
}

// Forget is vm's deletion: a member gone is forgotten with its binding; a claim gone leaves
// its member consumed (its pool deletes it).
func (l *Ledger) Forget(vm *impv1.ImpVM) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.drop(vm.UID)
	if c, ok := l.holder[vm.UID]; ok {
		delete(l.holder, vm.UID)
		if l.held[c.UID] == vm.UID {
			delete(l.held, c.UID)
		}
	}
	delete(l.retired, vm.UID)
	delete(l.held, vm.UID)
	delete(l.seen, vm.UID)
}

func (l *Ledger) drop(uid types.UID) {
	if m, ok := l.members[uid]; ok {
		delete(l.byPool[m.pool], uid)
		if len(l.byPool[m.pool]) == 0 {
			delete(l.byPool, m.pool)
		}
		delete(l.members, uid)
	}
}

// boundTo is the claim bound to a member. A binding of a claim of another namespace than the
// member's counts for nothing (a claim's status names a member by UID alone): a claim takes
// members of its own namespace's pools only.
func (l *Ledger) boundTo(memberUID types.UID) (Claim, bool) {
	c, ok := l.holder[memberUID]
	if m, known := l.members[memberUID]; ok && known && m.pool.Namespace != c.Namespace {
		return Claim{}, false
	}
	return c, ok
}

func (l *Ledger) bind(memberUID types.UID, claim Claim) bool {
	if c, ok := l.boundTo(memberUID); ok && c.UID != claim.UID {
		return false
	}
	if old, ok := l.holder[memberUID]; ok && old.UID != claim.UID && l.held[old.UID] == memberUID {
		delete(l.held, old.UID) // a binding that counted for nothing
	}
	l.holder[memberUID] = claim
	l.held[claim.UID] = memberUID
	return true
}

// Take binds claim to an idle member of pool that accept accepts, and returns it; false when
// there is none. A claim that holds a member already gets that one again (a retried write);
// a member is bound to one claim only, for good.
func (l *Ledger) Take(pool types.NamespacedName, claim Claim, accept func(Member) bool) (Member, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if uid, ok := l.held[claim.UID]; ok {
		if m, ok := l.members[uid]; ok {
			return m.Member, true
		}
		return Member{}, false // bound to a member that is gone: the claim's status says so
	}
	uids := make([]types.UID, 0, len(l.byPool[pool]))
	for uid := range l.byPool[pool] {
		uids = append(uids, uid)
	}
	sort.Slice(uids, func(i, j int) bool { return uids[i] < uids[j] })
	for _, uid := range uids {
		m := l.members[uid]
		if !m.idle || l.retired[uid] {
			continue
		}
		if _, bound := l.boundTo(uid); bound || !accept(m.Member) {
			continue
		}
		l.bind(uid, claim)
		return m.Member, true
	}
	return Member{}, false
}

// Holds is true when claim is bound to a member.
func (l *Ledger) Holds(claim types.UID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.held[claim]
	return ok
}

// Retire takes member out of the idle ones for good, unless a claim is bound to it: its pool
// deletes it. False when a claim holds it.
func (l *Ledger) Retire(memberUID types.UID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, bound := l.boundTo(memberUID); bound {
		return false
	}
	l.retired[memberUID] = true
	return true
}

// Claim is the claim bound to member, if any.
func (l *Ledger) Claim(memberUID types.UID) (Claim, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.boundTo(memberUID)
	return c, ok
}

// Nodes is, for each member of pool (bound or not, not being deleted), the node it is placed on
// as the cache has it ("" while it is not, or the cache has not seen its placement yet).
func (l *Ledger) Nodes(pool types.NamespacedName) map[types.UID]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[types.UID]string, len(l.byPool[pool]))
	for uid := range l.byPool[pool] {
		out[uid] = l.members[uid].Node
	}
	return out
}

// Idle is the number of pool's members that can be handed out now.
func (l *Ledger) Idle(pool types.NamespacedName) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for uid := range l.byPool[pool] {
		if _, bound := l.boundTo(uid); l.members[uid].idle && !bound && !l.retired[uid] {
			n++
		}
	}
	return n
}
