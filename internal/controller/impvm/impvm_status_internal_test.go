package impvm

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

type countingRecorder map[string]int

func (c countingRecorder) Eventf(_, _ runtime.Object, _, reason, _, _ string, _ ...interface{}) {
	c[reason]++
}

// TestAWaitIsToldOnce: a reconcile that read a copy of the VM older than the operator's own
// last status patch (the condition just written not in it) does not tell the same wait again;
// a new reason, a wait after a placement, and a new VM of the same name each are told. The same
// holds for a phase, and a VM gone is forgotten.
func TestAWaitIsToldOnce(t *testing.T) {
	rec := countingRecorder{}
	r := &Reconciler{Recorder: rec}
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "a", UID: "1"}}
	wait := func(reason, old string) {
		r.recordTransition(&scope{vm: vm, oldPhase: vm.Status.Phase, schedReason: reason, schedMsg: "m", oldSchedReason: old})
	}
	steps := []struct {
		what        string
		reason, old string
		uid         string
		want        int
	}{
		{"the first wait", impv1.ReasonQuotaExceeded, "", "1", 1},
		{"a stale copy without its condition", impv1.ReasonQuotaExceeded, "", "1", 1},
		{"an up-to-date copy", impv1.ReasonQuotaExceeded, impv1.ReasonQuotaExceeded, "1", 1},
		{"another reason", impv1.ReasonNoNodeAvailable, impv1.ReasonQuotaExceeded, "1", 2},
		{"a stale copy showing the reason before", impv1.ReasonNoNodeAvailable, impv1.ReasonQuotaExceeded, "1", 2},
		{"placed", "", impv1.ReasonNoNodeAvailable, "1", 2},
		{"waiting again after a placement", impv1.ReasonNoNodeAvailable, "", "1", 3},
		{"a new VM of the same name", impv1.ReasonNoNodeAvailable, "", "2", 4},
	}
	for _, st := range steps {
		vm.UID = types.UID(st.uid)
		wait(st.reason, st.old)
		if got := rec["Unschedulable"]; got != st.want {
			t.Fatalf("%s: %d Unschedulable Events in all, want %d", st.what, got, st.want)
		}
	}
	// A phase: told once though a stale copy shows the phase before; again once it changed
	// and came back; again for a VM of that name made anew after the first was gone.
	phase := func(old, now impv1.VMPhase) {
		vm.Status.Phase = now
		r.recordTransition(&scope{vm: vm, oldPhase: old})
	}
	for _, st := range []struct {
		what     string
		old, now impv1.VMPhase
		want     int
	}{
		{"stopped", impv1.VMRunning, impv1.VMStopped, 1},
		{"a stale copy showing it running", impv1.VMRunning, impv1.VMStopped, 1},
		{"stopping again", impv1.VMStopped, impv1.VMStopping, 1},
		{"stopped again", impv1.VMStopping, impv1.VMStopped, 2},
	} {
		phase(st.old, st.now)
		if got := rec["Stopped"]; got != st.want {
			t.Fatalf("%s: %d Stopped Events in all, want %d", st.what, got, st.want)
		}
	}
	r.announced.forget(types.NamespacedName{Namespace: "ns", Name: "a"})
	phase(impv1.VMRunning, impv1.VMStopped)
	if got := rec["Stopped"]; got != 3 {
		t.Fatalf("a VM of the name made anew: %d Stopped Events in all, want 3", got)
	}
}

