package impvmpool_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/impvmpool"
	"github.com/syscode-labs/imp/internal/kubectlimp/kubectlimptest"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// start runs the pool controller as the operator's identity until stop (or the test's end).
func start(t *testing.T, c *testcluster.Cluster) (stop func()) {
	t.Helper()
	return startWith(t, c, func(*impvmpool.Reconciler) {})
}

// startWith is start with the controller's settings changed by set.
func startWith(t *testing.T, c *testcluster.Cluster, set func(*impvmpool.Reconciler)) (stop func()) {
	t.Helper()
	mgr, err := ctrl.NewManager(c.As(t, testcluster.Operator), ctrl.Options{
		Scheme: c.Scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		Controller: config.Controller{SkipNameValidation: ptr.To(true)}, Cache: operator.CacheOptions(operator.Options{}),
	})
	if err != nil {
		t.Fatal(err)
	}
	r := &impvmpool.Reconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Recorder: mgr.GetEventRecorder("imp-operator")}
	set(r)
	if err := r.SetupWithManager(mgr, 4); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = mgr.Start(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

// agents stands in for the ImpVM controller and the nodes' agents: every VM of the namespace
// is placed and Ready a moment after it appears, except those held back.
type agents struct {
	mu   sync.Mutex
	hold map[string]bool
}

func (a *agents) holdBack(name string, held bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.hold[name] = held
}

func runAgents(t *testing.T, c *testcluster.Cluster, ns string) *agents {
	a := &agents{hold: map[string]bool{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			var vms impv1.ImpVMList
			if err := c.Client.List(ctx, &vms, client.InNamespace(ns)); err == nil {
				for i := range vms.Items {
					vm := &vms.Items[i]
					a.mu.Lock()
					want := metav1.ConditionTrue
					if a.hold[vm.Name] {
						want = metav1.ConditionFalse
					}
					a.mu.Unlock()
					if c := meta.FindStatusCondition(vm.Status.Conditions, impv1.ReadyCondition); c != nil && c.Status == want {
						continue
					}
					orig := vm.DeepCopy()
					vm.Status.NodeName, vm.Status.Phase = "node-a", impv1.VMRunning
					meta.SetStatusCondition(&vm.Status.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: want, Reason: "Test"})
					_ = c.Client.Status().Patch(ctx, vm, client.MergeFrom(orig))
				}
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()
	return a
}

func pool(ns, name string, replicas int32) *impv1.ImpVMPool {
	return &impv1.ImpVMPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMPoolSpec{
		Replicas: ptr.To(replicas),
		Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": name}},
		Template: impv1.ImpVMPoolTemplate{Metadata: impv1.PoolMemberMetadata{Labels: map[string]string{"app": name, "tier": "front"}},
			Spec: impv1.ImpVMSpec{Image: "registry.test/app:1",
				Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}}},
		UpdateStrategy: impv1.PoolUpdateStrategy{Type: impv1.PoolRollingUpdate, RollingUpdate: &impv1.PoolRollingUpdateStrategy{
			MaxUnavailable: ptr.To(intstr.FromInt32(1)), MaxSurge: ptr.To(intstr.FromInt32(0))}},
	}}
}

// members are the names of the namespace's VMs not being deleted, sorted, with their images.
func members(c *testcluster.Cluster, ns string) (names []string, images map[string]string) {
	var vms impv1.ImpVMList
	_ = c.Client.List(context.Background(), &vms, client.InNamespace(ns))
	images = map[string]string{}
	for _, vm := range vms.Items {
		if vm.DeletionTimestamp.IsZero() {
			names = append(names, vm.Name)
			images[vm.Name] = vm.Spec.Image
		}
	}
	sort.Strings(names)
	return names, images
}

// sample calls f every 20 ms until the returned function is called, which returns the values
// f read (a read that failed is left out).
func sample(f func() (int, bool)) func() []int {
	var mu sync.Mutex
	var seen []int
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			if v, ok := f(); ok {
				mu.Lock()
				seen = append(seen, v)
				mu.Unlock()
			}
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	return func() []int {
		close(stop)
		<-done
		mu.Lock()
		defer mu.Unlock()
		return seen
	}
}

func getPool(c *testcluster.Cluster, ns, name string) *impv1.ImpVMPool {
	p := &impv1.ImpVMPool{}
	_ = c.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, p)
	return p
}

func scale(t *testing.T, c *testcluster.Cluster, ns, name string, n int32) {
	t.Helper()
	p := getPool(c, ns, name)
	s := &autoscalingv1.Scale{Spec: autoscalingv1.ScaleSpec{Replicas: n}}
	if err := c.Client.SubResource("scale").Update(context.Background(), p, client.WithSubResourceBody(s)); err != nil {
		t.Fatalf("scaling %s to %d: %v", name, n, err)
	}
}

