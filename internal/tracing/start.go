package tracing

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// Annotation, on an ImpVM, is the W3C traceparent of its first start's root span, written by the
// operator when the VM is first seen (so that a user or a tool finds the trace from the
// object). Whoever created the VM may have set it first, naming a span of their own: the first
// start's root then links to that span. It is tenant-writable and trusted for nothing but that
// link: a malformed one is ignored, and it chooses neither the start's trace nor its sampling
// (the trace ID derives from the VM's UID, which the API server chose).
const Annotation = "imp.dev/trace-context"

// Span names of a VM's start (docs/observability.md lists them with their attributes).
const (
	SpanStart     = "imp.vm.start"         // the root: the operator's, from the VM seen to Ready
	SpanPlace     = "imp.operator.place"   // the reconcile that placed the run, with its write
	SpanAgent     = "imp.agent.start"      // the agent's start of the run: its plan
	SpanGuestBoot = "imp.agent.guest_boot" // the VMM started to the guest's agent ready
	// A plan's steps are "imp.agent.<plan>.<step>": imp.agent.start.network (package plan).
	SpanFetch = "imp.agent.image_fetch" // the image fetched off the workers, in its parts
	// The guest's part, beneath SpanGuestBoot, as it says it: "imp.guest.firmware" (the VMM's
	// start to the kernel's), "imp.guest.kernel" (the kernel's start to imp-init's), then
	// "imp.guest.<phase>" for each of guestinit.BootPhases.
	SpanGuestOf = "imp.guest."
)

// Start is one start of a VM: its first (instance 1, run 0) or a later run. Its IDs are derived
// from the VM's UID, instance and run, so that the operator and the agent name the same trace
// and root span without telling each other, and nobody else chooses them.
type Start struct {
	TraceID trace.TraceID
	SpanID  trace.SpanID // the root span's
	// Creator is the span the VM's creator named in its annotation, which a first start's root
	// links to.
	Creator trace.SpanContext
	// First links a later run to its VM's first start.
	First trace.SpanContext
}

// StartOf is the start of run run of instance instance of the VM uid, whose annotation is
// annotation ("" when it has none).
func StartOf(uid types.UID, annotation string, instance int64, run int32) Start {
	tid, sid := derive(uid, instance, run)
	s := Start{TraceID: tid, SpanID: sid}
	if instance > 1 || run != 0 {
		s.First = StartOf(uid, annotation, 1, 0).SpanContext()
		return s
	}
	if sc := parse(annotation); sc.IsValid() && (sc.TraceID() != tid || sc.SpanID() != sid) {
		s.Creator = sc // not the operator's own annotation of this root
	}
	return s
}

// derive is the trace and span IDs of a start: a hash of what names it.
func derive(uid types.UID, instance int64, run int32) (trace.TraceID, trace.SpanID) {
	h := sha256.New()
	h.Write([]byte("imp.dev/trace/v1\x00"))
	h.Write([]byte(uid))
	var b [12]byte
	binary.BigEndian.PutUint64(b[:8], uint64(instance))
	binary.BigEndian.PutUint32(b[8:], uint32(run))
	h.Write(b[:])
	sum := h.Sum(nil)
	var tid trace.TraceID
	var sid trace.SpanID
	copy(tid[:], sum[:16])
	copy(sid[:], sum[16:24])
	return tid, sid
}

// maxAnnotation bounds what is parsed of an annotation: a traceparent is 55 characters.
const maxAnnotation = 256

// parse reads a traceparent with OpenTelemetry's W3C propagator; anything it rejects (or
// anything longer than maxAnnotation) is no span.
func parse(v string) trace.SpanContext {
	if v == "" || len(v) > maxAnnotation {
		return trace.SpanContext{}
	}
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{"traceparent": v})
	return trace.SpanContextFromContext(ctx)
}

// SpanContext is the start's root span, as its children in another process see it.
func (s Start) SpanContext() trace.SpanContext {
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: s.TraceID, SpanID: s.SpanID,
		TraceFlags: trace.FlagsSampled, Remote: true})
}

// Annotation is the traceparent naming the start's root span (what the operator writes).
func (s Start) Annotation() string {
	c := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(trace.ContextWithSpanContext(context.Background(), s.SpanContext()), c)
	return c["traceparent"]
}

// Context is ctx with the start's root span as the parent of what is started in it: the
// agent's spans of a run.
func (s Start) Context(ctx context.Context) context.Context {
	return trace.ContextWithRemoteSpanContext(ctx, s.SpanContext())
}

