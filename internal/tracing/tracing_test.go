package tracing_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/testotlp"
	"github.com/syscode-labs/imp/internal/tracing"
)

// TestStartsAreNamedAlike (docs/security.md): the operator and the agent derive one start's
// trace and root span from the VM alone; the operator's annotation names that root; a creator's
// annotation is only linked from the first start's root, never its parent, and chooses none of
// its IDs; later runs are traces of their own, linked to the first; what is not a traceparent is
// ignored.
func TestStartsAreNamedAlike(t *testing.T) {
	first := tracing.StartOf("uid-1", "", 1, 0)
	if again := tracing.StartOf("uid-1", "", 1, 0); !same(again, first) || !first.TraceID.IsValid() || !first.SpanID.IsValid() {
		t.Fatalf("two derivations of one start differ or are invalid: %+v %+v", first, again)
	}
	if ours := tracing.StartOf("uid-1", first.Annotation(), 1, 0); !same(ours, first) {
		t.Errorf("the operator's own annotation changed the start: %+v, want %+v", ours, first)
	}
	if other := tracing.StartOf("uid-2", "", 1, 0); other.TraceID == first.TraceID || other.SpanID == first.SpanID {
		t.Error("two VMs' first starts share IDs")
	}
	creator := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	joined := tracing.StartOf("uid-1", creator, 1, 0)
	if joined.TraceID != first.TraceID || joined.SpanID != first.SpanID || joined.Creator.SpanID().String() != "b7ad6b7169203331" {
		t.Errorf("a creator's traceparent: %+v, want the derived IDs, the creator's span linked", joined)
	}
	later := tracing.StartOf("uid-1", creator, 1, 1)
	if later.TraceID == joined.TraceID || later.Creator.IsValid() || later.First.SpanID() != joined.SpanID {
		t.Errorf("a later run: %+v, want a trace of its own linked to the first start's root %v", later, joined.SpanID)
	}
	if moved := tracing.StartOf("uid-1", "", 2, 0); moved.TraceID == first.TraceID {
		t.Error("a new placement shares its first start's trace")
	}
	for _, bad := range []string{
		"garbage", "00-00000000000000000000000000000000-b7ad6b7169203331-01", "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
		"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
		strings.Repeat("0", 4096), "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" + strings.Repeat("-x", 200),
	} {
		if got := tracing.StartOf("uid-1", bad, 1, 0); !same(got, first) {
			t.Errorf("annotation %.60q changed the start: %+v", bad, got)
		}
	}
}