// TestScaleAndRoll: a pool makes its members <pool>-<index>, owned and labelled; the scale
// subresource scales it (and reports its selector, for HPA); scale-in takes a member that is
// not Ready first, then the newest; a new image rolls through with maxUnavailable 1, never
// fewer than replicas-1 members Ready (checked every 20 ms); going back to the old template
// (what `kubectl imp rollout undo` writes) renumbers its ControllerRevision instead of making
// another, and rolls back.
func TestScaleAndRoll(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	a := runAgents(t, c, ns)
	start(t, c)
	g := NewWithT(t)
	if err := c.Client.Create(ctx, pool(ns, "web", 3)); err != nil {
		t.Fatal(err)
	}
	ready := func(n int32) func(Gomega) {
		return func(g Gomega) {
			p := getPool(c, ns, "web")
			g.Expect(p.Status.ObservedGeneration).To(Equal(p.Generation))
			g.Expect([]int32{p.Status.Replicas, p.Status.ReadyReplicas, p.Status.AvailableReplicas, p.Status.UpdatedReplicas}).To(Equal([]int32{n, n, n, n}))
			cond := meta.FindStatusCondition(p.Status.Conditions, impv1.PoolProgressingCondition)
			g.Expect(cond).NotTo(BeNil())
			g.Expect(cond.Reason).To(Equal(impv1.ReasonRolloutComplete))
		}
	}
	g.Eventually(ready(3)).WithTimeout(30 * time.Second).Should(Succeed())
	names, _ := members(c, ns)
	g.Expect(names).To(Equal([]string{"web-0", "web-1", "web-2"}))
	vm := &impv1.ImpVM{}
	g.Expect(c.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "web-1"}, vm)).To(Succeed())
	g.Expect(vm.Labels).To(HaveKeyWithValue("tier", "front"))
	g.Expect(vm.Labels).To(HaveKeyWithValue(impv1.PoolLabel, "web"))
	g.Expect(metav1.GetControllerOf(vm)).NotTo(BeNil())
	g.Expect(metav1.GetControllerOf(vm).Name).To(Equal("web"))

	// The scale subresource: kubectl scale and HPA.
	scale(t, c, ns, "web", 5)
	g.Eventually(ready(5)).WithTimeout(30 * time.Second).Should(Succeed())
	s := &autoscalingv1.Scale{}
	g.Expect(c.Client.SubResource("scale").Get(ctx, getPool(c, ns, "web"), s)).To(Succeed())
	g.Expect(s.Status.Replicas).To(Equal(int32(5)))
	g.Expect(s.Status.Selector).To(Equal("app=web"))

	// Scale-in: the member that is not Ready, then the newest (the highest index among equals).
	a.holdBack("web-1", true)
	g.Eventually(func() int32 { return getPool(c, ns, "web").Status.ReadyReplicas }).WithTimeout(10 * time.Second).Should(Equal(int32(4)))
	scale(t, c, ns, "web", 3)
	g.Eventually(func() []string { n, _ := members(c, ns); return n }).WithTimeout(30 * time.Second).Should(Equal([]string{"web-0", "web-2", "web-3"}))
	g.Eventually(ready(3)).WithTimeout(30 * time.Second).Should(Succeed())
	a.holdBack("web-1", false) // the name is free again: the next member takes it

	// A new image rolls through, maxUnavailable 1: never fewer than 2 Ready.
	readyNow := func() (int, bool) {
		var vms impv1.ImpVMList
		if err := c.Client.List(ctx, &vms, client.InNamespace(ns)); err != nil {
			return 0, false
		}
		n := 0
		for _, vm := range vms.Items {
			if c := meta.FindStatusCondition(vm.Status.Conditions, impv1.ReadyCondition); vm.DeletionTimestamp.IsZero() && c != nil && c.Status == metav1.ConditionTrue {
				n++
			}
		}
		return n, true
	}
	readyCounts := sample(readyNow)
	setImage := func(image string) {
		p := getPool(c, ns, "web")
		orig := p.DeepCopy()
		p.Spec.Template.Spec.Image = image
		g.Expect(c.Client.Patch(ctx, p, client.MergeFrom(orig))).To(Succeed())
	}
	// Rolled: the members themselves (three, none being deleted, all of the image and Ready),
	// then the pool's status saying so. Every status the pool shows on the way is one a single
	// computation makes (no more available than Ready, no more of either than members).
	rolledTo := func(image string) {
		t.Helper()
		g.Eventually(func(g Gomega) {
			_, images := members(c, ns)
			g.Expect(images).To(HaveLen(3))
			for n, i := range images {
				g.Expect(i).To(Equal(image), n)
			}
			n, _ := readyNow()
			g.Expect(n).To(Equal(3))
		}).WithTimeout(60 * time.Second).Should(Succeed())
		g.Eventually(ready(3)).WithTimeout(30 * time.Second).Should(Succeed())
	}
	inconsistent := sample(func() (int, bool) {
		s := getPool(c, ns, "web").Status
		if s.AvailableReplicas > s.ReadyReplicas || s.ReadyReplicas > s.Replicas || s.UpdatedReplicas > s.Replicas {
			return int(s.Replicas)<<24 | int(s.ReadyReplicas)<<16 | int(s.AvailableReplicas)<<8 | int(s.UpdatedReplicas), true
		}
		return 0, false
	})
	first := impvmpool.RevisionName("web", getPool(c, ns, "web").Status.UpdateRevision)
	setImage("registry.test/app:2")
	rolledTo("registry.test/app:2")
	if lowest := slices.Min(readyCounts()); lowest < 2 {
		t.Errorf("during the rollout only %d members were Ready (maxUnavailable 1 of 3)", lowest)
	}
	revs := func() map[string]int64 {
		var list appsv1.ControllerRevisionList
		_ = c.Client.List(ctx, &list, client.InNamespace(ns))
		out := map[string]int64{}
		for _, cr := range list.Items {
			out[cr.Name] = cr.Revision
		}
		return out
	}
	g.Expect(revs()).To(HaveLen(2))
	g.Expect(revs()).To(HaveKeyWithValue(first, int64(1)))

	// kubectl imp rollout undo: back to the first template, whose revision is renumbered 3;
	// the members roll back.
	kc := c.Kubeconfig(t)
	g.Expect(kubectlimptest.Run(t, kc, ns, "rollout", "history", "impvmpool/web")).To(MatchRegexp(`1\s+` + first + `\s+registry.test/app:1\s*\n2\s+web-\w+\s+registry.test/app:2\s+\(current\)`))
	g.Expect(kubectlimptest.Run(t, kc, ns, "rollout", "undo", "impvmpool/web")).To(ContainSubstring(`impvmpool "web" rolled back to revision 1`))
	g.Expect(kubectlimptest.Run(t, kc, ns, "rollout", "status", "impvmpool/web", "--timeout", "60s")).To(ContainSubstring(`impvmpool "web" successfully rolled out`))
	rolledTo("registry.test/app:1")
	g.Expect(revs()).To(HaveLen(2))
	g.Expect(revs()).To(HaveKeyWithValue(first, int64(3)))
	p := getPool(c, ns, "web")
	g.Expect(p.Status.CurrentRevision).To(Equal(strings.TrimPrefix(first, "web-")))
	for _, v := range inconsistent() {
		t.Errorf("the pool's status said replicas %d, ready %d, available %d, updated %d", v>>24, v>>16&0xff, v>>8&0xff, v&0xff)
	}
}

