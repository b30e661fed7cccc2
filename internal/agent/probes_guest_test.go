package agent_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestsession"
)

// TestProbesInTheGuest: a real guest with no network runs its probes in imp-init. Its HTTP
// readiness probe (a named port) keeps the VM not Ready until the workload serves, takes it out
// when /healthz fails and back when it passes; its exec liveness probe failing kills the
// workload, and runStrategy Always restarts the VM with an Unhealthy Event and the probe in the
// restart's reason.
func TestProbesInTheGuest(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	vm := w.vm("web", "web")
	vm.Spec.Ports = []impv1.VMPort{{Name: "http", Port: 8080, Protocol: corev1.ProtocolTCP}}
	vm.Spec.ReadinessProbe = &impv1.Probe{
		ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromString("http")}},
		PeriodSeconds: 1, FailureThreshold: 1, SuccessThreshold: 1, TimeoutSeconds: 1,
	}
	vm.Spec.LivenessProbe = &impv1.Probe{
		ProbeHandler:  corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"/bin/hello", "tool-absent", "/dev/imp-dead"}}},
		PeriodSeconds: 1, FailureThreshold: 2, SuccessThreshold: 1, TimeoutSeconds: 1,
		TerminationGracePeriodSeconds: ptr.To[int64](5),
	}
	if err := w.c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	ready := func() string {
		v := w.get("web")
		if v == nil || v.Status.Runtime == nil {
			return "absent"
		}
		c := meta.FindStatusCondition(v.Status.Conditions, impv1.ReadyCondition)
		if c == nil {
			return "none"
		}
		return fmt.Sprintf("%d/%s/%s", v.Status.RestartCount, c.Status, c.Reason)
	}
	g.Eventually(ready).WithTimeout(9*time.Minute).WithPolling(100*time.Millisecond).Should(Equal("0/True/GuestReady"), func() string {
		return fmt.Sprintf("runtime %+v", *w.get("web").Status.Runtime)
	})
	v := w.get("web")
	exec := func(args ...string) {
		t.Helper()
		s, err := w.agent.Runs.Session(types.NamespacedName{Namespace: v.Namespace, Name: v.Name}, v.UID)
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := s.Exec(ctx, guestsession.ExecOptions{Command: append([]string{"/bin/hello"}, args...), Stdout: &out, Stderr: &out}); err != nil {
			t.Fatalf("exec %v: %v: %s", args, err, out.String())
		}
	}

	exec("tool-touch", "/dev/imp-unready")
	began := time.Now()
	g.Eventually(ready).WithTimeout(time.Minute).WithPolling(50 * time.Millisecond).Should(Equal("0/False/" + impv1.ReasonNotServing))
	t.Logf("a failing readiness probe (period 1s) made the VM not Ready in %v", time.Since(began).Round(time.Millisecond))
	if m := meta.FindStatusCondition(w.get("web").Status.Conditions, impv1.ReadyCondition).Message; m != "the readiness probe fails: HTTP probe failed with status 503: unready" {
		t.Errorf("Ready's message %q", m)
	}
	exec("tool-rm", "/dev/imp-unready")
	g.Eventually(ready).WithTimeout(time.Minute).WithPolling(50 * time.Millisecond).Should(Equal("0/True/GuestReady"))

	exec("tool-touch", "/dev/imp-dead") // devtmpfs: gone with the reboot
	g.Eventually(ready).WithTimeout(9*time.Minute).WithPolling(100*time.Millisecond).Should(Equal("1/True/GuestReady"), func() string {
		return fmt.Sprintf("runtime %+v", *w.get("web").Status.Runtime)
	})
	var events corev1.EventList
	g.Eventually(func() map[string]string {
		_ = w.c.Client.List(ctx, &events, client.InNamespace(w.ns))
		got := map[string]string{}
		for _, e := range events.Items {
			if e.InvolvedObject.Name == "web" {
				got[e.Reason] = e.Message
			}
		}
		return got
	}).WithTimeout(time.Minute).Should(And(
		HaveKeyWithValue("Unhealthy", "The liveness probe failed, so the guest kills the workload: command \"/bin/hello\" exited with 1: /dev/imp-dead exists"),
		HaveKeyWithValue("Restarting", ContainSubstring("the liveness probe failed: command \"/bin/hello\" exited with 1: /dev/imp-dead exists (exit code 0)")),
	))
}
