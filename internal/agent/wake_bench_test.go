package agent_test

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
)

// TestBenchWake is `make bench-wake`, skipped otherwise (IMP_BENCH=wake): for a 256 MiB guest
// serving TCP on an ImpNetwork (QEMU/TCG), the first request to it while it is suspended
// because it was idle → the first byte of its answer (the request made once, from the
// network's gateway), beside the same request to it running and beside its plain resume (the
// floor: the agent's resume plan, and a person's resume seen through the API: the suspension
// deleted → the run reported running); and the memory a suspension gives back. Each wake's
// suspension is the idle controller's, after the VM's suspendAfter (10 s) without a request.
// It prints the figures beside the target (wake ≤ resume P50 + 50 ms, no failed request) and
// asserts none.
func TestBenchWake(t *testing.T) {
	if os.Getenv("IMP_BENCH") != "wake" {
		t.Skip("a benchmark: make bench-wake")
	}
	const rounds = 10
	w, pins := netWorld(t, "10.94.0.0/24", func(o *agent.Options) { o.IdleInterval = 500 * time.Millisecond })
	c, ns, ctx := w.c, w.ns, context.Background()
	g := NewWithT(t)
	vm := w.vm("wake", "net")
	vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	vm.Spec.Resources.Memory = ptr.To(resource.MustParse("256Mi"))
	g.Expect(c.Client.Create(ctx, vm)).To(Succeed())
	phase := func() impv1.VMPhase { return w.get("wake").Status.Phase }
	g.Eventually(phase).WithTimeout(15 * time.Minute).WithPolling(100 * time.Millisecond).Should(Equal(impv1.VMRunning))
	ip := w.get("wake").Status.IP
	g.Eventually(func() (string, error) { return dialOnce(pins, ip) }).WithTimeout(3 * time.Minute).Should(Equal("hello from wake"))

	request := func() (time.Duration, error) {
		began := time.Now()
		out, err := dialOnce(pins, ip)
		if err == nil && out != "hello from wake" {
			err = fmt.Errorf("answered %q", out)
		}
		return time.Since(began), err
	}
	var running []time.Duration
	for range 20 {
		d, err := request()
		g.Expect(err).NotTo(HaveOccurred())
		running = append(running, d)
	}
	suspend := func(reason string) {
		g.Expect(c.Client.Create(ctx, &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "wake"},
			Spec: impv1.ImpVMSuspensionSpec{Reason: reason, Message: "by the bench"}})).To(Succeed())
		g.Eventually(phase).WithTimeout(5 * time.Minute).WithPolling(20 * time.Millisecond).Should(Equal(impv1.VMSuspended))
	}
	runningAgain := func() {
		g.Eventually(func() bool {
			v := w.get("wake")
			return v.Status.Suspension == nil && v.Status.Runtime != nil && v.Status.Runtime.State == impv1.RuntimeRunning
		}).WithTimeout(5 * time.Minute).WithPolling(5 * time.Millisecond).Should(BeTrue())
	}
	gone := func() {
		g.Eventually(func() bool {
			return client.IgnoreNotFound(c.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "wake"}, &impv1.ImpVMSuspension{})) == nil &&
				c.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "wake"}, &impv1.ImpVMSuspension{}) != nil
		}).WithTimeout(time.Minute).Should(BeTrue())
	}

	// The floor: a person's resume, and the first request after it.
	var throughAPI, afterResume []time.Duration
	var released string
	for range rounds {
		suspend(impv1.SuspendReasonUser)
		if m := w.get("wake").Status.Suspension.MemoryReleased; m != nil {
			released = m.String()
		}
		began := time.Now()
		g.Expect(c.Client.Delete(ctx, &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "wake"}})).To(Succeed())
		runningAgain()
		throughAPI = append(throughAPI, time.Since(began))
		d, err := request()
		g.Expect(err).NotTo(HaveOccurred())
		afterResume = append(afterResume, d)
		gone()
	}
	plans := resumePlans(t, c.Client, ns, "wake")

	// The wake: suspended by the idle controller after 10 s without a request, a request.
	v := w.get("wake")
	v.Spec.Idle = &impv1.IdlePolicy{SuspendAfter: metav1.Duration{Duration: 10 * time.Second}}
	g.Expect(c.Client.Update(ctx, v)).To(Succeed())
	var woken, agentPart []time.Duration
	failed := 0
	for range rounds {
		before := wakeSum(t)
		g.Eventually(phase).WithTimeout(5 * time.Minute).WithPolling(20 * time.Millisecond).Should(Equal(impv1.VMSuspended))
		time.Sleep(300 * time.Millisecond) // its stand-in takes the tap after the report
		d, err := request()
		if err != nil {
			failed++
			t.Logf("a request to the idle-suspended VM failed after %v: %v", d, err)
		}
		woken = append(woken, d)
		runningAgain()
		agentPart = append(agentPart, wakeSum(t)-before)
		gone()
	}
	floor := pct(plans, 50)
	verdict := "met"
	if pct(woken, 50) > floor+50*time.Millisecond || failed > 0 {
		verdict = "NOT met"
	}
	fmt.Printf("wake (a 256 MiB guest, QEMU/TCG, %d rounds each)\n", rounds)
	fmt.Printf("  first request to the idle-suspended VM → first byte  P50 %v  P99 %v  failed %d of %d\n", pct(woken, 50), pct(woken, 99), failed, rounds)
	fmt.Printf("  the same request to it running                      P50 %v  P99 %v\n", pct(running, 50), pct(running, 99))
	fmt.Printf("  its resume: the agent's plan (the floor)            P50 %v  P99 %v\n", floor, pct(plans, 99))
	fmt.Printf("  its resume by a person: suspension deleted → running seen through the API  P50 %v  P99 %v\n", pct(throughAPI, 50), pct(throughAPI, 99))
	fmt.Printf("  the first request after such a resume (the guest's own, TCG's code cache empty)  P50 %v  P99 %v\n", pct(afterResume, 50), pct(afterResume, 99))
	fmt.Printf("  the agent's part of a wake: first frame held → held frames sent to the running guest  P50 %v  P99 %v\n", pct(agentPart, 50), pct(agentPart, 99))
	fmt.Printf("  memory a suspension gives back: %s\n", released)
	fmt.Printf("  target: wake P50 ≤ resume P50 + 50 ms (%v), no failed request: %s\n", floor+50*time.Millisecond, verdict)
	fmt.Printf("  the same with the guest's first answer after a resume on both sides: wake P50 %v ≤ %v: %v\n",
		pct(woken, 50), floor+pct(afterResume, 50)+50*time.Millisecond, pct(woken, 50) <= floor+pct(afterResume, 50)+50*time.Millisecond && failed == 0)
}

// wakeSum is the sum of imp_agent_vm_wake_duration_seconds so far.
func wakeSum(t *testing.T) time.Duration {
	mfs, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "imp_agent_vm_wake_duration_seconds" {
			return time.Duration(mf.GetMetric()[0].GetHistogram().GetSampleSum() * float64(time.Second))
		}
	}
	return 0
}

// resumePlans are the resume plans' durations the VM's Resumed Events give ("resumed in 127ms").
func resumePlans(t *testing.T, c client.Client, ns, name string) []time.Duration {
	var events corev1.EventList
	if err := c.List(context.Background(), &events, client.InNamespace(ns)); err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`resumed in ([0-9.]+m?s)`)
	var out []time.Duration
	for _, e := range events.Items {
		if e.InvolvedObject.Name != name || e.Reason != "Resumed" {
			continue
		}
		if m := re.FindStringSubmatch(e.Message); m != nil {
			if d, err := time.ParseDuration(m[1]); err == nil {
				out = append(out, d)
			}
		}
	}
	return out
}