// TestReplacesFinishedMembers: a member that Failed is deleted and a new one made in its place
// (at the lowest index free when it is made: the failed one's, once that is gone).
func TestReplacesFinishedMembers(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	runAgents(t, c, ns)
	start(t, c)
	g := NewWithT(t)
	g.Expect(c.Client.Create(ctx, pool(ns, "db", 2))).To(Succeed())
	g.Eventually(func() int32 { return getPool(c, ns, "db").Status.AvailableReplicas }).WithTimeout(30 * time.Second).Should(Equal(int32(2)))
	vm := &impv1.ImpVM{}
	g.Expect(c.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "db-1"}, vm)).To(Succeed())
	failed := vm.UID
	orig := vm.DeepCopy()
	vm.Status.Phase = impv1.VMFailed
	g.Expect(c.Client.Status().Patch(ctx, vm, client.MergeFrom(orig))).To(Succeed())
	g.Eventually(func(g Gomega) {
		var vms impv1.ImpVMList
		g.Expect(c.Client.List(ctx, &vms, client.InNamespace(ns))).To(Succeed())
		for _, vm := range vms.Items {
			g.Expect(vm.UID).NotTo(Equal(failed))
		}
		g.Expect(vms.Items).To(HaveLen(2))
		g.Expect(getPool(c, ns, "db").Status.AvailableReplicas).To(Equal(int32(2)))
	}).WithTimeout(30 * time.Second).Should(Succeed())
}

