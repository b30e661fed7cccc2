package impvm_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	. "github.com/onsi/gomega"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/kubectlimp/kubectlimptest"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// handsOver makes the node's agent report that it hands warm members to claims.
func (e *env) handsOver(node string) {
	e.t.Helper()
	rep := &impv1.ImpNode{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Name: e.ns + "-" + node}, rep); err != nil {
		e.t.Fatal(err)
	}
	rep.Status.Features = []string{impv1.FeatureWarmHandover}
	if err := e.c.Status().Update(context.Background(), rep); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) warmPool(name, template string, replicas int32) *impv1.ImpWarmPool {
	return &impv1.ImpWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}, Spec: impv1.ImpWarmPoolSpec{
		TemplateRef: impv1.TemplateReference{Name: template}, Replicas: ptr.To(replicas),
		NodeSelector: map[string]string{"imp.test/pool": e.pool}}}
}

func (e *env) claim(name, pool string) *impv1.ImpVM {
	return &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}, Spec: impv1.ImpVMSpec{
		WarmPoolRef:  &impv1.WarmPoolReference{Name: pool},
		NodeSelector: map[string]string{"imp.test/pool": e.pool},
		Env:          []impv1.EnvVar{{Name: "WHO", Value: name}}}}
}

func (e *env) getWarmPool(name string) *impv1.ImpWarmPool {
	p := &impv1.ImpWarmPool{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Namespace: e.ns, Name: name}, p); err != nil {
		return nil
	}
	return p
}

// members are the names of the pool's members (its controller's, not being deleted).
func (e *env) members(pool string) []string {
	var out []string
	for _, vm := range e.list() {
		if impv1.WarmPoolOf(&vm) == pool && vm.DeletionTimestamp.IsZero() {
			out = append(out, vm.Name)
		}
	}
	return out
}

// scale sets the pool's replicas through its scale subresource, as kubectl scale does.
func (e *env) scale(pool string, n int32) {
	e.t.Helper()
	p := e.getWarmPool(pool)
	sc := &autoscalingv1.Scale{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: pool}, Spec: autoscalingv1.ScaleSpec{Replicas: n}}
	if err := e.c.SubResource("scale").Update(context.Background(), p, client.WithSubResourceBody(sc)); err != nil {
		e.t.Fatal(err)
	}
}

