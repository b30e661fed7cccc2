package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
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

// suspend saves a running VM's memory and device state in its state directory and stops its
// VMM; disks, tap and address stay. On failure the VM keeps running and says why.
func (a *Agent) suspend(ctx context.Context, vm *impv1.ImpVM, dir string, m *meta, rec *vmm.Record) error {
	cur := *vm.Status.Runtime
	suspending := cur
	suspending.State, suspending.Message = impv1.RuntimeSuspending, "saving the VM's memory and device state"
	if err := a.report(ctx, vm, suspending); err != nil {
		return err
	}
	// Its workload frozen first, as for a snapshot (a suspended VM's state may be snapshotted,
	// and its copies restored): the next run's monitor thaws it, resumed or not.
	if mon, err := a.running(types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}, vm.UID); err == nil {
		if err := mon.freeze(freezeTimeout); err != nil {
			a.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, reasonNotFrozen, "Suspend",
				"The VM is suspended with its workload running (%v): a snapshot of its saved state would be too", err)
		}
	}
	a.stopMonitor(vm.UID) // the VMM exits on purpose
	start := time.Now()
	if err := a.driver(string(m.VMM)).suspend(ctx, vm, dir, m, rec); err != nil {
		return a.suspendFailure(ctx, vm, dir, m, rec, err)
	}
	rec.WaitGone(30 * time.Second)
	if rec.Alive() {
		return a.suspendFailure(ctx, vm, dir, m, rec, errors.New("the VMM did not exit after saving its state"))
	}
	took := time.Since(start)
	suspendSeconds.Observe(took.Seconds())
	memoryReclaimed.Add(float64(vm.Status.Resources.Memory.Value()))
	suspended := cur
	suspended.State, suspended.GuestReady, suspended.Reason = impv1.RuntimeSuspended, false, ""
	suspended.Message = fmt.Sprintf("state saved in %v; %s of memory freed", took.Round(time.Millisecond), vm.Status.Resources.Memory.String())
	return a.report(ctx, vm, suspended)
}

// finishSuspend settles a suspension the agent did not see through (it stopped meanwhile): a
// saved state means suspended, none means the run ended without it.
func (a *Agent) finishSuspend(ctx context.Context, vm *impv1.ImpVM, dir string) error {
	rt := *vm.Status.Runtime
	if _, err := os.Stat(filepath.Join(dir, qemu.StateFile)); err == nil {
		rt.State, rt.Message = impv1.RuntimeSuspended, "state saved"
		return a.report(ctx, vm, rt)
	}
	now := metav1.Now()
	rt.State, rt.FinishedAt, rt.GuestReady, rt.Reason, rt.Message = impv1.RuntimeExited, &now, false, impv1.ReasonSuspendFailed, "the VMM ended while suspending, without a saved state"
	return a.report(ctx, vm, rt)
}

func (a *Agent) suspendFailure(ctx context.Context, vm *impv1.ImpVM, dir string, m *meta, rec *vmm.Record, err error) error {
	suspendFailures.Inc()
	a.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, impv1.ReasonSuspendFailed, "Suspend", "The VM keeps running: %v", err)
	if rec.Alive() {
		a.ensureMonitor(vm, dir, m, rec, nil) // which thaws its workload, before any report that may fail
	}
	running := *vm.Status.Runtime
	running.State, running.Reason, running.Message = impv1.RuntimeRunning, impv1.ReasonSuspendFailed, "suspending failed: "+err.Error()
	return a.report(ctx, vm, running)
}

// resume starts a suspended VM's VMM from its saved state; the guest continues where it
// stopped. Without a saved state the run ends (ResumeFailed) and the runStrategy decides.
func (a *Agent) resume(ctx context.Context, vm *impv1.ImpVM, dir string, m *meta) error {
	cur := *vm.Status.Runtime
	end := func(reason string, err error) error {
		a.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, reason, "Resume", "%v", err)
		a.endRun(vm.UID)
		ended := cur
		now := metav1.Now()
		ended.State, ended.FinishedAt, ended.GuestReady, ended.Reason, ended.Message = impv1.RuntimeExited, &now, false, reason, err.Error()
		return a.report(ctx, vm, ended)
	}
	if m == nil {
		return end("ResumeFailed", errors.New("no record of the suspended VM on its node"))
	}
	drv := a.driver(string(m.VMM))
	if !drv.saved(vm, dir, m) {
		return end("ResumeFailed", errors.New("no saved state of the VM on its node"))
	}
	base, err := a.runBase(vm, dir, m)
	if err != nil {
		return end("ResumeFailed", err)
	}
	r := &vmrun.Run{VM: vm, Dir: dir, Old: m, Meta: m, Resume: true, BaseDisk: base}
	defer r.Done()
	start := time.Now()
	if err := a.resumePlan(vm).Run(ctx, r); err != nil {
		var failed *plan.Failed
		if errors.As(err, &failed) {
			return end(failed.Reason, failed.Err)
		}
		return err
	}
	rec := r.Record
	took := time.Since(start)
	resumeSeconds.Observe(took.Seconds())
	running := cur
	running.State, running.GuestReady, running.Reason, running.Message = impv1.RuntimeRunning, true, "", impv1.RuntimeResumedMessage
	if err := a.report(ctx, vm, running); err != nil {
		return err
	}
	a.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Resumed", "Resume", "The VM runs again on node %s (resumed in %v)", a.Opts.NodeName, took.Round(time.Millisecond))
	a.ensureMonitor(vm, dir, m, rec, nil)
	return nil
}