// TestStatusPatchIsMergeFroms: the status patch built from the statuses alone is the patch
// client.MergeFrom makes of the whole objects, for each kind of change a reconcile makes
// (a field set, one cleared, a condition added and one changed, a list emptied), with the
// agent's status.runtime and the metadata and spec, which differ from nothing, left out.
func TestStatusPatchIsMergeFroms(t *testing.T) {
	now := metav1.Now()
	base := &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "a", UID: "1", Labels: map[string]string{"app": "x"}, Finalizers: []string{impv1.VMFinalizer}},
		Spec:       impv1.ImpVMSpec{Image: "example.com/img@sha256:" + strings.Repeat("a", 64)},
		Status: impv1.ImpVMStatus{Phase: impv1.VMPending, Runtime: &impv1.RuntimeStatus{State: impv1.RuntimeRunning, Message: "the agent's"},
			Conditions: []metav1.Condition{{Type: impv1.ScheduledCondition, Status: metav1.ConditionFalse, Reason: "NoRoom", LastTransitionTime: now}}},
	}
	for name, change := range map[string]func(vm *impv1.ImpVM){
		"placed": func(vm *impv1.ImpVM) {
			vm.Status.NodeName = "node-1"
			meta.SetStatusCondition(&vm.Status.Conditions, metav1.Condition{Type: impv1.ScheduledCondition, Status: metav1.ConditionTrue, Reason: impv1.ReasonPlaced, Message: "placed"})
		},
		"running": func(vm *impv1.ImpVM) {
			vm.Status.Phase = impv1.VMRunning
			meta.SetStatusCondition(&vm.Status.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: impv1.ReasonAgentReady})
		},
		"conditions emptied": func(vm *impv1.ImpVM) { vm.Status.Conditions = nil },
		"phase cleared":      func(vm *impv1.ImpVM) { vm.Status.Phase = "" },
		"nothing":            func(*impv1.ImpVM) {},
	} {
		t.Run(name, func(t *testing.T) {
			vm := base.DeepCopy()
			change(vm)
			want, err := client.MergeFrom(base).Data(vm)
			if err != nil {
				t.Fatal(err)
			}
			p, err := statusPatch(base, vm)
			if err != nil {
				t.Fatal(err)
			}
			if string(p) != string(want) {
				t.Errorf("status patch %s, MergeFrom's %s", p, want)
			}
		})
	}
}

// BenchmarkStatusPatch: the placement's status patch of a VM as the API server returns it
// (managed fields of its creator, the operator and its agent), built from the statuses
// (statusPatch) and from the whole objects (client.MergeFrom, which it replaced).
func BenchmarkStatusPatch(b *testing.B) {
	orig := &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{Namespace: "run", Name: "vm-0001", UID: "6a1f0c1e-3f1d-4c59-9d0e-0d3c9d1e2f3a", ResourceVersion: "123456",
			Labels: map[string]string{"app": "bench"}, Finalizers: []string{impv1.VMFinalizer}},
		Spec: impv1.ImpVMSpec{Image: "127.0.0.1:5000/hello@sha256:" + strings.Repeat("a", 64), Command: []string{"/bin/hello"}, Args: []string{"serve"}},
	}
	for _, m := range []string{"kubectl-client-side-apply", "imp-operator", "imp-agent"} {
		orig.ManagedFields = append(orig.ManagedFields, metav1.ManagedFieldsEntry{Manager: m, Operation: metav1.ManagedFieldsOperationUpdate, APIVersion: "imp.dev/v1alpha1",
			FieldsType: "FieldsV1", FieldsV1: &metav1.FieldsV1{Raw: []byte(`{"f:metadata":{"f:labels":{".":{},"f:app":{}}},"f:spec":{".":{},"f:args":{},"f:command":{},"f:image":{},"f:resources":{".":{},"f:memory":{},"f:vcpus":{}}},"f:status":{".":{},"f:conditions":{".":{},"k:{\"type\":\"Scheduled\"}":{".":{},"f:lastTransitionTime":{},"f:message":{},"f:reason":{},"f:status":{},"f:type":{}}},"f:phase":{}}}`)}})
	}
	vm := orig.DeepCopy()
	vm.Status.NodeName = "node-042"
	vm.Status.Phase = impv1.VMScheduled
	meta.SetStatusCondition(&vm.Status.Conditions, metav1.Condition{Type: impv1.ScheduledCondition, Status: metav1.ConditionTrue, Reason: impv1.ReasonPlaced, Message: "placed on node node-042"})
	b.Run("statuses", func(b *testing.B) {
		for b.Loop() {
			if _, err := statusPatch(orig, vm); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("MergeFrom", func(b *testing.B) {
		for b.Loop() {
			if _, err := client.MergeFrom(orig).Data(vm); err != nil {
				b.Fatal(err)
			}
		}
	})
}
