package impwarmpool

import (
	"testing"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// TestHandedOver: a member is deleted only once its claim's node reported on the placement that
// names it, or the claim was placed otherwise; never while the binding's write is on its way
// (the claim, in the operator's cache, does not name the member yet).
func TestHandedOver(t *testing.T) {
	warm := &impv1.WarmStatus{Pool: "p", Member: "p-1", MemberUID: "m1"}
	for name, c := range map[string]struct {
		st   impv1.ImpVMStatus
		want bool
	}{
		"binding on its way":           {impv1.ImpVMStatus{}, false},
		"bound, not reported yet":      {impv1.ImpVMStatus{Instance: 1, Start: impv1.StartWarm, Warm: warm}, false},
		"bound, an older run's report": {impv1.ImpVMStatus{Instance: 2, Start: impv1.StartWarm, Warm: warm, Runtime: &impv1.RuntimeStatus{Instance: 1}}, false},
		"handed over":                  {impv1.ImpVMStatus{Instance: 1, Start: impv1.StartWarm, Warm: warm, Runtime: &impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeRunning}}, true},
		"handover failed":              {impv1.ImpVMStatus{Instance: 1, Start: impv1.StartWarm, Warm: warm, Runtime: &impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeExited}}, true},
		"placed again, restored":       {impv1.ImpVMStatus{Instance: 2, Start: impv1.StartRestored}, true},
		"bound to another member":      {impv1.ImpVMStatus{Instance: 1, Start: impv1.StartWarm, Warm: &impv1.WarmStatus{MemberUID: "m2"}}, true},
	} {
		claim := &impv1.ImpVM{Status: c.st}
		if got := handedOver(claim, "m1"); got != c.want {
			t.Errorf("%s: handedOver = %v, want %v", name, got, c.want)
		}
	}
}