// TestWarmPoolClaims: a pool of 3 keeps 3 members idle; of 4 claims made at once 3 are handed
// a member each (warm: the member's node, resources and template, its own name and address),
// the 4th is restored from the pool's template; the members handed over are deleted once their
// claims run, and the pool is back to 3 idle. kubectl scale grows it and empties it. A claim of
// a pool that does not exist waits; a node whose agent does not hand members over serves
// claims by restore.
func TestWarmPoolClaims(t *testing.T) {
	e := newEnv(t)
	e.node("a", 32, 32)
	e.handsOver("a")
	e.startOperator()
	e.startAgent(nil)
	g := NewWithT(t)

	e.create(e.template("web"), e.warmPool("p", "web", 3))
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(3)))
	p := e.getWarmPool("p")
	g.Expect(p.Status.Replicas).To(Equal(int32(3)))
	g.Expect(p.Status.Selector).To(Equal(impv1.WarmPoolLabel + "=p"))
	g.Expect(p.Status.Revision).To(Equal(e.getTemplate("web").Status.Revision))
	idle := map[string]bool{}
	for _, m := range e.members("p") {
		idle[m] = true
		vm := e.get(m)
		g.Expect(vm.Status.Start).To(Equal(impv1.StartRestored))
		g.Expect(vm.Status.Image).To(Equal("registry.test/app:1"))
	}

	// 4 claims at once, no member refilled meanwhile.
	e.holdMembers.Store(true)
	for i := range 4 {
		e.create(e.claim(name("c", i), "p"))
	}
	eventually(t, func() int {
		n := 0
		for i := range 4 {
			if vm := e.get(name("c", i)); vm != nil && vm.Status.NodeName != "" {
				n++
			}
		}
		return n
	}).Should(Equal(4))
	took := map[string]string{}
	starts := map[impv1.VMStart]int{}
	for i := range 4 {
		vm := e.get(name("c", i))
		starts[vm.Status.Start]++
		g.Expect(vm.Status.Image).To(Equal("registry.test/app:1"), "a claim's image is its template's")
		if vm.Status.Start != impv1.StartWarm {
			g.Expect(vm.Status.Warm).To(BeNil())
			continue
		}
		w := vm.Status.Warm
		g.Expect(idle).To(HaveKey(w.Member), "a claim was handed a VM that was not an idle member")
		g.Expect(took).NotTo(HaveKey(w.Member), "two claims were handed member %s", w.Member)
		took[w.Member] = vm.Name
		g.Expect(vm.Status.NodeName).To(Equal(e.ns + "-a"))
		g.Expect(vm.Status.Resources.VCPUs).To(Equal(int32(2)))
		g.Expect(vm.Status.Template.Name).To(Equal("web"))
		g.Expect(vm.OwnerReferences).To(BeEmpty(), "a claim is its claimant's, not the pool's")
	}
	g.Expect(starts).To(Equal(map[impv1.VMStart]int{impv1.StartWarm: 3, impv1.StartRestored: 1}))

	// Handed over (the claims run): the members go; the pool refills to 3 idle.
	for i := range 4 {
		eventually(t, func() string { return readyReason(e.get(name("c", i))) }).Should(Equal(impv1.ReasonGuestReady))
	}
	for m := range took {
		eventually(t, func() *impv1.ImpVM { return e.get(m) }).Should(BeNil())
	}
	e.holdMembers.Store(false)
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(3)))
	g.Expect(e.getWarmPool("p").Status.Claimed).To(BeZero())
	served := func(start string) float64 {
		return metric(t, "imp_warmpool_claims_total", "namespace", e.ns, "pool", "p", "start", start)
	}
	g.Expect(served("warm")).To(Equal(3.0))
	g.Expect(served("restored")).To(Equal(1.0))
	eventually(t, func() float64 {
		return metric(t, "imp_warmpool_members", "namespace", e.ns, "pool", "p", "state", "idle")
	}).Should(Equal(3.0))

	// kubectl imp claim: a claim of the pool, Ready, and how it started.
	out := kubectlimptest.Run(t, e.cl.Kubeconfig(t), e.ns, "claim", "p", "by-kubectl", "--env", "WHO=kubectl", "--wait")
	g.Expect(out).To(MatchRegexp(`impvm/by-kubectl ready on node \S+ in \S+: warm \(member p-\w+\)`))
	g.Expect(e.get("by-kubectl").Spec.Env).To(Equal([]impv1.EnvVar{{Name: "WHO", Value: "kubectl"}}))
	g.Expect(kubectlimptest.Run(t, e.cl.Kubeconfig(t), e.ns, "status", "by-kubectl")).To(MatchRegexp(`Started:\s+warm \(member p-\w+ of impwarmpool/p\)`))

	// Scale.
	e.scale("p", 5)
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(5)))
	e.scale("p", 0)
	eventually(t, func() []string { return e.members("p") }).Should(BeEmpty())
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Replicas }).Should(BeZero())
	for i := range 4 {
		g.Expect(e.get(name("c", i))).NotTo(BeNil(), "a claimed VM went with the pool's members")
	}

	// An empty pool: a claim is restored, never waits.
	e.create(e.claim("late", "p"))
	eventually(t, func() impv1.VMStart { return e.get("late").Status.Start }).Should(Equal(impv1.StartRestored))

	// No such pool.
	e.create(e.claim("nopool", "nothing"))
	eventually(t, func() string { return scheduled(e.get("nopool")) }).Should(Equal(impv1.ReasonWarmPoolNotFound))
}

// oneIdleMember is an env with a node whose agent hands members over, the operator, and a
// pool p of template web with its one member idle.
func oneIdleMember(t *testing.T) *env {
	e := newEnv(t)
	e.node("a", 32, 32)
	e.handsOver("a")
	e.startOperator()
	e.startAgent(nil)
	e.create(e.template("web"), e.warmPool("p", "web", 1))
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(1)))
	return e
}