// TestRestartDuringScaleUp: the controller stopped while it scales 0 to 50 and started again
// ends with exactly 50 members, named db-0 … db-49 (a name is an index: a create repeated
// after a restart fails AlreadyExists, it cannot make a 51st).
func TestRestartDuringScaleUp(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	g := NewWithT(t)
	stop := start(t, c)
	p := pool(ns, "big", 0)
	g.Expect(c.Client.Create(ctx, p)).To(Succeed())
	scale(t, c, ns, "big", 50)
	g.Eventually(func() int { n, _ := members(c, ns); return len(n) }).WithTimeout(30 * time.Second).Should(BeNumerically(">=", 5))
	stop()
	n, _ := members(c, ns)
	t.Logf("stopped with %d members", len(n))
	start(t, c)
	want := make([]string, 50)
	for i := range want {
		want[i] = fmt.Sprint("big-", i)
	}
	slices.Sort(want)
	g.Eventually(func() []string { n, _ := members(c, ns); return n }).WithTimeout(60 * time.Second).Should(Equal(want))
	g.Consistently(func() int { n, _ := members(c, ns); return len(n) }).WithTimeout(3 * time.Second).Should(Equal(50))
}

// TestQuotaLeavesThePoolShort: members the namespace's ImpQuota refuses leave the pool short
// with ReplicaFailure saying why, and the pool does not retry in a loop (its status stays
// still); members that wait for quota to be placed are reported the same way.
func TestQuotaLeavesThePoolShort(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	c.InstallChartObjects(t, "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
	ns := c.Namespace(t)
	g := NewWithT(t)
	g.Expect(c.Client.Create(ctx, &impv1.ImpQuota{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "team"},
		Spec: impv1.ImpQuotaSpec{PerVM: &impv1.PerVMBounds{VCPUs: ptr.To[int32](1)}}})).To(Succeed())
	start(t, c)
	p := pool(ns, "big", 3)
	p.Spec.Template.Spec.Resources.VCPUs = ptr.To[int32](2)
	// The policy may take a moment to see the quota: until it refuses, members are made.
	g.Eventually(func() error {
		_ = c.Client.Delete(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "probe"}})
		vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "probe"}, Spec: p.Spec.Template.Spec}
		if err := c.Client.Create(ctx, vm); err == nil {
			return fmt.Errorf("not refused yet")
		}
		return nil
	}).WithTimeout(30 * time.Second).Should(Succeed())
	g.Expect(c.Client.Create(ctx, p)).To(Succeed())
	g.Eventually(func(g Gomega) {
		cond := meta.FindStatusCondition(getPool(c, ns, "big").Status.Conditions, impv1.PoolReplicaFailureCondition)
		g.Expect(cond).NotTo(BeNil())
		g.Expect(cond.Status).To(Equal(metav1.ConditionTrue))
		g.Expect(cond.Reason).To(Equal(impv1.ReasonQuotaExceeded))
		g.Expect(cond.Message).To(ContainSubstring("ImpQuota team"))
	}).WithTimeout(30 * time.Second).Should(Succeed())
	rv := getPool(c, ns, "big").ResourceVersion
	g.Consistently(func() string { return getPool(c, ns, "big").ResourceVersion }).WithTimeout(3 * time.Second).Should(Equal(rv))
	n, _ := members(c, ns)
	g.Expect(n).To(BeEmpty())

	// Within the quota's per-VM bound, members are made; one that waits for quota to be
	// placed (as the ImpVM controller reports it) is named in the condition.
	orig := getPool(c, ns, "big")
	fixed := orig.DeepCopy()
	fixed.Spec.Template.Spec.Resources.VCPUs = ptr.To[int32](1)
	g.Expect(c.Client.Patch(ctx, fixed, client.MergeFrom(orig))).To(Succeed())
	g.Eventually(func() int { n, _ := members(c, ns); return len(n) }).WithTimeout(30 * time.Second).Should(Equal(3))
	vm := &impv1.ImpVM{}
	g.Expect(c.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "big-2"}, vm)).To(Succeed())
	before := vm.DeepCopy()
	meta.SetStatusCondition(&vm.Status.Conditions, metav1.Condition{Type: impv1.ScheduledCondition, Status: metav1.ConditionFalse,
		Reason: impv1.ReasonQuotaExceeded, Message: "ImpQuota team: 8 of 8 vCPUs are held"})
	g.Expect(c.Client.Status().Patch(ctx, vm, client.MergeFrom(before))).To(Succeed())
	g.Eventually(func(g Gomega) {
		cond := meta.FindStatusCondition(getPool(c, ns, "big").Status.Conditions, impv1.PoolReplicaFailureCondition)
		g.Expect(cond).NotTo(BeNil())
		g.Expect(cond.Reason).To(Equal(impv1.ReasonQuotaExceeded))
		g.Expect(cond.Message).To(ContainSubstring("big-2: ImpQuota team: 8 of 8 vCPUs are held"))
	}).WithTimeout(30 * time.Second).Should(Succeed())
}

