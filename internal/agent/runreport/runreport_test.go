package runreport

import (
	"encoding/json"
	"reflect"
	"testing"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// TestRuntimePatchReplacesTheWholeReport: every field of status.runtime the report leaves unset
// is named null in the patch, so nothing of an earlier run's report (its readiness, its exit)
// survives into the next.
func TestRuntimePatchReplacesTheWholeReport(t *testing.T) {
	p, err := RuntimePatch(impv1.RuntimeStatus{Instance: 1, Run: 2, State: impv1.RuntimeRunning})
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Status struct {
			Runtime map[string]any `json:"runtime"`
		} `json:"status"`
	}
	if err := json.Unmarshal(p, &got); err != nil {
		t.Fatal(err)
	}
	rt := reflect.TypeFor[impv1.RuntimeStatus]()
	if len(got.Status.Runtime) != rt.NumField() {
		t.Fatalf("the patch names %d fields of %d: %s", len(got.Status.Runtime), rt.NumField(), p)
	}
	for _, f := range []string{"ready", "exitCode", "guestReady", "reason"} {
		if v, ok := got.Status.Runtime[f]; !ok || v != nil {
			t.Errorf("%s: %v, %v; want null", f, v, ok)
		}
	}
}
