package runreport_test

import (
	"context"
	"os"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/runreport"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// TestEachWriterKeepsTheOthersFields: the run's watcher, the idle meter and the stand-in write
// status.runtime from copies of their own. The watcher's report (ReportRun) leaves the idle
// marks as they are; a mark (Mark) writes only its fields, and only on the version of the VM its
// writer read: a copy older than the API server's (a cache lagging a resume) writes nothing.
// A run's full report (Report) replaces everything, the marks included.
func TestEachWriterKeepsTheOthersFields(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: c.Namespace(t), Name: "vm"}, Spec: impv1.ImpVMSpec{Image: "registry.test/app:1",
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}}}
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	r := runreport.New(c.Client, -1)
	read := func() *impv1.ImpVM {
		t.Helper()
		v := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(vm), v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	if err := r.Report(ctx, read(), impv1.RuntimeStatus{Instance: 0, State: impv1.RuntimeRunning}); err != nil {
		t.Fatal(err)
	}
	since := metav1.NewTime(time.Now().Truncate(time.Second))
	stale := read()
	fresh := read()
	if err := r.Mark(ctx, fresh, func(rt *impv1.RuntimeStatus) { rt.IdleSince = &since }); err != nil {
		t.Fatal(err)
	}
	if got := read().Status.Runtime; got.IdleSince == nil || got.State != impv1.RuntimeRunning {
		t.Fatalf("after the meter's mark: %+v", got)
	}

	// The watcher reports the guest ready from what it knows, which has no idle mark.
	watcher := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: vm.Name}}
	if err := r.ReportRun(ctx, watcher, impv1.RuntimeStatus{Instance: 0, State: impv1.RuntimeRunning, GuestReady: true}); err != nil {
		t.Fatal(err)
	}
	if got := read().Status.Runtime; !got.GuestReady || got.IdleSince == nil || !got.IdleSince.Equal(&since) {
		t.Errorf("the watcher's report dropped the meter's mark: %+v", got)
	}

	// A mark on a copy read before: refused, nothing written.
	now := metav1.Now()
	err := r.Mark(ctx, stale, func(rt *impv1.RuntimeStatus) { rt.WakeRequested = &now })
	if !apierrors.IsConflict(err) {
		t.Errorf("a mark on a stale copy: %v; want a Conflict", err)
	}
	if got := read().Status.Runtime; got.WakeRequested != nil || !got.GuestReady {
		t.Errorf("a stale mark wrote: %+v", got)
	}

	// A new run's report replaces the whole runtime, marks included.
	if err := r.Report(ctx, read(), impv1.RuntimeStatus{Instance: 0, Run: 1, State: impv1.RuntimeRunning}); err != nil {
		t.Fatal(err)
	}
	if got := read().Status.Runtime; got.IdleSince != nil || got.GuestReady || got.Run != 1 {
		t.Errorf("a new run's report kept the last run's fields: %+v", got)
	}
}