// TestSelectorMustSelectTheTemplate: a selector that does not select the template's labels
// makes no member and says so.
func TestSelectorMustSelectTheTemplate(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	start(t, c)
	g := NewWithT(t)
	p := pool(ns, "odd", 2)
	p.Spec.Selector = &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "app", Operator: metav1.LabelSelectorOpIn, Values: []string{"other"}}}}
	g.Expect(c.Client.Create(ctx, p)).To(Succeed())
	g.Eventually(func() string {
		cond := meta.FindStatusCondition(getPool(c, ns, "odd").Status.Conditions, impv1.PoolReplicaFailureCondition)
		if cond == nil {
			return ""
		}
		return cond.Reason
	}).WithTimeout(30 * time.Second).Should(Equal(impv1.ReasonSelectorMismatch))
	// A selector on a label the pool sets itself (here its revision, which the template also
	// carries): refused, or members of another revision would fall out of it.
	p = pool(ns, "own", 2)
	p.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{impv1.PoolRevisionLabel: "x"}}
	p.Spec.Template.Metadata.Labels[impv1.PoolRevisionLabel] = "x"
	g.Expect(c.Client.Create(ctx, p)).To(Succeed())
	g.Eventually(func() string {
		cond := meta.FindStatusCondition(getPool(c, ns, "own").Status.Conditions, impv1.PoolReplicaFailureCondition)
		if cond == nil {
			return ""
		}
		return cond.Reason + ": " + cond.Message
	}).WithTimeout(30 * time.Second).Should(And(HavePrefix(impv1.ReasonSelectorMismatch), ContainSubstring("a label the pool sets")))
	n, _ := members(c, ns)
	g.Expect(n).To(BeEmpty())
}

// TestRelabelledMembersStopThePool (docs/security.md): an admission policy that moves every
// new ImpVM of the namespace out of the pool's selector would make a pool create members for
// ever (none ever counts). The pool deletes the relabelled member, says why, and makes no more.
func TestRelabelledMembersStopThePool(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	g := NewWithT(t)
	policy := &admissionregistrationv1.MutatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: "relabel-" + ns},
		Spec: admissionregistrationv1.MutatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionregistrationv1.Fail), ReinvocationPolicy: admissionregistrationv1.NeverReinvocationPolicy,
			MatchConstraints: &admissionregistrationv1.MatchResources{
				NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": ns}},
				ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{RuleWithOperations: admissionregistrationv1.RuleWithOperations{
					Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
					Rule:       admissionregistrationv1.Rule{APIGroups: []string{"imp.dev"}, APIVersions: []string{"*"}, Resources: []string{"impvms"}}}}}},
			Mutations: []admissionregistrationv1.Mutation{{PatchType: admissionregistrationv1.PatchTypeJSONPatch,
				JSONPatch: &admissionregistrationv1.JSONPatch{Expression: `[JSONPatch{op: "replace", path: "/metadata/labels/app", value: "elsewhere"}]`}}},
		}}
	binding := &admissionregistrationv1.MutatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: "relabel-" + ns},
		Spec: admissionregistrationv1.MutatingAdmissionPolicyBindingSpec{PolicyName: policy.Name}}
	for _, o := range []client.Object{policy, binding} {
		g.Expect(c.Client.Create(ctx, o)).To(Succeed())
		t.Cleanup(func() { _ = c.Client.Delete(context.Background(), o) })
	}
	// The policy in force: a VM made now comes out relabelled.
	g.Eventually(func() string {
		vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, GenerateName: "probe-", Labels: map[string]string{"app": "web"}},
			Spec: pool(ns, "web", 0).Spec.Template.Spec}
		if err := c.Client.Create(ctx, vm); err != nil {
			return err.Error()
		}
		_ = c.Client.Delete(ctx, vm)
		return vm.Labels["app"]
	}).WithTimeout(30 * time.Second).Should(Equal("elsewhere"))
	start(t, c)
	g.Expect(c.Client.Create(ctx, pool(ns, "web", 3))).To(Succeed())
	g.Eventually(func() string {
		cond := meta.FindStatusCondition(getPool(c, ns, "web").Status.Conditions, impv1.PoolReplicaFailureCondition)
		if cond == nil {
			return ""
		}
		return cond.Reason + ": " + cond.Message
	}).WithTimeout(30 * time.Second).Should(And(HavePrefix(impv1.ReasonCreateFailed), ContainSubstring("admission changed the labels")))
	g.Consistently(func() int {
		var vms impv1.ImpVMList
		_ = c.Client.List(ctx, &vms, client.InNamespace(ns), client.MatchingLabels{impv1.PoolLabel: "web"})
		return len(vms.Items)
	}).WithTimeout(3 * time.Second).Should(BeNumerically("<=", 1))
}

