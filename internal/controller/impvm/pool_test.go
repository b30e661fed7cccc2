package impvm_test

import (
	"context"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// TestAPoolOutgrowsItsQuota (the whole operator, its placement and the agent double): a pool of
// 4 members of 1 vCPU in a namespace whose ImpQuota has 2 vCPUs makes 4 members, of which 2
// run and 2 wait QuotaExceeded; the pool stays short, says why in ReplicaFailure, and makes no
// more VMs; a raised quota runs the rest and clears the condition.
func TestAPoolOutgrowsItsQuota(t *testing.T) {
	e := newEnv(t)
	e.node("big", 16, 16)
	e.startAgent(nil)
	e.startOperator()
	e.create(e.quota("team", 2, "8Gi"))
	p := &impv1.ImpVMPool{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "web"}, Spec: impv1.ImpVMPoolSpec{
		Replicas: ptr.To[int32](4),
		Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}},
		Template: impv1.ImpVMPoolTemplate{Metadata: impv1.PoolMemberMetadata{Labels: map[string]string{"app": "web"}},
			Spec: e.vm("x", 1, "256Mi").Spec},
	}}
	e.create(p)
	pool := func() *impv1.ImpVMPool {
		out := &impv1.ImpVMPool{}
		_ = e.c.Get(context.Background(), client.ObjectKeyFromObject(p), out)
		return out
	}
	failure := func() string {
		c := meta.FindStatusCondition(pool().Status.Conditions, impv1.PoolReplicaFailureCondition)
		if c == nil || c.Status != metav1.ConditionTrue {
			return ""
		}
		return c.Reason + ": " + c.Message
	}
	eventually(t, func() int32 { return pool().Status.ReadyReplicas }).Should(Equal(int32(2)))
	eventually(t, failure).Should(And(HavePrefix(impv1.ReasonQuotaExceeded+": 2 members wait for quota"), ContainSubstring("ImpQuota team")))
	consistently(t, func() int { return len(e.list()) }, 2*time.Second).Should(Equal(4))
	g := NewWithT(t)
	g.Expect(pool().Status.Replicas).To(Equal(int32(4)))
	for _, vm := range e.list() {
		g.Expect(strings.HasPrefix(vm.Name, "web-")).To(BeTrue(), vm.Name)
	}

	e.setQuota("team", 8, "8Gi")
	eventually(t, func() int32 { return pool().Status.AvailableReplicas }).Should(Equal(int32(4)))
	eventually(t, failure).Should(BeEmpty())
}