// Root starts the start's root span itself, with its derived IDs, begun at began (the
// operator's, ended at Ready). The returned context carries it, for children.
func (s Start) Root(ctx context.Context, t trace.Tracer, began time.Time, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	pctx := context.WithValue(ctx, fixedKey{}, fixedIDs{s.TraceID, s.SpanID})
	opts = append(opts, trace.WithNewRoot())
	for _, l := range []trace.SpanContext{s.Creator, s.First} {
		if l.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: l}))
		}
	}
	_, span := t.Start(pctx, SpanStart, append(opts, trace.WithTimestamp(began))...)
	return trace.ContextWithSpan(ctx, span), span
}

// fixedIDs are the IDs the next span started in a context gets (a start's root).
type fixedIDs struct {
	trace trace.TraceID
	span  trace.SpanID
}

type fixedKey struct{}

// idGenerator gives a span started by Root its derived IDs, and any other random ones.
type idGenerator struct{}

func (idGenerator) NewIDs(ctx context.Context) (trace.TraceID, trace.SpanID) {
	if f, ok := ctx.Value(fixedKey{}).(fixedIDs); ok {
		return f.trace, f.span
	}
	var tid trace.TraceID
	_, _ = rand.Read(tid[:])
	return tid, newSpanID()
}

func (idGenerator) NewSpanID(ctx context.Context, tid trace.TraceID) trace.SpanID {
	if f, ok := ctx.Value(fixedKey{}).(fixedIDs); ok && f.trace == tid {
		return f.span
	}
	return newSpanID()
}

func newSpanID() trace.SpanID {
	var sid trace.SpanID
	_, _ = rand.Read(sid[:])
	return sid
}

// Instrumentation scopes of the two processes' tracers.
const (
	OperatorScope = "github.com/syscode-labs/imp/internal/controller/impvm"
	AgentScope    = "github.com/syscode-labs/imp/internal/agent"
)

// VMAttributes names the VM and its run on a span: identifiers only, never what the VM's spec
// or its guest carries.
func VMAttributes(vm *impv1.ImpVM) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.String("k8s.namespace.name", vm.Namespace), attribute.String("imp.vm.name", vm.Name),
		attribute.String("imp.vm.uid", string(vm.UID)), attribute.Int64("imp.vm.instance", vm.Status.Instance),
		attribute.Int("imp.vm.run", int(vm.Status.RestartCount)), attribute.String("k8s.node.name", vm.Status.NodeName),
	}
}

// Remote is ctx with the span traceparent names as a remote parent (a run's start, as its
// record on the node keeps it); ctx as it is when traceparent is not one.
func Remote(ctx context.Context, traceparent string) context.Context {
	if sc := parse(traceparent); sc.IsValid() {
		return trace.ContextWithRemoteSpanContext(ctx, sc)
	}
	return ctx
}

// RunSpan starts span name of the start of vm's current run, a child of its root.
func RunSpan(ctx context.Context, t trace.Tracer, vm *impv1.ImpVM, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	s := StartOf(vm.UID, vm.Annotations[Annotation], vm.Status.Instance, vm.Status.RestartCount)
	return t.Start(s.Context(ctx), name, append(opts, trace.WithAttributes(VMAttributes(vm)...))...)
}

// Trace is the traceparent of the start of vm's current run (what its record on the node keeps).
func Trace(vm *impv1.ImpVM) string {
	return StartOf(vm.UID, vm.Annotations[Annotation], vm.Status.Instance, vm.Status.RestartCount).Annotation()
}

// GuestBoot records a run's guest boot, a child of ctx's span: from its VMM's start to its
// guest's ready (host times), and beneath it the guest's part as boot says it, placed on the
// host's clock from ready backwards and held within the boot (the guest's word: its phases can
// say nothing outside it).
func GuestBoot(ctx context.Context, t trace.Tracer, started, ready time.Time, boot *guestinit.Boot, attrs ...attribute.KeyValue) {
	ctx, sp := t.Start(ctx, SpanGuestBoot, trace.WithTimestamp(started), trace.WithAttributes(attrs...))
	if boot != nil {
		at := func(us uint64) time.Time {
			h := ready.Add(-time.Duration(boot.Ready-min(us, boot.Ready)) * time.Microsecond)
			if h.Before(started) {
				return started
			}
			return h
		}
		span := func(name string, from, to uint64) {
			_, c := t.Start(ctx, SpanGuestOf+name, trace.WithTimestamp(at(from)))
			c.End(trace.WithTimestamp(at(to)))
		}
		if k := at(0); k.After(started) { // the VMM's own start: its firmware, the kernel loaded
			_, c := t.Start(ctx, SpanGuestOf+"firmware", trace.WithTimestamp(started))
			c.End(trace.WithTimestamp(k))
		}
		span("kernel", 0, boot.Init)
		for _, p := range boot.Phases {
			span(p.Name, p.Start, p.End)
		}
	}
	sp.End(trace.WithTimestamp(ready))
}
