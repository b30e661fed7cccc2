package impvm_test

import (
	"context"
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// TestProbesDecideReadinessAndRestarts: a running VM whose guest is ready is Ready only while
// its run's readiness verdict passes; a run its liveness probe killed is a failure, restarted
// under RerunOnFailure even when the workload exited 0 after SIGTERM, with the probe in the
// Event.
func TestProbesDecideReadinessAndRestarts(t *testing.T) {
	e := newEnv(t)
	e.node("n", 4, 4)
	e.startAgent(nil)
	e.startOperator()
	vm := e.vm("web", 1, "256Mi")
	vm.Spec.RunStrategy = impv1.RunStrategyRerunOnFailure
	e.create(vm)
	ready := func() string {
		c := condition(e.get("web"), impv1.ReadyCondition)
		if c == nil {
			return ""
		}
		return string(c.Status) + "/" + c.Reason
	}
	eventually(t, ready).Should(Equal("True/" + impv1.ReasonGuestReady))

	setRuntime := func(f func(rt *impv1.RuntimeStatus)) {
		t.Helper()
		cur := e.get("web")
		orig := cur.DeepCopy()
		f(cur.Status.Runtime)
		if err := e.c.Status().Patch(context.Background(), cur, client.MergeFrom(orig)); err != nil {
			t.Fatal(err)
		}
	}
	setRuntime(func(rt *impv1.RuntimeStatus) {
		rt.Ready, rt.Message = ptr.To(false), "the readiness probe fails: HTTP 503"
	})
	eventually(t, ready).Should(Equal("False/" + impv1.ReasonNotServing))
	if c := condition(e.get("web"), impv1.ReadyCondition); c.Message != "the readiness probe fails: HTTP 503" {
		t.Errorf("Ready's message %q", c.Message)
	}
	setRuntime(func(rt *impv1.RuntimeStatus) { rt.Ready = ptr.To(true) })
	eventually(t, ready).Should(Equal("True/" + impv1.ReasonGuestReady))

	setRuntime(func(rt *impv1.RuntimeStatus) {
		now := metav1.Now()
		rt.State, rt.FinishedAt, rt.ExitCode = impv1.RuntimeExited, &now, ptr.To(int32(0))
		rt.Reason, rt.Message = impv1.ReasonLivenessProbeFailed, "the liveness probe failed: dial tcp 127.0.0.1:8080: connection refused"
	})
	eventually(t, func() int32 { return e.get("web").Status.RestartCount }).Should(Equal(int32(1)))
	eventually(t, ready).Should(Equal("True/" + impv1.ReasonGuestReady))
	const want = "Restarting (restart 1) after the workload exited: the liveness probe failed: dial tcp 127.0.0.1:8080: connection refused (exit code 0)"
	eventually(t, func() bool {
		var l corev1.EventList
		if err := e.c.List(context.Background(), &l, client.InNamespace(e.ns)); err != nil {
			return false
		}
		for _, ev := range l.Items {
			if ev.Reason == "Restarting" && ev.Message == want {
				return true
			}
		}
		return false
	}).Should(BeTrue(), "a Restarting Event naming the liveness probe")
}
