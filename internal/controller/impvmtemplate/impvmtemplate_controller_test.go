package impvmtemplate_test

import (
	"context"
	"os"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
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
	"github.com/syscode-labs/imp/internal/controller/impvmtemplate"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// TestFailedBuildsAreMadeAgain: a template with a nodeSelector makes its snapshot ahead of time
// on the node it selects (a builder VM pinned there, then a snapshot of it once Ready); a build
// whose snapshot failed is reported Failed with the snapshot's reason, kept a minute (by the
// controller's clock), then made again from a new builder.
func TestFailedBuildsAreMadeAgain(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	clk := clocktesting.NewFakeClock(time.Now())
	start(t, c, clk)
	g := NewWithT(t)
	node := "tmpl-node-" + ns[len(ns)-5:]
	if err := c.Client.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node, Labels: map[string]string{
		impv1.NodeEnabledLabel: impv1.NodeEnabledValue, "imp.test/ns": ns}}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.Client.Delete(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}})
	})
	tmpl := &impv1.ImpVMTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "web"}, Spec: impv1.ImpVMTemplateSpec{
		VM: impv1.ImpVMSpec{Image: "registry.test/app:1",
			Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}},
		NodeSelector: map[string]string{"imp.test/ns": ns}}}
	if err := c.Client.Create(ctx, tmpl); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string { return get(c, ns, "web", &impv1.ImpVMTemplate{}).Status.Revision }).WithTimeout(30 * time.Second).ShouldNot(BeEmpty())
	tmpl = get(c, ns, "web", &impv1.ImpVMTemplate{})
	name := impvmtemplate.BuildName(tmpl, tmpl.Status.Revision, node)

	// The builder: pinned to the node; made Ready here as its agent would.
	builder := func() *impv1.ImpVM { return get(c, ns, name, &impv1.ImpVM{}) }
	g.Eventually(builder).WithTimeout(30 * time.Second).ShouldNot(BeNil())
	first := builder()
	if first.Spec.NodeName != node {
		t.Errorf("builder on %q", first.Spec.NodeName)
	}
	ready := func(vm *impv1.ImpVM) {
		vm.Status.NodeName = node
		meta.SetStatusCondition(&vm.Status.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: impv1.ReasonGuestReady})
		if err := c.Client.Status().Update(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	ready(first)
	snapshot := func() *impv1.ImpVMSnapshot {
		return get(c, ns, name, &impv1.ImpVMSnapshot{})
	}
	g.Eventually(snapshot).WithTimeout(30 * time.Second).ShouldNot(BeNil())
	// The snapshot fails.
	snap := snapshot()
	snap.Status.Phase, snap.Status.Reason, snap.Status.Message = impv1.SnapshotFailed, impv1.ReasonSnapshotTakeFailed, "disk full"
	meta.SetStatusCondition(&snap.Status.Conditions, metav1.Condition{Type: impv1.SnapshotReadyCondition, Status: metav1.ConditionFalse, Reason: impv1.ReasonSnapshotTakeFailed})
	if err := c.Client.Status().Update(ctx, snap); err != nil {
		t.Fatal(err)
	}
	clk.SetTime(time.Now()) // the failure was recorded by the real clock: the minute counts from here
	status := func() string {
		s := get(c, ns, "web", &impv1.ImpVMTemplate{}).Status.Snapshots
		if len(s) != 1 {
			return "none"
		}
		return string(s[0].Phase) + ": " + s[0].Message
	}
	g.Eventually(status).WithTimeout(30 * time.Second).Should(Equal("Failed: ImpVMSnapshot " + name + " failed: SnapshotFailed: disk full"))
	// Kept for a minute, then made again.
	touch := func() {
		tm := get(c, ns, "web", &impv1.ImpVMTemplate{})
		tm.Annotations = map[string]string{"touched": clk.Now().String()}
		if err := c.Client.Update(ctx, tm); err != nil {
			t.Fatal(err)
		}
	}
	clk.Step(30 * time.Second)
	touch()
	g.Consistently(builder).WithTimeout(2 * time.Second).Should(HaveField("UID", first.UID))
	clk.Step(31 * time.Second)
	touch()
	g.Eventually(func() types.UID {
		if vm := builder(); vm != nil {
			return vm.UID
		}
		return ""
	}).WithTimeout(30 * time.Second).ShouldNot(Or(BeEmpty(), Equal(first.UID)))
	g.Eventually(status).WithTimeout(30 * time.Second).Should(HavePrefix("Building: its VM " + name + " is Pending"))
}

// get is the object of ns/name, nil when there is none.
func get[T client.Object](c *testcluster.Cluster, ns, name string, o T) T {
	if err := c.Client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, o); err != nil {
		var none T
		return none
	}
	return o
}

func start(t *testing.T, c *testcluster.Cluster, clk *clocktesting.FakeClock) {
	ctx := context.Background()
	mgr, err := ctrl.NewManager(c.As(t, testcluster.Operator), ctrl.Options{
		Scheme: c.Scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		Controller: config.Controller{SkipNameValidation: ptr.To(true)}, Cache: operator.CacheOptions(operator.Options{}),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := (&impvmtemplate.Reconciler{Client: mgr.GetClient(), Clock: clk}).SetupWithManager(mgr); err != nil {
		t.Fatal(err)
	}
	mctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = mgr.Start(mctx) }()
	t.Cleanup(func() { cancel(); <-done })
}