// TestExportOverBothProtocols: spans reach a collector over OTLP/gRPC and OTLP/HTTP with the
// headers of the headers file; a root started by Start.Root has the start's IDs, and its
// children (another process's, from the annotation alone) are its children; a sample ratio of
// 0 exports nothing, and a traceparent flagged sampled cannot ask for more.
func TestExportOverBothProtocols(t *testing.T) {
	rx := testotlp.Start(t)
	headers := filepath.Join(t.TempDir(), "headers")
	if err := os.WriteFile(headers, []byte("# the collector's token\nAuthorization: Bearer t0ken\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, c := range []struct{ protocol, endpoint, header string }{
		{tracing.ProtocolGRPC, rx.GRPC, "authorization"},
		{tracing.ProtocolHTTP, rx.HTTP, "Authorization"},
	} {
		tp, shutdown, err := tracing.Provider(ctx, tracing.Config{Endpoint: c.endpoint, Protocol: c.protocol, Insecure: true,
			HeadersFile: headers, SampleRatio: 1}, "imp-test")
		if err != nil {
			t.Fatal(err)
		}
		uid := "uid-" + c.protocol
		start := tracing.StartOf(types.UID(uid), "", 1, 1) // a later run: its root links the first's
		_, child := tp.Tracer("t").Start(start.Context(ctx), "child", trace.WithAttributes(attribute.String("s", "v\xff"),
			attribute.Int64("i", -7), attribute.Bool("b", true), attribute.Float64("f", 0.5)))
		child.SetStatus(codes.Error, "ImagePullFailed")
		child.End()
		_, root := start.Root(ctx, tp.Tracer("t"), time.Now().Add(-time.Second))
		root.End()
		tracing.Flush(shutdown)
		var gotRoot, gotChild bool
		for _, s := range rx.Spans() {
			switch {
			case s.Name == tracing.SpanStart && s.TraceID == start.TraceID.String():
				gotRoot = s.SpanID == start.SpanID.String() && s.Parent == "" && s.Service == "imp-test" && s.End.Sub(s.Start) >= time.Second &&
					len(s.Links) == 1 && s.Links[0] == start.First.SpanID().String() && s.Error == ""
			case s.Name == "child" && s.TraceID == start.TraceID.String():
				gotChild = s.Parent == start.SpanID.String() && s.Error == "ImagePullFailed" && s.Attributes["s"] == "v?" &&
					s.Attributes["i"] == "-7" && s.Attributes["b"] == "true" && s.Attributes["f"] == "0.5"
				if !gotChild {
					t.Logf("%s: the child as received: %+v", c.protocol, s)
				}
			}
		}
		if !gotRoot || !gotChild {
			t.Errorf("%s: root with the start's IDs %v, its child %v: %+v", c.protocol, gotRoot, gotChild, rx.Spans())
		}
		if got := rx.Headers()[c.header]; got != "Bearer t0ken" {
			t.Errorf("%s: the export's %s header is %q", c.protocol, c.header, got)
		}
	}

	before := len(rx.Spans())
	tp, shutdown, err := tracing.Provider(ctx, tracing.Config{Endpoint: rx.GRPC, Insecure: true, SampleRatio: 0}, "imp-test")
	if err != nil {
		t.Fatal(err)
	}
	sampled := trace.ContextWithRemoteSpanContext(ctx, trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}, TraceFlags: trace.FlagsSampled, Remote: true}))
	_, sp := tp.Tracer("t").Start(sampled, "asked for")
	sp.End()
	_, root := tracing.StartOf("uid-0", "", 1, 0).Root(ctx, tp.Tracer("t"), time.Now())
	root.End()
	tracing.Flush(shutdown)
	if got := rx.Spans()[before:]; len(got) != 0 {
		t.Errorf("ratio 0 exported %+v", got)
	}

	// A tenant's annotation naming a trace every ratio samples (its low bytes zero), flagged
	// sampled, on a VM whose own start a ratio of 1/2 does not sample: nothing is exported.
	tp, shutdown, err = tracing.Provider(ctx, tracing.Config{Endpoint: rx.GRPC, Insecure: true, SampleRatio: 0.5}, "imp-test")
	if err != nil {
		t.Fatal(err)
	}
	byID := tracing.Sampler(0.5)
	var vm types.UID
	for i := 0; vm == ""; i++ {
		st := tracing.StartOf(types.UID(fmt.Sprint("uid-", i)), "", 1, 0)
		if byID.ShouldSample(sdktrace.SamplingParameters{ParentContext: ctx, TraceID: st.TraceID}).Decision == sdktrace.Drop {
			vm = types.UID(fmt.Sprint("uid-", i))
		}
	}
	forced := "00-0af7651916cd43dd0000000000000000-b7ad6b7169203331-01"
	before = len(rx.Spans())
	start := tracing.StartOf(vm, forced, 1, 0)
	_, child := tp.Tracer("t").Start(start.Context(ctx), "child")
	child.End()
	_, root = start.Root(ctx, tp.Tracer("t"), time.Now())
	root.End()
	tracing.Flush(shutdown)
	if got := rx.Spans()[before:]; len(got) != 0 {
		t.Errorf("an annotation forced %d spans out at ratio 1/2: %+v", len(got), got)
	}
}

