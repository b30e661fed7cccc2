package agent

import (
	"context"
	"errors"
	"time"

	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/handover"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// endRun removes what only the VM's current run needed, its VMM gone: its configuration disk
// (which holds the workload's secret values) and a suspension's saved state (vmmdriver).
func (a *Agent) endRun(uid types.UID) {
	if err := a.drivers.EndRun(uid); err != nil {
		ctrl.Log.Error(err, "removing the configuration of an ended run", "vm", uid)
	}
}

// stopVMM moves the VM's VMM towards stopped without waiting on it, so no worker waits out a
// tenant's grace period: it runs the stop plan (plans.go) — the guest asked to stop, its grace
// period, the VMM made to quit, then killed — and returns when to come back while the VMM runs,
// 0 once it is gone.
func (a *Agent) stopVMM(ctx context.Context, vm *impv1.ImpVM, rec *vmm.Record) time.Duration {
	grace := 30 * time.Second
	if g := vm.Spec.TerminationGracePeriodSeconds; g != nil {
		grace = time.Duration(*g) * time.Second
	}
	a.mu.Lock()
	st := a.stops[vm.HostUID()]
	if st == nil {
		st = &vmrun.Stop{Deadline: time.Now().Add(grace)}
		if vm.Status.Runtime != nil && vm.Status.Runtime.Endpoint != "" {
			st.DrainUntil = time.Now().Add(min(a.Opts.EndpointDrain, grace))
		}
		a.stops[vm.HostUID()] = st
	}
	a.mu.Unlock()
	st.VM, st.Record = vm, rec // one reconcile of a VM at a time: the stop is this pass's
	if err := a.stopPlan().Run(ctx, st); errors.Is(err, plan.ErrWait) {
		return plan.WaitTime(err)
	} else if err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "stopping the VMM")
		return time.Second
	}
	a.stopped(vm.HostUID(), rec)
	return 0
}

// stopped forgets a stop that ended, with the run's monitor and configuration.
func (a *Agent) stopped(uid types.UID, rec *vmm.Record) {
	a.mu.Lock()
	delete(a.stops, uid)
	a.mu.Unlock()
	a.Runs.Stop(uid)
	if !rec.Alive() {
		a.endRun(uid)
	}
}

// teardown removes a deleted VM: its VMM, its state and writable disk; then it reports Gone
// for the operator to release the VM.
func (a *Agent) teardown(ctx context.Context, vm *impv1.ImpVM) (ctrl.Result, error) {
	dir := a.vmDir(vm.HostUID())
	if m, err := vmrun.ReadMeta(dir); err == nil || handover.Pending(dir) {
		if owner := handover.Owner(dir, m); owner != vm.UID {
			// The run kept here is another VM's: a warm pool member's, handed (or being
			// handed) to its claim, or a claim's whose handover had not begun. It is that
			// VM's to remove.
			return ctrl.Result{}, a.reports.Report(ctx, vm, impv1.RuntimeStatus{Instance: vm.Status.Instance, Run: vm.Status.RestartCount, State: impv1.RuntimeGone})
		}
	}
	a.fetches.Drop(vm.HostUID())
	if rec, err := vmm.ReadRecord(dir); err == nil && rec.Alive() {
		if impv1.WarmPoolOf(vm) != "" {
			// An idle member waits paused: run on, its guest can be asked to stop.
			_ = a.drivers.Continue(ctx, vm.HostUID(), rec)
		}
		if again := a.stopVMM(ctx, vm, rec); again > 0 {
			return ctrl.Result{RequeueAfter: again}, nil
		}
	}
	return ctrl.Result{}, a.remove(ctx, vm, dir)
}

// remove removes what is left of a deleted VM whose VMM is gone, and reports it Gone.
func (a *Agent) remove(ctx context.Context, vm *impv1.ImpVM, dir string) error {
	t := &vmrun.Teardown{UID: vm.HostUID(), Dir: dir, Name: vm.Namespace + "/" + vm.Name}
	if err := a.teardownPlan().Run(ctx, t); err != nil {
		return err
	}
	return a.reports.Report(ctx, vm, impv1.RuntimeStatus{Instance: vm.Status.Instance, Run: vm.Status.RestartCount, State: impv1.RuntimeGone})
}