// TestForeignVMsAreLeftAlone (docs/security.md): VMs the pool does not control are not its
// members, whatever their labels or names. One carrying the pool's labels (a tenant trying to
// make the pool count it, or delete it on scale-in) and one squatting a member's name are
// (web-3, labelled as the pool's member of index 3) and one squatting a member's name (web-1)
// are neither counted nor adopted nor deleted: the pool makes its members at other indices and
// scales to 0 without touching them.
func TestForeignVMsAreLeftAlone(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	runAgents(t, c, ns)
	g := NewWithT(t)
	spec := pool(ns, "web", 0).Spec.Template.Spec
	for name, labels := range map[string]map[string]string{
		"web-3": {"app": "web", "tier": "front", impv1.PoolLabel: "web", impv1.PoolIndexLabel: "3", impv1.PoolRevisionLabel: "x"},
		"web-1": {"app": "web", "tier": "front"},
	} {
		g.Expect(c.Client.Create(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels}, Spec: spec})).To(Succeed())
	}
	start(t, c)
	g.Expect(c.Client.Create(ctx, pool(ns, "web", 2))).To(Succeed())
	g.Eventually(func() []string { n, _ := members(c, ns); return n }).WithTimeout(30 * time.Second).
		Should(Equal([]string{"web-0", "web-1", "web-2", "web-3"}))
	g.Eventually(func() int32 { return getPool(c, ns, "web").Status.AvailableReplicas }).WithTimeout(30 * time.Second).Should(Equal(int32(2)))
	g.Expect(getPool(c, ns, "web").Status.Replicas).To(Equal(int32(2)))
	scale(t, c, ns, "web", 0)
	g.Eventually(func() []string { n, _ := members(c, ns); return n }).WithTimeout(30 * time.Second).Should(Equal([]string{"web-1", "web-3"}))
	g.Consistently(func() []string { n, _ := members(c, ns); return n }).WithTimeout(2 * time.Second).Should(Equal([]string{"web-1", "web-3"}))
	for _, name := range []string{"web-1", "web-3"} {
		vm := &impv1.ImpVM{}
		g.Expect(c.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, vm)).To(Succeed())
		g.Expect(vm.OwnerReferences).To(BeEmpty(), name)
	}
}

// TestClaimsPerMember: volumeClaimTemplates give each member its own claim <t>-<pool>-<index>,
// named in its spec; a rolling update replaces members in place (the same names, the same
// claims: never two VMs of one index, never a surge); scale-in takes the highest index and
// keeps its claim; claims are the pool's only with whenDeleted Delete.
func TestClaimsPerMember(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	runAgents(t, c, ns)
	start(t, c)
	g := NewWithT(t)
	p := pool(ns, "db", 3)
	p.Spec.UpdateStrategy.RollingUpdate.MaxSurge = ptr.To(intstr.FromInt32(2)) // not used: in place
	p.Spec.VolumeClaimTemplates = []impv1.PoolClaimTemplate{{Name: "data", Labels: map[string]string{"tier": "db"}, Spec: corev1.PersistentVolumeClaimSpec{
		AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}}
	p.Spec.Template.Spec.Volumes = []impv1.Volume{{Name: "data", PersistentVolumeClaim: &impv1.PersistentVolumeClaimVolumeSource{ClaimName: "data"}}}
	p.Spec.Template.Spec.VolumeMounts = []impv1.VolumeMount{{Name: "data", MountPath: "/data"}}
	g.Expect(c.Client.Create(ctx, p)).To(Succeed())
	claimOf := func(name string) string {
		vm := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, vm); err != nil || len(vm.Spec.Volumes) != 1 {
			return ""
		}
		return vm.Spec.Volumes[0].PersistentVolumeClaim.ClaimName
	}
	claims := func() []string {
		var l corev1.PersistentVolumeClaimList
		_ = c.Client.List(ctx, &l, client.InNamespace(ns))
		var out []string
		for _, pvc := range l.Items {
			g.Expect(pvc.Labels).To(HaveKeyWithValue("tier", "db"))
			g.Expect(pvc.OwnerReferences).To(BeEmpty())
			out = append(out, pvc.Name)
		}
		sort.Strings(out)
		return out
	}
	g.Eventually(func() int32 { return getPool(c, ns, "db").Status.AvailableReplicas }).WithTimeout(30 * time.Second).Should(Equal(int32(3)))
	g.Expect(claims()).To(Equal([]string{"data-db-0", "data-db-1", "data-db-2"}))
	for i := range 3 {
		g.Expect(claimOf(fmt.Sprint("db-", i))).To(Equal(fmt.Sprint("data-db-", i)))
	}

	// A new image: in place, index by index; at most 3 VMs at any time.
	vmCounts := sample(func() (int, bool) {
		var vms impv1.ImpVMList
		err := c.Client.List(ctx, &vms, client.InNamespace(ns))
		return len(vms.Items), err == nil
	})
	orig := getPool(c, ns, "db")
	next := orig.DeepCopy()
	next.Spec.Template.Spec.Image = "registry.test/app:2"
	g.Expect(c.Client.Patch(ctx, next, client.MergeFrom(orig))).To(Succeed())
	g.Eventually(func(g Gomega) {
		pl := getPool(c, ns, "db")
		g.Expect([]int32{pl.Status.Replicas, pl.Status.UpdatedReplicas, pl.Status.AvailableReplicas}).To(Equal([]int32{3, 3, 3}))
		names, images := members(c, ns)
		g.Expect(names).To(Equal([]string{"db-0", "db-1", "db-2"}))
		for _, i := range images {
			g.Expect(i).To(Equal("registry.test/app:2"))
		}
	}).WithTimeout(60 * time.Second).Should(Succeed())
	g.Expect(slices.Max(vmCounts())).To(BeNumerically("<=", 3), "VMs at once during an in-place update")
	for i := range 3 {
		g.Expect(claimOf(fmt.Sprint("db-", i))).To(Equal(fmt.Sprint("data-db-", i)))
	}

	// Scale-in: the highest index goes, its claim stays; scale-up takes it again.
	scale(t, c, ns, "db", 2)
	g.Eventually(func() []string { n, _ := members(c, ns); return n }).WithTimeout(30 * time.Second).Should(Equal([]string{"db-0", "db-1"}))
	g.Expect(claims()).To(Equal([]string{"data-db-0", "data-db-1", "data-db-2"}))
	scale(t, c, ns, "db", 3)
	g.Eventually(func() string { return claimOf("db-2") }).WithTimeout(30 * time.Second).Should(Equal("data-db-2"))
	g.Expect(claims()).To(HaveLen(3))
}

