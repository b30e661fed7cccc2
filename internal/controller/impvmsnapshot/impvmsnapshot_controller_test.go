package impvmsnapshot_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/impquota"
	"github.com/syscode-labs/imp/internal/controller/impvmsnapshot"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// TestSnapshotsGoToTheirVMsNodes: a snapshot is held by a finalizer and waits (VMNotFound, then
// VMNotRunning) until its VM runs on a node, then is given to that node; deleted, it is let go
// once its node says its files are gone, or once its node is gone.
func TestSnapshotsGoToTheirVMsNodes(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	start(t, c)
	g := NewWithT(t)
	get, state := getters(c, ns)
	for _, name := range []string{"a", "b"} {
		if err := c.Client.Create(ctx, &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMSnapshotSpec{VMName: "vm"}}); err != nil {
			t.Fatal(err)
		}
	}
	g.Eventually(func() string { return state("a") }).WithTimeout(30 * time.Second).Should(Equal("Pending/VMNotFound/"))
	if !slices.Contains(get("a").Finalizers, impv1.SnapshotFinalizer) {
		t.Errorf("finalizers %v", get("a").Finalizers)
	}
	// The spec cannot change.
	s := get("a")
	s.Spec.VMName = "other"
	if err := c.Client.Update(ctx, s); err == nil {
		t.Error("a snapshot's VM changed")
	}
	vm := createVM(t, c, ns)
	g.Eventually(func() string { return state("a") }).WithTimeout(30 * time.Second).Should(Equal("Pending/VMNotRunning/"))
	node := runOnNode(t, c, vm)
	for _, name := range []string{"a", "b"} {
		g.Eventually(func() string { return state(name) }).WithTimeout(30 * time.Second).Should(Equal("Pending//" + node))
	}

	// Deleted: held until the node says its files are gone.
	if err := c.Client.Delete(ctx, get("a")); err != nil {
		t.Fatal(err)
	}
	g.Consistently(func() string { return state("a") }).WithTimeout(2 * time.Second).ShouldNot(Equal("gone"))
	a := get("a")
	a.Status.FilesRemoved = true
	if err := c.Client.Status().Update(ctx, a); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string { return state("a") }).WithTimeout(30 * time.Second).Should(Equal("gone"))
	// Or until its node is gone.
	if err := c.Client.Delete(ctx, get("b")); err != nil {
		t.Fatal(err)
	}
	g.Consistently(func() string { return state("b") }).WithTimeout(2 * time.Second).ShouldNot(Equal("gone"))
	if err := c.Client.Delete(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string { return state("b") }).WithTimeout(30 * time.Second).Should(Equal("gone"))
}