// TestWarmClaimsOwnWorkload: a claim that sets its own command, args or workingDir is handed
// only a member restored from a snapshot taken before the workload (its guest holds it): an
// idle member of an earlier revision whose workload runs (OnClaim keeps it) goes to a claim
// that sets none, and the claim with its own args is restored from the new revision instead.
func TestWarmClaimsOwnWorkload(t *testing.T) {
	e := oneIdleMember(t)
	g := NewWithT(t)
	old := e.members("p")[0]

	tmpl := e.getTemplate("web")
	tmpl.Spec.SnapshotWhen = &impv1.SnapshotWhen{BeforeWorkload: true}
	if err := e.c.Update(context.Background(), tmpl); err != nil {
		t.Fatal(err)
	}
	rev := e.getTemplate("web").Status.Revision
	eventually(t, func() string { return e.getTemplate("web").Status.Revision }).ShouldNot(Equal(rev))
	e.holdMembers.Store(true) // the old member stays the only one
	own := e.claim("own", "p")
	own.Spec.Args = []string{"job", "7"}
	e.create(own)
	eventually(t, func() impv1.VMStart { return e.get("own").Status.Start }).Should(Equal(impv1.StartRestored))
	g.Expect(e.get("own").Status.Template.BeforeWorkload).To(BeTrue())
	g.Expect(e.get("own").Workload().Args).To(Equal([]string{"job", "7"}))
	e.create(e.claim("plain", "p"))
	eventually(t, func() impv1.VMStart { return e.get("plain").Status.Start }).Should(Equal(impv1.StartWarm))
	g.Expect(e.get("plain").Status.Warm.Member).To(Equal(old))
	g.Expect(e.get("plain").Status.Template.BeforeWorkload).To(BeFalse())
}

// TestWarmClaimsOnlyWhereTheAgentHandsOver: a node whose agent does not report WarmHandover (an
// agent not upgraded yet) keeps its members idle; claims are restored.
func TestWarmClaimsOnlyWhereTheAgentHandsOver(t *testing.T) {
	e := newEnv(t)
	e.node("a", 32, 32)
	e.startOperator()
	e.startAgent(nil)
	e.create(e.template("web"), e.warmPool("p", "web", 2))
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(2)))
	e.create(e.claim("c", "p"))
	eventually(t, func() impv1.VMStart { return e.get("c").Status.Start }).Should(Equal(impv1.StartRestored))
	NewWithT(t).Expect(e.getWarmPool("p").Status.Idle).To(Equal(int32(2)))
}

// TestWarmClaimsNeverShareAMember: 50 claims made at once against a pool of 50 idle members,
// the operator killed (SIGKILL) while it binds them and started again: no member is bound to
// two claims, every member is bound to one claim or idle (none lost), and every claim is
// placed, warm or restored.
func TestWarmClaimsNeverShareAMember(t *testing.T) {
	e := newEnv(t)
	for _, n := range []string{"a", "b"} {
		e.node(n, 128, 128)
		e.handsOver(n)
	}
	kill := e.startOperatorProcess()
	e.startAgent(nil)
	const n = 50
	e.create(e.template("web"), e.warmPool("p", "web", n))
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(n)))
	e.holdMembers.Store(true)

	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			if err := e.c.Create(context.Background(), e.claim(name("c", i), "p")); err != nil {
				t.Errorf("creating claim %d: %v", i, err)
			}
		})
	}
	// Killed once some claims are bound, most not yet.
	eventually(t, func() int {
		bound := 0
		for _, vm := range e.list() {
			if vm.Status.Warm != nil {
				bound++
			}
		}
		return bound
	}).Should(BeNumerically(">=", 5))
	kill()
	wg.Wait()
	e.startOperator()

	eventually(t, func() int {
		placed := 0
		for _, vm := range e.list() {
			if vm.IsClaim() && vm.Status.NodeName != "" {
				placed++
			}
		}
		return placed
	}).Should(Equal(n))
	byMember := map[string][]string{}
	warm := 0
	for _, vm := range e.list() {
		if w := vm.Status.Warm; vm.IsClaim() && w != nil {
			byMember[w.MemberUID] = append(byMember[w.MemberUID], vm.Name)
			warm++
		}
	}
	for m, claims := range byMember {
		if len(claims) > 1 {
			t.Errorf("member %s was handed to %d claims: %v", m, len(claims), claims)
		}
	}
	t.Logf("%d of %d claims served warm", warm, n)
	// None lost: a member not bound to a claim is idle again (its binding, if the killed
	// operator made one, never reached the API).
	e.holdMembers.Store(false)
	eventually(t, func() error {
		vms := e.list()
		for _, vm := range vms {
			if impv1.WarmPoolOf(&vm) != "p" || !vm.DeletionTimestamp.IsZero() {
				continue
			}
			if _, bound := byMember[string(vm.UID)]; bound {
				continue // handed over: deleted once its claim runs
			}
			if vm.Status.Phase != impv1.VMRunning {
				return fmt.Errorf("member %s is %s", vm.Name, vm.Status.Phase)
			}
		}
		return nil
	}).Should(Succeed())
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(n)))
}

