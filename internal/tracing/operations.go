package tracing

import (
	"context"
	"crypto/sha256"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Span names of what happens to a VM's run after its start (docs/observability.md): each is
// the root of a trace of its own, linked to the start of the run it acts on; the plan's steps
// are its children ("imp.agent.<plan>.<step>"). A warm pool member handed to a claim is the
// claim's start (SpanAgent, its plan "handover"); a restore is a start (its plan "restore").
const (
	SpanSuspend = "imp.agent.suspend" // the run's memory saved, its VMM ended
	SpanResume  = "imp.agent.resume"  // imp.vm.woken: a connection held for it woke it
	// A migration is one trace on both nodes: the source's sending is its root, the target's
	// preparing its child (their IDs derive from the ImpVMMigration's UID).
	SpanMigrateOut = "imp.agent.migrate_out"
	SpanMigrateIn  = "imp.agent.migrate_in"
)

// Operation starts the root span name of an operation on vm's current run: a trace of its
// own (sampled at the configured ratio), linked to the run's start, with the VM's attributes
// and attrs.
func Operation(ctx context.Context, t trace.Tracer, vm *impv1.ImpVM, name string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	start := StartOf(vm.UID, vm.Annotations[Annotation], vm.Status.Instance, vm.Status.RestartCount)
	return t.Start(ctx, name, trace.WithNewRoot(), trace.WithLinks(trace.Link{SpanContext: start.SpanContext()}),
		trace.WithAttributes(append(VMAttributes(vm), attrs...)...))
}

// Migration is the trace of migration uid (an ImpVMMigration's UID, which the API server
// chose): its trace ID and its root span's (the source's) ID, derived, so that the source's and
// the target's agents name the same trace without telling each other.
func Migration(uid types.UID) Start {
	sum := sha256.Sum256(append([]byte("imp.dev/trace/migration/v1\x00"), uid...))
	var s Start
	copy(s.TraceID[:], sum[:16])
	copy(s.SpanID[:], sum[16:24])
	return s
}

// MigrationSpan starts the span of one side of migration uid of vm: the source's is the
// migration's root, with its derived IDs; the target's is its child. Both link to the start of
// the VM's run.
func MigrationSpan(ctx context.Context, t trace.Tracer, vm *impv1.ImpVM, uid types.UID, source bool) (context.Context, trace.Span) {
	m := Migration(uid)
	start := StartOf(vm.UID, vm.Annotations[Annotation], vm.Status.Instance, vm.Status.RestartCount)
	opts := []trace.SpanStartOption{trace.WithLinks(trace.Link{SpanContext: start.SpanContext()}),
		trace.WithAttributes(append(VMAttributes(vm), attribute.String("imp.migration.uid", string(uid)))...)}
	if !source {
		return t.Start(m.Context(ctx), SpanMigrateIn, opts...)
	}
	pctx := context.WithValue(ctx, fixedKey{}, fixedIDs{m.TraceID, m.SpanID})
	_, span := t.Start(pctx, SpanMigrateOut, append(opts, trace.WithNewRoot())...)
	return trace.ContextWithSpan(ctx, span), span
}
