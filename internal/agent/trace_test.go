package agent_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"go.opentelemetry.io/otel/trace"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/controller/impvm"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/testotlp"
	"github.com/syscode-labs/imp/internal/tracing"
)

// TestAVMStartIsOneTrace (docs/observability.md, "Traces"): the operator and the agent, each
// exporting over OTLP/gRPC to a collector, make a real guest's start one trace: the operator's
// root span from the VM seen to Ready, named by the VM's annotation; its placement; the agent's
// start, each step of its plan beneath it; the image fetched; the guest's boot, and beneath it
// the guest's own phases as imp-init says them. The root begins
// after the create and holds every other span of the start, and its children cover it within 10 %.
func TestAVMStartIsOneTrace(t *testing.T) {
	rx := testotlp.Start(t)
	provider := func(service string) trace.TracerProvider {
		tp, shutdown, err := tracing.Provider(context.Background(), tracing.Config{Endpoint: rx.GRPC, Protocol: tracing.ProtocolGRPC,
			Insecure: true, SampleRatio: 1}, service)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tracing.Flush(shutdown) })
		return tp
	}
	op := operator.Options{VM: impvm.DefaultOptions(), Concurrency: 2}
	op.VM.Traces = provider("imp-operator")
	w := newWorldWith(t, op, func(o *agent.Options) { o.Traces = provider("imp-agent") })
	ctx := context.Background()
	// The operator's root begins when it sees the VM: first, a VM it has seen (its finalizer
	// added), so that its cache's start is not counted as the traced VM's.
	seen := w.vm("seen")
	seen.Spec.NodeSelector = map[string]string{"imp.test/node": "none"}
	if err := w.c.Client.Create(ctx, seen); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Eventually(func() []string { return w.get("seen").Finalizers }).WithTimeout(time.Minute).ShouldNot(BeEmpty())
	vm := w.vm("traced", "serve")
	created := time.Now()
	if err := w.c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	g.Eventually(func() bool {
		v := w.get("traced")
		return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(5*time.Minute).WithPolling(20*time.Millisecond).Should(BeTrue(), func() string { return diagnose(w.c.Client, vm, func(string) string { return w.stateDir }) })
	sawReady := time.Since(created)
	v := w.get("traced")
	start := tracing.StartOf(v.UID, v.Annotations[tracing.Annotation], 1, 0)
	if v.Annotations[tracing.Annotation] != start.Annotation() {
		t.Errorf("the VM's annotation %q, want its first start's root %q", v.Annotations[tracing.Annotation], start.Annotation())
	}
	var spans []testotlp.Span
	g.Eventually(func() []string {
		spans = nil
		for _, s := range rx.Spans() {
			if s.TraceID == start.TraceID.String() {
				spans = append(spans, s)
			}
		}
		return names(spans)
	}).WithTimeout(time.Minute).Should(ContainElements(tracing.SpanStart, tracing.SpanPlace, tracing.SpanAgent, "imp.agent.start.exec",
		"imp.agent.start.writable_disk", tracing.SpanGuestBoot, "imp.guest.kernel", "imp.guest.disks", "imp.guest.workload"))
	byID := map[string]testotlp.Span{}
	for _, s := range spans {
		byID[s.SpanID] = s
		t.Logf("%-28s %-13s %6dms +%dms", s.Name, s.Service, s.End.Sub(s.Start).Milliseconds(), s.Start.Sub(created).Milliseconds())
	}
	root := byID[start.SpanID.String()]
	if root.Name != tracing.SpanStart || root.Parent != "" || root.Service != "imp-operator" || root.Attributes["imp.vm.name"] != "traced" {
		t.Fatalf("the root span %+v, want the operator's %s of VM traced with the start's IDs", root, tracing.SpanStart)
	}
	for _, s := range spans {
		want := map[string]string{tracing.SpanPlace: "imp-operator", tracing.SpanAgent: "imp-agent", tracing.SpanGuestBoot: "imp-agent",
			tracing.SpanFetch: "imp-agent"}[s.Name]
		switch {
		case s.SpanID == root.SpanID:
		case want != "":
			if s.Parent != root.SpanID || s.Service != want {
				t.Errorf("span %s: parent %s, service %s; want the root's child, of %s", s.Name, s.Parent, s.Service, want)
			}
		case strings.HasPrefix(s.Name, "imp.agent.start."):
			if byID[s.Parent].Name != tracing.SpanAgent {
				t.Errorf("step span %s's parent is %q, want %s", s.Name, byID[s.Parent].Name, tracing.SpanAgent)
			}
		case strings.HasPrefix(s.Name, tracing.SpanGuestOf):
			if boot := byID[s.Parent]; boot.Name != tracing.SpanGuestBoot || s.Start.Before(boot.Start) || s.End.After(boot.End) {
				t.Errorf("the guest's span %s (%v to %v) is not within the guest's boot %+v", s.Name, s.Start, s.End, boot)
			}
		default:
			t.Errorf("an unexpected span in the start's trace: %+v", s)
		}
		if s.Error != "" {
			t.Errorf("span %s reports an error: %s", s.Name, s.Error)
		}
	}
	for _, once := range []string{tracing.SpanStart, tracing.SpanPlace, tracing.SpanGuestBoot, "imp.agent.start.exec"} {
		if n := slices.Index(names(spans), once); n < 0 || slices.Contains(names(spans)[n+1:], once) {
			t.Errorf("span %s is not in the trace once: %v", once, names(spans))
		}
	}
	took := root.End.Sub(root.Start)
	t.Logf("the root lasts %v, from %v after the create; the test saw create → Ready in %v", took.Round(time.Millisecond),
		root.Start.Sub(created).Round(time.Millisecond), sawReady.Round(time.Millisecond))
	// The root spans the start: it begins after the create, before any of its descendants, and
	// ends after all of them (ordering, not a guess of time: the operator's queue and the
	// test's polling are not the trace's).
	if root.Start.Before(created) {
		t.Errorf("the root begins %v, before the VM was created at %v", root.Start, created)
	}
	var children []testotlp.Span
	for _, s := range spans {
		if s.Parent == root.SpanID {
			children = append(children, s)
		}
		if s.SpanID != root.SpanID && (s.Start.Before(root.Start) || s.End.After(root.End)) {
			t.Errorf("span %s (%v to %v) is not within the root (%v to %v)", s.Name, s.Start, s.End, root.Start, root.End)
		}
	}
	if covered := testotlp.Cover(children, root.Start, root.End); covered < took*9/10 {
		t.Errorf("the root's children cover %v of its %v", covered, took)
	}

	// Suspended and resumed: each a trace of its own, linked to the run's start, its plan's
	// steps beneath it.
	if err := w.c.Client.Create(ctx, &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "traced"},
		Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonUser, Message: "by the test"}}); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.VMPhase { return w.get("traced").Status.Phase }).WithTimeout(5 * time.Minute).Should(Equal(impv1.VMSuspended))
	if err := w.c.Client.Delete(ctx, &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "traced"}}); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool {
		return meta.IsStatusConditionTrue(w.get("traced").Status.Conditions, impv1.ReadyCondition) && w.get("traced").Status.Phase == impv1.VMRunning
	}).WithTimeout(5 * time.Minute).Should(BeTrue())
	for _, op := range []string{tracing.SpanSuspend, tracing.SpanResume} {
		var root testotlp.Span
		var steps []string
		g.Eventually(func() []string {
			steps = nil
			all := rx.Spans()
			for _, s := range all {
				if s.Name == op && s.Attributes["imp.vm.name"] == "traced" {
					root = s
				}
			}
			for _, s := range all {
				if root.SpanID != "" && s.Parent == root.SpanID && s.TraceID == root.TraceID {
					steps = append(steps, s.Name)
				}
			}
			return steps
		}).WithTimeout(time.Minute).ShouldNot(BeEmpty(), "the spans of %s", op)
		if root.Parent != "" || root.TraceID == start.TraceID.String() || len(root.Links) != 1 || root.Links[0] != start.SpanID.String() || root.Error != "" {
			t.Errorf("%s: %+v, want a root of its own trace linked to the start %v", op, root, start.SpanID)
		}
		plan := strings.TrimPrefix(op, "imp.agent.")
		for _, st := range steps {
			if !strings.HasPrefix(st, "imp.agent."+plan+".") {
				t.Errorf("%s has a child %s, want only the %s plan's steps", op, st, plan)
			}
		}
		t.Logf("%s: %dms, steps %v", op, root.End.Sub(root.Start).Milliseconds(), steps)
	}
}

func names(spans []testotlp.Span) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Name)
	}
	return out
}