// TestOperationsAreTracesOfTheirOwn: a suspend (or resume) of a run is a trace of its own,
// linked to the run's start; a migration is one trace on two nodes, the source's span its root
// with IDs derived from the migration's UID alone and the target's its child, each linked to
// the VM's start; two migrations share nothing.
func TestOperationsAreTracesOfTheirOwn(t *testing.T) {
	rx := testotlp.Start(t)
	ctx := context.Background()
	source, shutdownS, err := tracing.Provider(ctx, tracing.Config{Endpoint: rx.HTTP, Protocol: tracing.ProtocolHTTP, Insecure: true, SampleRatio: 1}, "imp-agent-a")
	if err != nil {
		t.Fatal(err)
	}
	target, shutdownT, err := tracing.Provider(ctx, tracing.Config{Endpoint: rx.HTTP, Protocol: tracing.ProtocolHTTP, Insecure: true, SampleRatio: 1}, "imp-agent-b")
	if err != nil {
		t.Fatal(err)
	}
	// Its creator's annotation names a trace of theirs: none of the operations' spans join it.
	foreign := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "vm", UID: "uid-op", Annotations: map[string]string{tracing.Annotation: foreign}},
		Status: impv1.ImpVMStatus{Instance: 1}}
	start := tracing.StartOf(vm.UID, "", 1, 0) // its first start: the annotation is its creator's link there
	_, sp := tracing.Operation(ctx, source.Tracer("t"), vm, tracing.SpanSuspend)
	sp.End()
	_, in := tracing.MigrationSpan(ctx, target.Tracer("t"), vm, "mig-1", false) // the target may begin first
	sctx, out := tracing.MigrationSpan(ctx, source.Tracer("t"), vm, "mig-1", true)
	_, step := source.Tracer("t").Start(sctx, "imp.agent.migrate.step")
	step.End()
	out.End()
	in.End()
	tracing.Flush(shutdownS)
	tracing.Flush(shutdownT)
	got := map[string]testotlp.Span{}
	for _, s := range rx.Spans() {
		got[s.Name] = s
		if s.TraceID == "0af7651916cd43dd8448eb211c80319c" || s.Parent == "b7ad6b7169203331" || slices.Contains(s.Links, "b7ad6b7169203331") {
			t.Errorf("span %s joined the annotation's trace: %+v", s.Name, s)
		}
	}
	mig := tracing.Migration("mig-1")
	sus, o, i, st := got[tracing.SpanSuspend], got[tracing.SpanMigrateOut], got[tracing.SpanMigrateIn], got["imp.agent.migrate.step"]
	if sus.TraceID == "" || sus.TraceID == start.TraceID.String() || sus.Parent != "" || len(sus.Links) != 1 || sus.Links[0] != start.SpanID.String() ||
		sus.Attributes["imp.vm.name"] != "vm" {
		t.Errorf("the suspend: %+v, want a root of its own trace linked to the run's start %v", sus, start.SpanID)
	}
	if o.TraceID != mig.TraceID.String() || o.SpanID != mig.SpanID.String() || o.Parent != "" || o.Service != "imp-agent-a" ||
		len(o.Links) != 1 || o.Links[0] != start.SpanID.String() {
		t.Errorf("the source's span: %+v, want the migration's root %v/%v", o, mig.TraceID, mig.SpanID)
	}
	if i.TraceID != o.TraceID || i.Parent != o.SpanID || i.Service != "imp-agent-b" || len(i.Links) != 1 {
		t.Errorf("the target's span: %+v, want a child of the source's %v", i, o.SpanID)
	}
	if st.TraceID != o.TraceID || st.Parent != o.SpanID || st.SpanID == o.SpanID {
		t.Errorf("a step of the sending: %+v, want a child of the source's span with an ID of its own", st)
	}
	if other := tracing.Migration("mig-2"); other.TraceID == mig.TraceID || other.SpanID == mig.SpanID {
		t.Error("two migrations share IDs")
	}
}

// TestBadConfigurations are refused at start, with what is wrong.
func TestBadConfigurations(t *testing.T) {
	big := filepath.Join(t.TempDir(), "big")
	if err := os.WriteFile(big, []byte(strings.Repeat("a: b\n", 8<<10)), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		conf tracing.Config
		want string
	}{
		{tracing.Config{Endpoint: "x:4317", Protocol: "zipkin"}, "protocol"},
		{tracing.Config{Endpoint: "x:4317", SampleRatio: 2}, "sample ratio"},
		{tracing.Config{Endpoint: "x:4317", HeadersFile: big, SampleRatio: 1}, "over"},
		{tracing.Config{Endpoint: "x:4317", CAFile: big, SampleRatio: 1}, "no PEM"},
	} {
		if _, _, err := tracing.Provider(context.Background(), c.conf, "imp-test"); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error saying %q", c.conf, err, c.want)
		}
	}
	tp, _, err := tracing.Provider(context.Background(), tracing.Config{}, "imp-test")
	if err != nil {
		t.Fatal(err)
	}
	if _, sp := tp.Tracer("t").Start(context.Background(), "x"); sp.IsRecording() {
		t.Error("with no endpoint, spans are recorded")
	}
}

func same(a, b tracing.Start) bool {
	return a.TraceID == b.TraceID && a.SpanID == b.SpanID && a.Creator.Equal(b.Creator) && a.First.Equal(b.First)
}
