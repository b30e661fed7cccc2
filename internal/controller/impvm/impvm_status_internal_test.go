package impvm

import (
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

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