// TestWarmPoolMembersCannotBeStolen: a tenant of the namespace (the chart's imp-edit) relabels
// an idle member into another pool, or takes the pool's owner reference off another: neither is
// handed to anyone any more (a member is its pool's label and its pool's controller), and the
// pool makes members in their place. A tenant cannot write a claim's status.warm to name a
// member, and a claim naming a pool that exists only in another namespace waits
// (WarmPoolNotFound) and is never handed that namespace's member.
func TestWarmPoolMembersCannotBeStolen(t *testing.T) {
	e := newEnv(t)
	e.node("a", 64, 64)
	e.handsOver("a")
	e.startOperator()
	e.startAgent(nil)
	ctx := context.Background()
	g := NewWithT(t)
	_ = e.cl.As(t, testcluster.Operator) // the chart's roles, imp-edit included
	tenant := e.tenant("ClusterRole", "imp-edit")

	e.create(e.template("web"), e.warmPool("p", "web", 2), e.warmPool("q", "web", 0))
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(2)))
	ms := e.members("p")
	relabelled, orphaned := ms[0], ms[1]
	patch := func(name string, p string) {
		t.Helper()
		if err := tenant.Patch(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}}, client.RawPatch(types.MergePatchType, []byte(p))); err != nil {
			t.Fatalf("the tenant's patch of %s: %v", name, err)
		}
	}
	patch(relabelled, `{"metadata":{"labels":{"`+impv1.WarmPoolLabel+`":"q"}}}`)
	patch(orphaned, `{"metadata":{"ownerReferences":null}}`)
	// The pool makes two others; the two taken out are no member of p's nor q's.
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(2)))
	g.Expect(e.members("p")).NotTo(ContainElements(relabelled, orphaned))
	g.Expect(e.members("q")).To(BeEmpty())
	g.Expect(e.getWarmPool("q").Status.Idle).To(BeZero())

	// Claims of q (which has no member) are restored; claims of p get p's new members only.
	e.create(e.claim("cq", "q"), e.claim("cp1", "p"), e.claim("cp2", "p"))
	for _, c := range []string{"cq", "cp1", "cp2"} {
		eventually(t, func() string { return e.get(c).Status.NodeName }).ShouldNot(BeEmpty())
		if w := e.get(c).Status.Warm; w != nil && (w.Member == relabelled || w.Member == orphaned) {
			t.Errorf("claim %s was handed %s, which was taken out of the pool", c, w.Member)
		}
	}
	g.Expect(e.get("cq").Status.Start).To(Equal(impv1.StartRestored))

	// status.warm is the operator's to write.
	e.create(e.claim("forged", "p"))
	err := tenant.Status().Patch(ctx, e.get("forged"), client.RawPatch(types.MergePatchType,
		[]byte(`{"status":{"warm":{"pool":"p","member":"`+relabelled+`","memberUID":"x"}}}`)))
	g.Expect(apierrors.IsForbidden(err)).To(BeTrue(), "a tenant wrote a claim's status.warm: %v", err)

	// Another namespace's pool of the same name.
	other := e.cl.Namespace(t)
	c := e.claim("elsewhere", "p")
	c.Namespace = other
	e.create(c)
	eventually(t, func() string {
		vm := &impv1.ImpVM{}
		_ = e.c.Get(ctx, types.NamespacedName{Namespace: other, Name: "elsewhere"}, vm)
		return scheduled(vm)
	}).Should(Equal(impv1.ReasonWarmPoolNotFound))
}

// TestWarmPoolSpreadsOverNodes: members go to the node holding fewest of the pool's members
// (spread Nodes, the default), not where there is most free memory as any VM does (spread
// None).
func TestWarmPoolSpreadsOverNodes(t *testing.T) {
	e := newEnv(t)
	e.node("big", 64, 64)
	e.node("small", 8, 8)
	e.startOperator()
	e.startAgent(nil)
	perNode := func(pool string) map[string]int {
		out := map[string]int{}
		for _, m := range e.members(pool) {
			if n := e.get(m).Status.NodeName; n != "" {
				out[n]++
			}
		}
		return out
	}
	big, small := e.ns+"-big", e.ns+"-small"
	e.create(e.template("web"), e.warmPool("spread", "web", 4))
	eventually(t, func() int32 { return e.getWarmPool("spread").Status.Idle }).Should(Equal(int32(4)))
	NewWithT(t).Expect(perNode("spread")).To(Equal(map[string]int{big: 2, small: 2}))

	packed := e.warmPool("packed", "web", 4)
	packed.Spec.Spread = impv1.WarmPoolSpreadNone
	e.create(packed)
	eventually(t, func() int32 { return e.getWarmPool("packed").Status.Idle }).Should(Equal(int32(4)))
	NewWithT(t).Expect(perNode("packed")).To(Equal(map[string]int{big: 4}))
}

