package warmpool_test

import (
	"fmt"
	"sync"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/warmpool"
)

var pool = types.NamespacedName{Namespace: "ns", Name: "p"}

// member is an idle member of pool p, as its pool makes it.
func member(i int) *impv1.ImpVM {
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: fmt.Sprintf("p-%d", i), UID: types.UID(fmt.Sprintf("m%03d", i)),
		Labels:          map[string]string{impv1.WarmPoolLabel: "p"},
		OwnerReferences: []metav1.OwnerReference{{APIVersion: impv1.GroupVersion.String(), Kind: "ImpWarmPool", Name: "p", UID: "pool", Controller: ptr.To(true)}}}}
	vm.Status = impv1.ImpVMStatus{NodeName: "n1", Phase: impv1.VMRunning, Instance: 1,
		Runtime: &impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeRunning, GuestReady: true}}
	return vm
}

func anyMember(warmpool.Member) bool { return true }

func TestConcurrentClaimsNeverShareAMember(t *testing.T) {
	l := warmpool.NewLedger()
	for i := range 50 {
		l.Observe(member(i))
	}
	var mu sync.Mutex
	got := map[types.UID]warmpool.Claim{}
	var wg sync.WaitGroup
	for c := range 60 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			claim := warmpool.Claim{UID: types.UID(fmt.Sprintf("c%d", c)), Namespace: "ns"}
			m, ok := l.Take(pool, claim, anyMember)
			if !ok {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if other, dup := got[m.UID]; dup {
				t.Errorf("member %s handed to %s and %s", m.Name, other, claim)
			}
			got[m.UID] = claim
		}()
	}
	wg.Wait()
	if len(got) != 50 {
		t.Errorf("%d members handed out, want 50", len(got))
	}
	if n := l.Idle(pool); n != 0 {
		t.Errorf("%d idle after every member was taken", n)
	}
}

func TestATakeIsRepeatedForItsClaim(t *testing.T) {
	l := warmpool.NewLedger()
	l.Observe(member(1))
	l.Observe(member(2))
	a, _ := l.Take(pool, warmpool.Claim{UID: "c", Namespace: "ns"}, anyMember)
	b, ok := l.Take(pool, warmpool.Claim{UID: "c", Namespace: "ns"}, anyMember)
	if !ok || a.UID != b.UID {
		t.Fatalf("the claim's retry got %v, want %v again", b, a)
	}
}

// The binding outlives the claim and every later change of the member's labels: a member once
// bound is never idle again, and a restart rebuilds it from the claim's status.
func TestABoundMemberIsNeverIdleAgain(t *testing.T) {
	l := warmpool.NewLedger()
	m := member(1)
	l.Observe(m)
	claim := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c", UID: "c"}, Spec: impv1.ImpVMSpec{WarmPoolRef: &impv1.WarmPoolReference{Name: "p"}}}
	if _, ok := l.Take(pool, warmpool.Claim{UID: claim.UID, Namespace: claim.Namespace, Name: claim.Name}, anyMember); !ok {
		t.Fatal("no member taken")
	}
	l.Forget(claim) // the claim deleted before the handover
	relabelled := m.DeepCopy()
	relabelled.Labels[impv1.WarmPoolLabel] = "q"
	relabelled.OwnerReferences[0].Name = "q"
	l.Observe(relabelled)
	l.Observe(m)
	if _, ok := l.Take(pool, warmpool.Claim{UID: "other", Namespace: "ns"}, anyMember); ok {
		t.Error("a consumed member was handed out again")
	}
	if l.Retire(m.UID) {
		t.Error("a bound member was retired as if idle")
	}

	// After a restart: the claim's status is all there is.
	l = warmpool.NewLedger()
	claim.Status.Warm = &impv1.WarmStatus{Pool: "p", Member: m.Name, MemberUID: string(m.UID)}
	l.Observe(m)
	l.Observe(claim)
	if _, ok := l.Take(pool, warmpool.Claim{UID: "other", Namespace: "ns"}, anyMember); ok {
		t.Error("after a restart, a member bound in a claim's status was handed out again")
	}
}

func TestOnlyIdleMembersOfThePoolAreTaken(t *testing.T) {
	for name, change := range map[string]func(*impv1.ImpVM){
		"not ready":            func(vm *impv1.ImpVM) { vm.Status.Runtime.GuestReady = false },
		"stale report":         func(vm *impv1.ImpVM) { vm.Status.Instance = 2 },
		"being deleted":        func(vm *impv1.ImpVM) { vm.DeletionTimestamp = ptr.To(metav1.Now()) },
		"label without owner":  func(vm *impv1.ImpVM) { vm.OwnerReferences = nil },
		"owner not controller": func(vm *impv1.ImpVM) { vm.OwnerReferences[0].Controller = nil },
		"another kind's":       func(vm *impv1.ImpVM) { vm.OwnerReferences[0].Kind = "ImpVMPool" },
		"suspended":            func(vm *impv1.ImpVM) { vm.Status.Suspension = &impv1.SuspensionStatus{} },
	} {
		t.Run(name, func(t *testing.T) {
			l := warmpool.NewLedger()
			m := member(1)
			change(m)
			l.Observe(m)
			if _, ok := l.Take(pool, warmpool.Claim{UID: "c", Namespace: "ns"}, anyMember); ok {
				t.Error("taken")
			}
		})
	}
	l := warmpool.NewLedger()
	l.Observe(member(1))
	if _, ok := l.Take(types.NamespacedName{Namespace: "other", Name: "p"}, warmpool.Claim{UID: "c", Namespace: "ns"}, anyMember); ok {
		t.Error("a member of a pool of the same name in another namespace was taken")
	}
	if !l.Retire("m001") {
		t.Fatal("an idle member could not be retired")
	}
	if _, ok := l.Take(pool, warmpool.Claim{UID: "c", Namespace: "ns"}, anyMember); ok {
		t.Error("a retired member was taken")
	}
}

// A claim's status names its member by UID alone: a claim of another namespace naming a member
// (written by no one who may: status is the operator's, and an agent's policy refuses it) takes
// nothing from the member's pool, and the member's own namespace's claims still get it.
func TestAClaimOfAnotherNamespaceTakesNothing(t *testing.T) {
	for _, order := range []string{"member first", "claim first"} {
		t.Run(order, func(t *testing.T) {
			l := warmpool.NewLedger()
			m := member(1)
			foreign := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "other", Name: "c", UID: "foreign"},
				Spec:   impv1.ImpVMSpec{WarmPoolRef: &impv1.WarmPoolReference{Name: "p"}},
				Status: impv1.ImpVMStatus{Warm: &impv1.WarmStatus{Pool: "p", Member: m.Name, MemberUID: string(m.UID)}}}
			if order == "member first" {
				l.Observe(m)
				l.Observe(foreign)
			} else {
				l.Observe(foreign)
				l.Observe(m)
			}
			if _, ok := l.Claim(m.UID); ok {
				t.Error("the member counts as bound to another namespace's claim")
			}
			if n := l.Idle(pool); n != 1 {
				t.Errorf("%d idle, want 1", n)
			}
			got, ok := l.Take(pool, warmpool.Claim{UID: "mine", Namespace: "ns"}, anyMember)
			if !ok || got.UID != m.UID {
				t.Fatalf("the namespace's own claim got %v, %v", got, ok)
			}
			if c, ok := l.Claim(m.UID); !ok || c.UID != "mine" {
				t.Errorf("bound to %v, want mine", c)
			}
		})
	}
}