// staleReads is the API server as a lagging cache shows it: the pool as it was once, when set.
type staleReads struct {
	client.Client
	pool *impv1.ImpVMPool
}

func (s *staleReads) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	if p, ok := obj.(*impv1.ImpVMPool); ok && s.pool != nil && key == client.ObjectKeyFromObject(s.pool) {
		s.pool.DeepCopyInto(p)
		return nil
	}
	return s.Client.Get(ctx, key, obj, opts...)
}

type noEvents struct{}

func (noEvents) Eventf(runtime.Object, runtime.Object, string, string, string, string, ...interface{}) {
}

// TestAStaleCacheDoesNotMixTheStatus: a reconcile whose cache still holds an older status of
// the pool (its own write before last) writes the status it computed, whole. Against the
// status as the cache had it, the patch left out the fields that had not changed since then,
// and the API server kept those of the newer write: a member no longer Ready stayed counted
// (CI once saw a pool stay at available 3 of 2 replicas for a minute this way).
func TestAStaleCacheDoesNotMixTheStatus(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	g := NewWithT(t)
	g.Expect(c.Client.Create(ctx, pool(ns, "mix", 2))).To(Succeed())
	cache := &staleReads{Client: c.Client}
	r := &impvmpool.Reconciler{Client: cache, APIReader: c.Client, Recorder: noEvents{}}
	reconcile := func() {
		t.Helper()
		if _, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKey{Namespace: ns, Name: "mix"}}); err != nil {
			t.Fatal(err)
		}
	}
	setReady := func(name string, ready bool) {
		t.Helper()
		vm := &impv1.ImpVM{}
		g.Expect(c.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, vm)).To(Succeed())
		orig := vm.DeepCopy()
		st := metav1.ConditionFalse
		if ready {
			st = metav1.ConditionTrue
		}
		vm.Status.NodeName, vm.Status.Phase = "node-a", impv1.VMRunning
		meta.SetStatusCondition(&vm.Status.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: st, Reason: "Test"})
		g.Expect(c.Client.Status().Patch(ctx, vm, client.MergeFrom(orig))).To(Succeed())
	}
	counts := func() []int32 {
		s := getPool(c, ns, "mix").Status
		return []int32{s.Replicas, s.ReadyReplicas, s.AvailableReplicas, s.UpdatedReplicas}
	}
	reconcile()
	setReady("mix-0", true)
	reconcile()
	g.Expect(counts()).To(Equal([]int32{2, 1, 1, 2}))
	before := getPool(c, ns, "mix") // what the cache will still say
	setReady("mix-1", true)
	reconcile()
	g.Expect(counts()).To(Equal([]int32{2, 2, 2, 2}))
	setReady("mix-1", false)
	cache.pool = before
	reconcile()
	g.Expect(counts()).To(Equal([]int32{2, 1, 1, 2}), "the status after mix-1 left Ready, computed with the cache two writes behind")
}

