package agent

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/tracing"
)

var (
	suspendSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "imp_agent_vm_suspend_duration_seconds", Help: "Time to save a VM's state and stop its VMM.",
		Buckets: prometheus.ExponentialBuckets(0.1, 2, 10)})
	resumeSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "imp_agent_vm_resume_duration_seconds", Help: "Time to start a VM's VMM from its saved state until the guest runs.",
		Buckets: prometheus.ExponentialBuckets(0.1, 2, 10)})
	memoryReclaimed = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "imp_agent_memory_reclaimed_bytes_total", Help: "Guest memory given back to the node by suspending VMs."})
	suspendFailures = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "imp_agent_vm_suspend_failures_total", Help: "Suspensions that failed and left the VM running."})
)

func init() {
	metrics.Registry.MustRegister(suspendSeconds, resumeSeconds, memoryReclaimed, suspendFailures)
}

// suspendFailed says whether the run's last suspension failed: the agent does not try again
// until the suspension is withdrawn and asked for anew.
func suspendFailed(rt *impv1.RuntimeStatus) bool {
	return rt != nil && rt.State == impv1.RuntimeRunning && rt.Reason == impv1.ReasonSuspendFailed
}

// suspend runs the suspend plan on the VM's current run: its memory and device state saved in
// its state directory, its VMM ended; disks, tap and address stay. On failure the VM keeps
// running and says why. A run whose VMM ended meanwhile (an agent stopped while suspending) is
// suspended if its state was saved, and ended if not.
func (a *Agent) suspend(ctx context.Context, vm *impv1.ImpVM, dir string, m *vmrun.Meta, rec *vmm.Record) error {
	s := &vmrun.Suspend{VM: vm, Dir: dir, Meta: m, Record: rec, Runtime: *vm.Status.Runtime}
	if !s.Alive() && (m == nil || !a.drivers.For(string(m.VMM)).Saved(vm, dir, m)) {
		rt := s.Runtime
		now := metav1.Now()
		rt.State, rt.FinishedAt, rt.GuestReady, rt.Reason, rt.Message = impv1.RuntimeExited, &now, false, impv1.ReasonSuspendFailed, "the VMM ended while suspending, without a saved state"
		return a.reports.Report(ctx, vm, rt)
	}
	ctx, span := tracing.Operation(ctx, a.tracer, vm, tracing.SpanSuspend)
	defer span.End()
	err := a.suspendPlan().Run(ctx, s)
	var failed *plan.Failed
	switch {
	case errors.As(err, &failed):
		span.SetStatus(codes.Error, failed.Reason)
		return a.suspendFailure(ctx, s, failed.Err)
	case err != nil:
		span.SetStatus(codes.Error, "Retry")
		return err
	}
	if s.Took > 0 {
		suspendSeconds.Observe(s.Took.Seconds())
		if res := vm.Status.Resources; res != nil {
			memoryReclaimed.Add(float64(res.Memory.Value()))
		}
	}
	return nil
}

// suspendFailure reports a suspension that failed: the VM keeps running, followed again (which
// thaws its workload, before any report that may fail).
func (a *Agent) suspendFailure(ctx context.Context, s *vmrun.Suspend, err error) error {
	suspendFailures.Inc()
	a.Recorder.Eventf(s.VM, nil, corev1.EventTypeWarning, impv1.ReasonSuspendFailed, "Suspend", "The VM keeps running: %v", err)
	if s.Alive() {
		a.Runs.Ensure(s.VM, s.Dir, s.Meta, s.Record, nil)
	}
	running := s.Runtime
	running.State, running.Reason, running.Message = impv1.RuntimeRunning, impv1.ReasonSuspendFailed, "suspending failed: "+err.Error()
	return a.reports.Report(ctx, s.VM, running)
}

// resume runs the resume plan: a suspended VM's VMM started from its saved state (or, rec
// alive, the one an agent started before it stopped), and the guest continues where it
// stopped. Without a saved state the run ends (ResumeFailed) and the runStrategy decides.
func (a *Agent) resume(ctx context.Context, vm *impv1.ImpVM, dir string, m *vmrun.Meta, rec *vmm.Record) error {
	cur := *vm.Status.Runtime
	ctx, span := tracing.Operation(ctx, a.tracer, vm, tracing.SpanResume, attribute.Bool("imp.vm.woken", cur.WakeRequested != nil))
	defer span.End()
	end := func(reason string, err error) error {
		span.SetStatus(codes.Error, reason)
		a.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, reason, "Resume", "%v", err)
		a.idle.Drop(vm.HostUID()) // what was held for it goes with the run
		a.endRun(vm.HostUID())
		ended := cur
		now := metav1.Now()
		ended.State, ended.FinishedAt, ended.GuestReady, ended.Reason, ended.Message = impv1.RuntimeExited, &now, false, reason, err.Error()
		return a.reports.Report(ctx, vm, ended)
	}
	if m == nil {
		return end("ResumeFailed", errors.New("no record of the suspended VM on its node"))
	}
	alive := rec != nil && rec.Alive()
	if !alive && !a.drivers.For(string(m.VMM)).Saved(vm, dir, m) {
		return end("ResumeFailed", errors.New("no saved state of the VM on its node"))
	}
	base, err := a.snapshots.RunBase(vm, dir, m)
	if err != nil {
		return end("ResumeFailed", err)
	}
	r := &vmrun.Run{VM: vm, Dir: dir, Old: m, Meta: m, Resume: true, BaseDisk: base}
	if alive {
		r.Record = rec
	}
	defer r.Done()
	start := time.Now()
	if err := a.resumePlan(vm).Run(ctx, r); err != nil {
		var failed *plan.Failed
		if errors.As(err, &failed) {
			return end(failed.Reason, failed.Err)
		}
		span.SetStatus(codes.Error, "Retry")
		return err
	}
	took := time.Since(start)
	resumeSeconds.Observe(took.Seconds())
	running := cur
	running.State, running.GuestReady, running.Reason, running.Message = impv1.RuntimeRunning, true, "", impv1.RuntimeResumedMessage
	running.IdleSince, running.WakeRequested = nil, nil // active again
	if err := a.reports.Report(ctx, vm, running); err != nil {
		span.SetStatus(codes.Error, "Retry")
		return err
	}
	a.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Resumed", "Resume", "The VM runs again on node %s (resumed in %v)", a.Opts.NodeName, took.Round(time.Millisecond))
	a.Runs.Ensure(vm, dir, m, r.Record, nil)
	return nil
}