// TestSnapshotQuota: past the ImpQuota's snapshots (or their storage, a snapshot being taken
// counted at its VM's memory and disk), a snapshot waits with QuotaExceeded and no node, and
// goes ahead once another's files are gone; the quota's status counts them.
func TestSnapshotQuota(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	start(t, c)
	g := NewWithT(t)
	get, state := getters(c, ns)
	q := &impv1.ImpQuota{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "q"}, Spec: impv1.ImpQuotaSpec{Hard: impv1.QuotaResources{
		Snapshots: ptr.To[int32](1), SnapshotStorage: ptr.To(resource.MustParse("2Gi"))}}}
	if err := c.Client.Create(ctx, q); err != nil {
		t.Fatal(err)
	}
	node := runOnNode(t, c, createVM(t, c, ns)) // 128Mi memory, 1Gi disk: at most 1152Mi
	for _, name := range []string{"a", "b"} {
		if err := c.Client.Create(ctx, &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMSnapshotSpec{VMName: "vm"}}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	g.Eventually(func() []string { return []string{state("a"), state("b")} }).WithTimeout(30 * time.Second).Should(ConsistOf(
		"Pending//"+node, "Pending/QuotaExceeded/"))
	waiting := "a"
	if get("a").Status.NodeName != "" {
		waiting = "b"
	}
	if m := get(waiting).Status.Message; m != "ImpQuota q allows 1 snapshots; the namespace has 1" {
		t.Errorf("message %q", m)
	}
	// The count raised: the storage bounds it now (two at most 1152Mi each pass 2Gi).
	if err := c.Client.Patch(ctx, q, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"hard":{"snapshots":5}}}`))); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string { return get(waiting).Status.Message }).WithTimeout(30 * time.Second).Should(HavePrefix("ImpQuota q allows 2Gi of snapshot storage"))
	// The other one taken (its size known, small) and counted as such: room.
	taken := map[string]string{"a": "b", "b": "a"}[waiting]
	s := get(taken)
	s.Status.Phase, s.Status.Size = impv1.SnapshotReady, ptr.To(resource.MustParse("100Mi"))
	if err := c.Client.Status().Update(ctx, s); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string { return state(waiting) }).WithTimeout(30 * time.Second).Should(Equal("Pending//" + node))
	// The quota's status counts both: the taken one at its size, the other at its most.
	g.Eventually(func() string {
		_ = c.Client.Get(ctx, client.ObjectKeyFromObject(q), q)
		return q.Status.Summary.Snapshots
	}).WithTimeout(30 * time.Second).Should(Equal("2/5 (1252Mi/2Gi)"))
}

// TestScheduledSnapshotsKeepTheNewest: a recurring snapshot (every minute, retention 2) makes a
// snapshot of its VM at each minute of its clock, one for several minutes missed, and keeps
// exactly the two newest Ready ones; deleted, it takes its snapshots along.
func TestScheduledSnapshotsKeepTheNewest(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	clk := clocktesting.NewFakePassiveClock(time.Now())
	start(t, c, func(r *impvmsnapshot.Reconciler) { r.Clock = clk })
	g := NewWithT(t)
	get, _ := getters(c, ns)
	node := runOnNode(t, c, createVM(t, c, ns))
	rec := &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "nightly"},
		Spec: impv1.ImpVMSnapshotSpec{VMName: "vm", Schedule: "* * * * *", Retention: ptr.To[int32](2)}}
	if err := c.Client.Create(ctx, rec); err != nil {
		t.Fatal(err)
	}
	bad := &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "bad"}, Spec: impv1.ImpVMSnapshotSpec{VMName: "vm", Schedule: "every day"}}
	if err := c.Client.Create(ctx, bad); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string { return get("bad").Status.Reason }).WithTimeout(30 * time.Second).Should(Equal(impv1.ReasonInvalidSchedule))
	g.Eventually(func() impv1.SnapshotPhase { return get("nightly").Status.Phase }).WithTimeout(30 * time.Second).Should(Equal(impv1.SnapshotScheduled))
	// The agent's part: each snapshot given to the node taken, each deleted one's files gone.
	children := func() []string {
		var l impv1.ImpVMSnapshotList
		_ = c.Client.List(ctx, &l, client.InNamespace(ns), client.MatchingLabels{impv1.ScheduleLabel: "nightly"})
		var out []string
		for i := range l.Items {
			s := &l.Items[i]
			switch {
			case !s.DeletionTimestamp.IsZero():
				s.Status.FilesRemoved = true
				_ = c.Client.Status().Update(ctx, s)
			case s.Status.NodeName == node && s.Status.Phase != impv1.SnapshotReady:
				s.Status.Phase, s.Status.Size = impv1.SnapshotReady, ptr.To(resource.MustParse("10Mi"))
				_ = c.Client.Status().Update(ctx, s)
			default:
				out = append(out, s.Name+"/"+string(s.Status.Phase))
			}
		}
		sort.Strings(out)
		return out
	}
	tick := func(d time.Duration) {
		clk.SetTime(clk.Now().Add(d))
		patch := fmt.Sprintf(`{"metadata":{"annotations":{"test/tick":%q}}}`, clk.Now().String())
		if err := c.Client.Patch(ctx, get("nightly"), client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
			t.Fatal(err)
		}
	}
	minute := func(n int) string {
		at := get("nightly").CreationTimestamp.Truncate(time.Minute).Add(time.Duration(n) * time.Minute)
		return fmt.Sprintf("nightly-%d/Ready", at.Unix())
	}
	var want []string
	for n := 1; n <= 4; n++ {
		tick(time.Minute)
		want = append(want, minute(n))
		if len(want) > 2 {
			want = want[1:]
		}
		g.Eventually(children).WithTimeout(30*time.Second).Should(Equal(want), "minute %d", n)
	}
	// Five minutes missed: one snapshot, for the last of them.
	tick(5 * time.Minute)
	g.Eventually(children).WithTimeout(30 * time.Second).Should(Equal([]string{minute(4), minute(9)}))
	g.Consistently(children).WithTimeout(2 * time.Second).Should(Equal([]string{minute(4), minute(9)}))
	if next := get("nightly").Status.NextScheduleTime; next == nil || next.Unix() != get("nightly").CreationTimestamp.Truncate(time.Minute).Add(10*time.Minute).Unix() {
		t.Errorf("next schedule time %v", next)
	}
	if err := c.Client.Delete(ctx, get("nightly")); err != nil {
		t.Fatal(err)
	}
	g.Eventually(children).WithTimeout(30 * time.Second).Should(BeEmpty())
	g.Eventually(func() *impv1.ImpVMSnapshot { return get("nightly") }).WithTimeout(30 * time.Second).Should(BeNil())
}

func start(t *testing.T, c *testcluster.Cluster, opts ...func(*impvmsnapshot.Reconciler)) {
	ctx := context.Background()
	mgr, err := ctrl.NewManager(c.As(t, testcluster.Operator), ctrl.Options{
		Scheme: c.Scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		Controller: config.Controller{SkipNameValidation: ptr.To(true)}, Cache: operator.CacheOptions(operator.Options{}),
	})
	if err != nil {
		t.Fatal(err)
	}
	r := &impvmsnapshot.Reconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader()}
	for _, o := range opts {
		o(r)
	}
	if err := r.SetupWithManager(ctx, mgr); err != nil {
		t.Fatal(err)
	}
	if err := (&impquota.Reconciler{Client: mgr.GetClient()}).SetupWithManager(mgr); err != nil {
		t.Fatal(err)
	}
	mctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = mgr.Start(mctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

func getters(c *testcluster.Cluster, ns string) (func(string) *impv1.ImpVMSnapshot, func(string) string) {
	ctx := context.Background()
	get := func(name string) *impv1.ImpVMSnapshot {
		s := &impv1.ImpVMSnapshot{}
		if err := c.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, s); err != nil {
			return nil
		}
		return s
	}
	state := func(name string) string {
		s := get(name)
		if s == nil {
			return "gone"
		}
		return string(s.Status.Phase) + "/" + s.Status.Reason + "/" + s.Status.NodeName
	}
	return get, state
}

func createVM(t *testing.T, c *testcluster.Cluster, ns string) *impv1.ImpVM {
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "vm"}, Spec: impv1.ImpVMSpec{Image: "registry.test/x:1",
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}}}
	if err := c.Client.Create(context.Background(), vm); err != nil {
		t.Fatal(err)
	}
	return vm
}

// runOnNode reports vm running on a new node, and returns the node.
func runOnNode(t *testing.T, c *testcluster.Cluster, vm *impv1.ImpVM) string {
	ctx := context.Background()
	node := "snap-node-" + vm.Namespace[len(vm.Namespace)-5:]
	if err := c.Client.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.Client.Delete(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}})
	})
	vm.Status.NodeName = node
	vm.Status.Resources = &impv1.ResolvedResources{VCPUs: 1, Memory: resource.MustParse("128Mi"), DiskSize: resource.MustParse("1Gi")}
	vm.Status.Runtime = &impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeRunning, GuestReady: true}
	if err := c.Client.Status().Update(ctx, vm); err != nil {
		t.Fatal(err)
	}
	return node
}