// metric is the value of the operator's metric name (a counter or gauge) with the labels given
// as name, value pairs; 0 when there is none.
func metric(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	families, err := ctrlmetrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue next
				}
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

// TestFailedHandoverIsRestored: a node that cannot hand the member to its claim (the member's
// guest refused the claim's identity) reports WarmHandoverFailed: the claim is placed again and
// restored from the pool's template, never handed a member again; the member, bound for good,
// is deleted, and the pool makes another.
func TestFailedHandoverIsRestored(t *testing.T) {
	e := oneIdleMember(t)
	g := NewWithT(t)
	member := e.members("p")[0]

	e.failHandover.Store(true)
	e.create(e.claim("c", "p"))
	eventually(t, func() string { return readyReason(e.get("c")) }).Should(Equal(impv1.ReasonGuestReady))
	c := e.get("c")
	g.Expect(c.Status.Start).To(Equal(impv1.StartRestored))
	g.Expect(c.Status.Warm).To(BeNil())
	g.Expect(c.Status.Instance).To(Equal(int64(2)))
	g.Expect(c.Status.Runtime.RestoredFrom).NotTo(BeEmpty(), "the claim was not restored from the template's snapshot")
	g.Expect(e.events()).To(HaveKey(impv1.ReasonWarmHandoverFailed))
	eventually(t, func() *impv1.ImpVM { return e.get(member) }).Should(BeNil())
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(1)))
	g.Expect(e.members("p")).NotTo(ContainElement(member))
}

// TestWarmPoolMembersCountInTheQuota: idle members hold the namespace's ImpQuota as any VM. A
// claim handed a member takes over what the member held (the namespace holds no more than
// before); the member made to refill the pool then waits for room, and the pool says so
// (ReplicaFailure, QuotaExceeded); a claim with no idle member left is restored, and waits for
// room as any VM; a higher quota lets both through.
func TestWarmPoolMembersCountInTheQuota(t *testing.T) {
	e := newEnv(t)
	e.node("a", 32, 32)
	e.handsOver("a")
	e.startOperator()
	e.startAgent(nil)
	g := NewWithT(t)
	e.create(e.quota("team", 6, "6Gi")) // the template's builder and two members, of 2 vCPUs each
	e.create(e.template("web"), e.warmPool("p", "web", 2))
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(2)))
	eventually(t, func() int { return len(e.list()) }).Should(Equal(2)) // the builder gone
	e.setQuota("team", 4, "4Gi")                                        // what the two members hold

	e.create(e.claim("c1", "p"))
	eventually(t, func() impv1.VMStart { return e.get("c1").Status.Start }).Should(Equal(impv1.StartWarm))
	replicaFailure := func() string {
		c := apimeta.FindStatusCondition(e.getWarmPool("p").Status.Conditions, impv1.WarmPoolReplicaFailureCondition)
		if c == nil || c.Status != metav1.ConditionTrue {
			return ""
		}
		return c.Reason
	}
	eventually(t, replicaFailure).Should(Equal(impv1.ReasonQuotaExceeded))
	g.Expect(e.getWarmPool("p").Status.Idle).To(Equal(int32(1)))

	e.create(e.claim("c2", "p"), e.claim("c3", "p"))
	eventually(t, func() int {
		n := 0
		for _, c := range []string{"c2", "c3"} {
			if v := e.get(c); v.Status.NodeName != "" || scheduled(v) == impv1.ReasonQuotaExceeded {
				n++
			}
		}
		return n
	}).Should(Equal(2))
	starts := map[string]int{}
	for _, c := range []string{"c2", "c3"} {
		v := e.get(c)
		starts[string(v.Status.Start)+"/"+scheduled(v)]++
	}
	g.Expect(starts).To(Equal(map[string]int{"warm/True": 1, "/QuotaExceeded": 1}))

	e.setQuota("team", 12, "12Gi")
	for _, c := range []string{"c1", "c2", "c3"} {
		eventually(t, func() string { return readyReason(e.get(c)) }).Should(Equal(impv1.ReasonGuestReady))
	}
	eventually(t, func() int32 { return e.getWarmPool("p").Status.Idle }).Should(Equal(int32(2)))
	eventually(t, replicaFailure).Should(BeEmpty())
}
