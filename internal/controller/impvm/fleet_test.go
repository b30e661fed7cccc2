package impvm

import (
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

func TestFleetRecordsHeartbeats(t *testing.T) {
	t0 := metav1.NewMicroTime(time.Unix(1000, 0))
	lease := func(ns, name, holder string, label bool) *coordinationv1.Lease {
		l := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(holder), RenewTime: &t0}}
		if label {
			l.Labels = map[string]string{impv1.AgentLeaseLabel: "true"}
		}
		return l
	}
	for _, tc := range []struct {
		name  string
		steps []*coordinationv1.Lease // recorded in turn; the last one deleted when gone
		gone  bool
		want  bool // node-a has a renewal
	}{
		{"its heartbeat", []*coordinationv1.Lease{lease("imp-system", "imp-agent-node-a", "node-a", true)}, false, true},
		{"deleted", []*coordinationv1.Lease{lease("imp-system", "imp-agent-node-a", "node-a", true)}, true, false},
		{"another namespace", []*coordinationv1.Lease{lease("tenant", "imp-agent-node-a", "node-a", true)}, false, false},
		{"held by another node", []*coordinationv1.Lease{lease("imp-system", "imp-agent-node-a", "node-b", true)}, false, false},
		{"without the label", []*coordinationv1.Lease{lease("imp-system", "imp-agent-node-a", "node-a", false)}, false, false},
		{"taken over by another holder", []*coordinationv1.Lease{
			lease("imp-system", "imp-agent-node-a", "node-a", true),
			lease("imp-system", "imp-agent-node-a", "node-b", true),
		}, false, false},
		{"another name", []*coordinationv1.Lease{lease("imp-system", "node-a", "node-a", true)}, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var f fleet
			record := f.recordLease("imp-system")
			for i, l := range tc.steps {
				record(l, tc.gone && i == len(tc.steps)-1)
			}
			if _, got := f.renewed["node-a"]; got != tc.want {
				t.Errorf("node-a has a renewal: %v, want %v", got, tc.want)
			}
		})
	}
}
