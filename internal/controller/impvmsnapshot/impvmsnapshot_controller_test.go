package impvmsnapshot_test

import (
	"context"
	"os"
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
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
	mgr, err := ctrl.NewManager(c.As(t, testcluster.Operator), ctrl.Options{
		Scheme: c.Scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		Controller: config.Controller{SkipNameValidation: ptr.To(true)}, Cache: operator.CacheOptions(operator.Options{}),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := (&impvmsnapshot.Reconciler{Client: mgr.GetClient()}).SetupWithManager(ctx, mgr); err != nil {
		t.Fatal(err)
	}
	mctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = mgr.Start(mctx) }()
	t.Cleanup(func() { cancel(); <-done })

	g := NewWithT(t)
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

	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "vm"}, Spec: impv1.ImpVMSpec{Image: "registry.test/x:1",
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}}}
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string { return state("a") }).WithTimeout(30 * time.Second).Should(Equal("Pending/VMNotRunning/"))
	node := "snap-node-" + ns[len(ns)-5:]
	if err := c.Client.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}); err != nil {
		t.Fatal(err)
	}
	vm.Status.NodeName = node
	vm.Status.Runtime = &impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeRunning, GuestReady: true}
	if err := c.Client.Status().Update(ctx, vm); err != nil {
		t.Fatal(err)
	}
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
