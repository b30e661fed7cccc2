package impvm

import (
	"context"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/tracing"
)

// startTraces are the operator's part of the VMs' start traces (package tracing): the root
// span of each start, from when the operator saw the run to start to Ready, and the span of the
// reconcile that placed it. What it keeps is one entry a VM (by name) whose start is under way,
// gone when the start ends, another replaces it, or the VM goes.
type startTraces struct {
	tracer trace.Tracer // nil: no traces

	mu      sync.Mutex
	pending map[types.NamespacedName]pendingStart
}

// pendingStart is a start whose root span is not ended yet.
type pendingStart struct {
	uid        types.UID
	annotation string
	instance   int64
	run        int32
	began      time.Time
	placed     bool // its placement's span is recorded
}

// annotate sets the VM's trace annotation when it has none: the traceparent of its first
// start's root span. It reports whether it did (the caller writes it, with the finalizer when
// it adds that).
func (t *startTraces) annotate(vm *impv1.ImpVM) bool {
	if t.tracer == nil {
		return false
	}
	if _, ok := vm.Annotations[tracing.Annotation]; ok {
		return false
	}
	if vm.Annotations == nil {
		vm.Annotations = map[string]string{}
	}
	vm.Annotations[tracing.Annotation] = tracing.StartOf(vm.UID, "", 1, 0).Annotation()
	return true
}

// seen notes that the operator sees the VM's start (instance, run) at now, unless it noted it
// already; a start of the VM still pending is replaced, its root ended as Superseded.
func (t *startTraces) seen(ctx context.Context, vm *impv1.ImpVM, instance int64, run int32, now time.Time) {
	key := types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}
	t.mu.Lock()
	if t.pending == nil {
		t.pending = map[types.NamespacedName]pendingStart{}
	}
	p, ok := t.pending[key]
	if ok && p.uid == vm.UID && p.instance == instance && p.run == run {
		t.mu.Unlock()
		return
	}
	t.pending[key] = pendingStart{uid: vm.UID, annotation: vm.Annotations[tracing.Annotation], instance: instance, run: run, began: now}
	t.mu.Unlock()
	if ok {
		t.root(ctx, key, p, now, "Superseded")
	}
}

// placed records the reconcile, begun at began, that published the VM's current run (its
// placement, or a restart), with its status write, as a child of the run's start; once a run.
func (t *startTraces) placed(ctx context.Context, vm *impv1.ImpVM, began, now time.Time) {
	t.seen(ctx, vm, vm.Status.Instance, vm.Status.RestartCount, began)
	key := types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}
	t.mu.Lock()
	p := t.pending[key]
	again := p.placed
	p.placed = true
	t.pending[key] = p
	t.mu.Unlock()
	if again {
		return // a reconcile from a cache that had not seen the placement wrote it again
	}
	_, sp := tracing.RunSpan(ctx, t.tracer, vm, tracing.SpanPlace, trace.WithTimestamp(began))
	sp.End(trace.WithTimestamp(now))
}

// ended ends the root span of the VM's current start, if it is pending: at Ready (reason ""),
// or as the run failed before it (its reason).
func (t *startTraces) ended(ctx context.Context, vm *impv1.ImpVM, now time.Time, reason string) {
	key := types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}
	t.mu.Lock()
	p, ok := t.pending[key]
	ok = ok && p.uid == vm.UID && p.instance == vm.Status.Instance && p.run == vm.Status.RestartCount
	if ok {
		delete(t.pending, key)
	}
	t.mu.Unlock()
	if ok { // else not seen to start by this operator (it restarted meanwhile): no root of its own
		t.root(ctx, key, p, now, reason)
	}
}

// root records the root span of start p of the VM key, ended at now (with an error status when
// reason is not empty).
func (t *startTraces) root(ctx context.Context, key types.NamespacedName, p pendingStart, now time.Time, reason string) {
	s := tracing.StartOf(p.uid, p.annotation, p.instance, p.run)
	_, sp := s.Root(ctx, t.tracer, p.began, trace.WithAttributes(attribute.String("k8s.namespace.name", key.Namespace),
		attribute.String("imp.vm.name", key.Name), attribute.String("imp.vm.uid", string(p.uid)),
		attribute.Int64("imp.vm.instance", p.instance), attribute.Int("imp.vm.run", int(p.run))))
	if reason != "" {
		sp.SetStatus(codes.Error, reason)
	}
	sp.End(trace.WithTimestamp(now))
}

// forget drops what is kept of the VM key (deleted, or gone).
func (t *startTraces) forget(key types.NamespacedName) {
	if t.tracer == nil {
		return
	}
	t.mu.Lock()
	delete(t.pending, key)
	t.mu.Unlock()
}

// observe is the reconcile's part, once its status is written: the start it saw coming (the VM
// not placed yet) or published (placed), or the Ready (or failure) it saw of the current run.
func (t *startTraces) observe(ctx context.Context, orig, vm *impv1.ImpVM, began, now time.Time) {
	if t.tracer == nil {
		return
	}
	st, was := vm.Status, orig.Status
	if st.NodeName == "" {
		t.seen(ctx, vm, st.Instance+1, st.RestartCount, began) // placed next as the next instance
		return
	}
	if st.Instance != was.Instance || st.RestartCount != was.RestartCount {
		t.placed(ctx, vm, began, now)
	}
	wasReady := meta.IsStatusConditionTrue(orig.Status.Conditions, impv1.ReadyCondition)
	switch rt := st.Runtime; {
	case meta.IsStatusConditionTrue(st.Conditions, impv1.ReadyCondition) && !wasReady:
		t.ended(ctx, vm, now, "")
	case rt != nil && rt.Instance == st.Instance && rt.Run == st.RestartCount && rt.State == impv1.RuntimeExited:
		t.ended(ctx, vm, now, rt.Reason)
	}
}
