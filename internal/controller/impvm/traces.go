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
// reconcile that placed it. What it keeps is one entry a VM whose start is under way, gone
// when it ends or the VM does.
type startTraces struct {
	tracer trace.Tracer // nil: no traces

	mu      sync.Mutex
	pending map[types.UID]pendingStart
}

// pendingStart is a start whose root span is not ended yet.
type pendingStart struct {
	instance int64
	run      int32
	began    time.Time
	placed   bool // its placement's span is recorded
}

// annotate sets the VM's trace annotation when it has none (in the write that adds its
// finalizer): the traceparent of its first start's root span. It reports whether it did.
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

// seen notes that the operator sees the VM's next start (not yet placed, or a new run about
// to be published) at now, unless it noted it already.
func (t *startTraces) seen(vm *impv1.ImpVM, instance int64, run int32, now time.Time) {
	if t.tracer == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.pending == nil {
		t.pending = map[types.UID]pendingStart{}
	}
	if p, ok := t.pending[vm.UID]; ok && p.instance == instance && p.run == run {
		return
	}
	t.pending[vm.UID] = pendingStart{instance: instance, run: run, began: now}
}

// placed records the reconcile, begun at began, that published the VM's current run (its
// placement, or a restart), with its status write, as a child of the run's start.
func (t *startTraces) placed(ctx context.Context, vm *impv1.ImpVM, began, now time.Time) {
	if t.tracer == nil {
		return
	}
	t.seen(vm, vm.Status.Instance, vm.Status.RestartCount, began)
	t.mu.Lock()
	p := t.pending[vm.UID]
	again := p.placed
	p.placed = true
	t.pending[vm.UID] = p
	t.mu.Unlock()
	if again {
		return // a reconcile from a cache that had not seen the placement wrote it again
	}
	_, sp := tracing.RunSpan(ctx, t.tracer, vm, tracing.SpanPlace, trace.WithTimestamp(began))
	sp.End(trace.WithTimestamp(now))
}

// ended ends the root span of the VM's current start, if it is pending: at Ready (ok), or as
// the run failed before it (reason).
func (t *startTraces) ended(ctx context.Context, vm *impv1.ImpVM, now time.Time, reason string) {
	if t.tracer == nil {
		return
	}
	t.mu.Lock()
	p, ok := t.pending[vm.UID]
	if ok && p.instance == vm.Status.Instance && p.run == vm.Status.RestartCount {
		delete(t.pending, vm.UID)
	} else {
		ok = false
	}
	t.mu.Unlock()
	if !ok {
		return // not seen to start by this operator (it restarted meanwhile): no root of its own
	}
	s := tracing.StartOf(vm.UID, vm.Annotations[tracing.Annotation], vm.Status.Instance, vm.Status.RestartCount)
	_, sp := s.Root(ctx, t.tracer, p.began, trace.WithAttributes(tracing.VMAttributes(vm)...),
		trace.WithAttributes(attribute.String("imp.vm.start", string(vm.Status.Start))))
	if reason != "" {
		sp.SetStatus(codes.Error, reason)
	}
	sp.End(trace.WithTimestamp(now))
}

// forget drops what is kept of the VM (deleted).
func (t *startTraces) forget(uid types.UID) {
	if t.tracer == nil {
		return
	}
	t.mu.Lock()
	delete(t.pending, uid)
	t.mu.Unlock()
}

// observe is the reconcile's part, once its status is written: the start it saw published
// (placed), or the Ready (or failure) it saw of the current run.
func (t *startTraces) observe(ctx context.Context, orig, vm *impv1.ImpVM, began, now time.Time) {
	if t.tracer == nil {
		return
	}
	st, was := vm.Status, orig.Status
	if st.NodeName == "" {
		t.seen(vm, st.Instance+1, 0, began) // placed next as instance+1, run 0
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
