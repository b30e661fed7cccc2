package impvm

import (
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
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
			if _, renewed := f.agent("node-a"); (renewed != nil) != tc.want {
				got := renewed != nil
				t.Errorf("node-a has a renewal: %v, want %v", got, tc.want)
			}
		})
	}
}

// TestFleetListsTheNodes: the list placement walks holds every node with a Node, with what its
// agent reported and renewed, whatever the order the three arrive in; a node whose Node goes
// leaves it, and what its agent still says is kept for when it comes back.
func TestFleetListsTheNodes(t *testing.T) {
	var f fleet
	node := func(name string) *corev1.Node { return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}} }
	report := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: "b"}}
	f.recordReport(report, false) // before its Node
	f.recordNode(node("a"), false)
	f.recordNode(node("b"), false)
	f.recordNode(node("c"), false)
	f.recordNode(node("c"), true)
	got := map[string]*impv1.ImpNode{}
	f.each(func(n *corev1.Node, r *impv1.ImpNode, _ *metav1.MicroTime) { got[n.Name] = r })
	if len(got) != 2 || got["b"] != report || got["a"] != nil || f.len() != 2 {
		t.Fatalf("nodes %v (len %d); want a, and b with its report", got, f.len())
	}
	f.recordNode(node("b"), true)
	if r, _ := f.agent("b"); r != report || f.len() != 1 {
		t.Errorf("after b's Node went: its report %v, len %d", r, f.len())
	}
	f.recordReport(report, true)
	if r, _ := f.agent("b"); r != nil || len(f.byName) != 1 {
		t.Errorf("after b's report went: %v, %d entries", r, len(f.byName))
	}
}