// TestAPoolStopsAtTheNamespacesVMs: a pool of 50 replicas in a namespace whose ImpQuota allows
// 3 VMs (one taken by a VM of the tenant's own) makes 2 members, not 50 VMs that would wait for
// quota, and says which quota stopped it; the quota raised, it makes the room's worth more.
func TestAPoolStopsAtTheNamespacesVMs(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	g := NewWithT(t)
	quota := &impv1.ImpQuota{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "team"}, Spec: impv1.ImpQuotaSpec{Hard: impv1.QuotaResources{VMs: ptr.To[int32](3)}}}
	g.Expect(c.Client.Create(ctx, quota)).To(Succeed())
	own := pool(ns, "own", 1).Spec.Template.Spec
	g.Expect(c.Client.Create(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "own"}, Spec: own})).To(Succeed())
	// A finished VM holds no placement: it leaves the room as it is.
	done := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "done"}, Spec: own}
	g.Expect(c.Client.Create(ctx, done)).To(Succeed())
	done.Status.Phase = impv1.VMSucceeded
	g.Expect(c.Client.Status().Update(ctx, done)).To(Succeed())
	count := sample(func() (int, bool) { n, _ := members(c, ns); return len(n), true })
	start(t, c)
	g.Expect(c.Client.Create(ctx, pool(ns, "big", 50))).To(Succeed())
	stopped := func(hard int) func(Gomega) {
		return func(g Gomega) {
			cond := meta.FindStatusCondition(getPool(c, ns, "big").Status.Conditions, impv1.PoolReplicaFailureCondition)
			g.Expect(cond).NotTo(BeNil())
			g.Expect(cond.Reason).To(Equal(impv1.ReasonQuotaExceeded))
			g.Expect(cond.Message).To(ContainSubstring(fmt.Sprintf("ImpQuota team: the namespace has %d VMs that hold or wait for a placement, of %[1]d (hard.vms)", hard)))
		}
	}
	g.Eventually(stopped(3)).WithTimeout(30 * time.Second).Should(Succeed())
	n, _ := members(c, ns)
	g.Expect(n).To(Equal([]string{"big-0", "big-1", "done", "own"}))

	orig := quota.DeepCopy()
	quota.Spec.Hard.VMs = ptr.To[int32](6)
	g.Expect(c.Client.Patch(ctx, quota, client.MergeFrom(orig))).To(Succeed())
	g.Eventually(func() int { n, _ := members(c, ns); return len(n) }).WithTimeout(30 * time.Second).Should(Equal(7))
	g.Eventually(stopped(6)).WithTimeout(30 * time.Second).Should(Succeed())
	if most := slices.Max(count()); most > 7 {
		t.Errorf("the namespace had %d VMs at once (the quota allowed 6 and one finished)", most)
	}
}

// TestPoolCreatesArePaced: the pools of one namespace make their members within its budget,
// a burst then a pace, whatever their replicas; another namespace's budget is its own.
func TestPoolCreatesArePaced(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns, other := c.Namespace(t), c.Namespace(t)
	g := NewWithT(t)
	clk := clocktesting.NewFakePassiveClock(time.Now())
	startWith(t, c, func(r *impvmpool.Reconciler) { r.Clock, r.CreatesPerSecond, r.CreateBurst = clk, 4, 6 })
	g.Expect(c.Client.Create(ctx, pool(ns, "a", 40))).To(Succeed())
	g.Expect(c.Client.Create(ctx, pool(ns, "b", 40))).To(Succeed())
	g.Expect(c.Client.Create(ctx, pool(other, "c", 5))).To(Succeed())
	count := func(ns string) func() int { return func() int { n, _ := members(c, ns); return len(n) } }
	g.Eventually(count(ns)).WithTimeout(30 * time.Second).Should(Equal(6))
	g.Eventually(count(other)).WithTimeout(30 * time.Second).Should(Equal(5))
	// The clock stands still: the budget stays spent, though the pools try again.
	g.Consistently(count(ns)).WithTimeout(2 * time.Second).Should(Equal(6))
	clk.SetTime(clk.Now().Add(time.Second))
	g.Eventually(count(ns)).WithTimeout(30 * time.Second).Should(Equal(10))
	g.Consistently(count(ns)).WithTimeout(time.Second).Should(Equal(10))
}
