package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/guestchan"
	"github.com/syscode-labs/imp/internal/agent/handover"
	"github.com/syscode-labs/imp/internal/agent/idle"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmmdriver"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/agent/volume"
	"github.com/syscode-labs/imp/internal/tracing"
)

// Reconcile makes the node match one VM.
func (a *Agent) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	vm := &impv1.ImpVM{}
	if err := a.Client.Get(ctx, req.NamespacedName, vm); err != nil {
		if !apierrors.IsNotFound(err) {
			return ctrl.Result{}, err
		}
		// Not in the cache of this node's VMs: ask the API server before touching anything.
		if err := a.APIReader.Get(ctx, req.NamespacedName, vm); err != nil && !apierrors.IsNotFound(err) {
			return ctrl.Result{}, err
		} else if err == nil && vm.Status.NodeName == a.Opts.NodeName {
			return ctrl.Result{Requeue: true}, nil // the cache is behind
		}
		a.reports.Forget(req.NamespacedName)
		return ctrl.Result{}, a.removeLeftovers(ctx, req.NamespacedName, vm)
	}
	// One reconcile at a time of the VMs whose runs one directory keeps: a warm pool member's
	// and the claim it is handed to.
	unlock, ok := a.hosts.TryLock(vm.HostUID())
	if !ok {
		return ctrl.Result{RequeueAfter: 100 * time.Millisecond}, nil
	}
	defer unlock()
	if !vm.DeletionTimestamp.IsZero() {
		return a.teardown(ctx, vm)
	}
	if vm.Status.Phase == impv1.VMSucceeded || vm.Status.Phase == impv1.VMFailed {
		return a.retire(ctx, vm) // final: no fresh read needed
	}
	dir := a.vmDir(vm.HostUID())
	m, _ := vmrun.ReadMeta(dir)
	rec, _ := vmm.ReadRecord(dir)
	alive := rec != nil && rec.Alive()
	hosted := vm.HostUID() != vm.UID // a claim served warm: its run is its member's
	if !hosted && (handover.Pending(dir) || (m != nil && m.UID != vm.UID)) {
		return ctrl.Result{}, nil // a member handed to its claim: the run is the claim's
	}
	if !alive {
		// About to start, resume or report an end: decide on what the API server says now,
		// not on a cache that may not have seen this agent's last report yet.
		host := vm.HostUID()
		if err := a.APIReader.Get(ctx, req.NamespacedName, vm); err != nil {
			return ctrl.Result{}, client.IgnoreNotFound(err)
		}
		if vm.HostUID() != host {
			// A claim whose handover failed, placed again to be restored: its run is kept
			// under its own UID now, not the directory read above.
			return ctrl.Result{Requeue: true}, nil
		}
		if !vm.DeletionTimestamp.IsZero() {
			return a.teardown(ctx, vm)
		}
		if vm.Status.NodeName != a.Opts.NodeName {
			return ctrl.Result{}, nil // placed elsewhere meanwhile: the watch brings the removal
		}
	}
	st := vm.Status
	if st.Phase == impv1.VMSucceeded || st.Phase == impv1.VMFailed {
		return ctrl.Result{}, nil
	}
	if hosted && (m == nil || m.UID != vm.UID) {
		// Handed a warm pool member: the member's running guest becomes this VM.
		if err := a.handovers.Hand(ctx, vm, dir, m, rec); errors.Is(err, plan.ErrWait) {
			return ctrl.Result{RequeueAfter: 250 * time.Millisecond}, nil
		} else if err != nil {
			return ctrl.Result{}, err
		}
		return ctrl.Result{}, nil
	}
	current := m != nil && m.Instance == st.Instance && m.Run == st.RestartCount

	if vm.Spec.RunStrategy == impv1.RunStrategyHalted {
		a.fetches.Drop(vm.HostUID()) // a start under way is not wanted any more
		a.idle.Drop(vm.HostUID())    // what stood in for it, idle-suspended: the VM stops
		if alive {
			if again := a.stopVMM(ctx, vm, rec); again > 0 {
				return ctrl.Result{RequeueAfter: again}, nil
			}
		}
		// The VMM is gone: its run's configuration goes before the run is reported stopped,
		// not whenever its monitor sees the exit.
		a.endRun(vm.HostUID())
		return ctrl.Result{}, a.reports.Report(ctx, vm, impv1.RuntimeStatus{Instance: st.Instance, Run: st.RestartCount, State: impv1.RuntimeStopped, Reason: "Halted"})
	}
	if alive && current {
		if done, err := migrating(ctx, a, vm, dir, m, rec); done || err != nil {
			return ctrl.Result{}, err
		}
		if rt := st.Runtime; rt != nil && rt.Instance == st.Instance && rt.Run == st.RestartCount && rt.State == impv1.RuntimeSuspended && st.Suspension == nil {
			// Resumed by an agent that stopped before it reported the guest running on: the
			// resume finishes on the VMM it started. Or resumed by this one, whose report the
			// cache has yet to see (its update brings another reconcile): the API server says.
			fresh := &impv1.ImpVM{}
			if err := a.APIReader.Get(ctx, req.NamespacedName, fresh); err != nil {
				return ctrl.Result{}, client.IgnoreNotFound(err)
			}
			if frt := fresh.Status.Runtime; frt == nil || frt.Instance != rt.Instance || frt.Run != rt.Run || frt.State != impv1.RuntimeSuspended || fresh.Status.Suspension != nil {
				return ctrl.Result{}, nil
			}
			if !fresh.DeletionTimestamp.IsZero() || fresh.Status.NodeName != a.Opts.NodeName || fresh.HostUID() != vm.HostUID() ||
				fresh.Spec.RunStrategy == impv1.RunStrategyHalted {
				return ctrl.Result{Requeue: true}, nil // going, halted or placed elsewhere: the cache's next view decides
			}
			return ctrl.Result{}, a.resume(ctx, fresh, dir, m, rec)
		}
		if rs := m.Restore; rs != nil && !rs.Done {
			// Restored by an agent that stopped before the guest took on its identity.
			if err := a.finishRestore(ctx, vm, dir, m, rec); err != nil || !rs.Done {
				return ctrl.Result{}, err // failed: the run is reported ended, its VMM asked to quit
			}
		}
		if rt := st.Runtime; (rt == nil || rt.Instance != st.Instance || rt.Run != st.RestartCount || rt.State == impv1.RuntimeStarting) && !a.reports.Since(vm) {
			// Started by an agent that stopped before its deferred report: the run is
			// reported now, before anything else is done with it.
			t := metav1.NewTime(m.Started)
			booting := m.Status()
			booting.State, booting.StartedAt, booting.Message = impv1.RuntimeRunning, &t, "the guest is booting"
			if err := a.reports.Report(ctx, vm, booting); err != nil {
				return ctrl.Result{}, err
			}
		}
		if st.Suspension != nil && st.Runtime != nil && !suspendFailed(st.Runtime) { // with no report yet, the report comes first
			if a.snapshots.Busy(vm.HostUID()) {
				return ctrl.Result{RequeueAfter: time.Second}, nil // QEMU saves one state at a time
			}
			// The cache may lag a resume this agent just made, its suspension gone (an idle VM's
			// wake): a suspension is acted on as the API server has it.
			fresh := &impv1.ImpVM{}
			if err := a.APIReader.Get(ctx, req.NamespacedName, fresh); err != nil {
				return ctrl.Result{}, client.IgnoreNotFound(err)
			}
			if fresh.Status.Suspension == nil || fresh.HostUID() != vm.HostUID() || fresh.Status.Instance != st.Instance ||
				fresh.Status.RestartCount != st.RestartCount || fresh.Status.Runtime == nil || suspendFailed(fresh.Status.Runtime) {
				return ctrl.Result{}, nil // the cache's next view decides
			}
			return ctrl.Result{}, a.suspend(ctx, fresh, dir, m, rec)
		}
		if rt := st.Runtime; impv1.WarmPoolOf(vm) != "" && rt != nil && rt.GuestReady && (m.Restore == nil || m.Restore.Done) {
			// An idle member waits paused, taking no CPU: its handover runs it on
			// (docs/warmpools.md).
			if err := a.drivers.Pause(ctx, vm.HostUID(), rec); err != nil {
				ctrl.LoggerFrom(ctx).Error(err, "pausing an idle warm pool member")
			}
		}
		a.Runs.Ensure(vm, dir, m, rec, nil) // re-attach after an agent restart
		a.mu.Lock()
		delete(a.stops, vm.HostUID()) // a stop given up (the VM runs again): the next one starts afresh
		a.mu.Unlock()
		return ctrl.Result{}, nil
	}
	if rt := st.Runtime; rt != nil && rt.Instance == st.Instance && rt.Run == st.RestartCount {
		switch rt.State {
		case impv1.RuntimeExited, impv1.RuntimeStopped, impv1.RuntimeGone:
			return ctrl.Result{}, nil // this run ended: the operator decides what comes next
		case impv1.RuntimeSuspended:
			if st.Suspension != nil {
				if idle.Suspended(vm) {
					// Suspended because it was idle: what arrives for it is held, and wakes it.
					return ctrl.Result{}, a.idle.Ensure(ctx, vm)
				}
				return ctrl.Result{}, nil
			}
			return ctrl.Result{}, a.resume(ctx, vm, dir, m, nil)
		case impv1.RuntimeSuspending:
			// The agent stopped while suspending: finish from what it left.
			return ctrl.Result{}, a.suspend(ctx, vm, dir, m, rec)
		case impv1.RuntimeRunning:
			// Reported running, yet no live VMM of this run: it died while no monitor watched
			// (the agent was down). Say so; the runStrategy decides about a restart.
			ended := *rt
			now := metav1.Now()
			ended.State, ended.FinishedAt, ended.GuestReady = impv1.RuntimeExited, &now, false
			ended.Reason, ended.Message = "VMMExited", "the VMM exited while the agent was not watching"
			a.endRun(vm.HostUID())
			if tail := a.drivers.For(vmmdriver.RecKind(rec)).LogTail(dir); tail != "" {
				ended.Message += ": " + tail
			}
			return ctrl.Result{}, a.reports.Report(ctx, vm, ended)
		}
	}
	if alive { // a VMM of another run or instance: never two at once
		if again := a.stopVMM(ctx, vm, rec); again > 0 {
			return ctrl.Result{RequeueAfter: again}, nil
		}
	}
	if vm.IsCopy() && vm.RestoreFrom() == "" {
		return ctrl.Result{}, nil // a copy whose template's snapshot is being made: it starts from it
	}
	if !volume.HolderReady(vm) {
		return ctrl.Result{}, nil // its claims are not attached on this node yet: its status will say
	}
	a.idle.Drop(vm.HostUID()) // a new run opens its tap: what stood in for an earlier one lets go
	if err := a.start(ctx, vm, dir, m); errors.Is(err, errFetching) {
		return ctrl.Result{RequeueAfter: 250 * time.Millisecond}, nil
	} else if err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{}, nil
}

// retire removes the disks of a VM that finished (Succeeded or Failed) once it has been
// finished for Options.FinishedDiskRetention; its console stays for kubectl imp logs until the
// VM is deleted.
func (a *Agent) retire(ctx context.Context, vm *impv1.ImpVM) (ctrl.Result, error) {
	a.idle.Drop(vm.HostUID()) // finished: nothing stands in for it
	rt := vm.Status.Runtime
	if a.Opts.FinishedDiskRetention <= 0 || rt == nil || rt.FinishedAt == nil || rt.DisksRemoved {
		return ctrl.Result{}, nil
	}
	if left := a.Opts.FinishedDiskRetention - time.Since(rt.FinishedAt.Time); left > 0 {
		return ctrl.Result{RequeueAfter: left}, nil
	}
	dir := a.vmDir(vm.HostUID())
	if m, _ := vmrun.ReadMeta(dir); handover.Owner(dir, m) != vm.UID {
		return ctrl.Result{}, nil // another VM's run (a member's, handed to its claim)
	}
	if rec, err := vmm.ReadRecord(dir); err == nil && rec.Alive() {
		return ctrl.Result{}, nil // never under a running VMM
	}
	for _, f := range []string{"rw.ext4", vmrun.ConfigDisk, vmrun.RestoredBase} {
		if err := os.Remove(filepath.Join(dir, f)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return ctrl.Result{}, fmt.Errorf("removing the disks of finished VM %s: %w", vm.Name, err)
		}
	}
	if err := volume.Remove(dir, vm); err != nil {
		return ctrl.Result{}, fmt.Errorf("removing the disk volumes of finished VM %s: %w", vm.Name, err)
	}
	if err := a.drivers.RemoveJail(vm.HostUID()); err != nil {
		return ctrl.Result{}, err
	}
	// The operator counts the disks against the node and the quota until this says they are
	// gone.
	done := *rt.DeepCopy()
	done.DisksRemoved = true
	return ctrl.Result{}, a.reports.Report(ctx, vm, done)
}

// errFetching: the run's image is still being fetched; the start resumes on a later pass.
var errFetching = errors.New("the image is being fetched")

// start runs the boot plan for the VM's current run (plans.go), then reports it and watches
// it. A step's failure ends the run as Exited with the step's reason (StartFailed,
// ImagePullFailed, ...), so the operator's runStrategy and back-off decide about retrying.
func (a *Agent) start(ctx context.Context, vm *impv1.ImpVM, dir string, old *vmrun.Meta) error {
	r := &vmrun.Run{VM: vm, Dir: dir, Old: old}
	defer r.Done()
	// This pass of the run's start, a child of the start's root span (package tracing): each
	// step of the plan that acts is a child of it. A pass while the run's image is still being
	// fetched only finds it so, again and again: it records nothing, and the pass that takes
	// the image records the fetch (steps.Image).
	span := trace.SpanFromContext(ctx)
	if !a.fetches.Fetching(vm) {
		ctx, span = tracing.RunSpan(ctx, a.tracer, vm, tracing.SpanAgent)
		defer span.End()
	}
	err := a.startPlan(vm, restores(vm, old)).Run(ctx, r)
	var failed *plan.Failed
	switch {
	case errors.Is(err, plan.ErrWait):
		span.SetAttributes(attribute.Bool("imp.wait", true))
		return errFetching
	case errors.As(err, &failed):
		span.SetStatus(codes.Error, failed.Reason)
		return a.startFailed(ctx, vm, failed.Reason, failed.Err)
	case err != nil:
		span.SetStatus(codes.Error, "Retry")
		return err
	}
	steps.ObserveStart("total", time.Since(r.Image.Began))
	t := metav1.NewTime(r.Meta.Started)
	started := r.Meta.Status()
	started.State, started.StartedAt, started.Message = impv1.RuntimeRunning, &t, "the guest is booting"
	if rs := r.Meta.Restore; rs != nil {
		started.Message = "restored from ImpVMSnapshot " + rs.Snapshot
	}
	if err := a.reports.ReportLater(ctx, vm, started); err != nil {
		return err
	}
	a.Runs.Ensure(vm, dir, r.Meta, r.Record, r.TakeChannel())
	return nil
}

// startFailed ends the run that could not start: an Event, and the run reported Exited.
func (a *Agent) startFailed(ctx context.Context, vm *impv1.ImpVM, reason string, err error) error {
	a.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, reason, "Start", "%v", err)
	now := metav1.Now()
	// A registry's answer, the tenant's to choose, may be in err: printable, one line, bounded.
	failed := impv1.RuntimeStatus{Instance: vm.Status.Instance, Run: vm.Status.RestartCount, State: impv1.RuntimeExited,
		Reason: reason, Message: guestchan.Sanitize(err.Error()), FinishedAt: &now}
	return a.reports.Report(ctx, vm, failed)
}

// finishRestore runs finishRestorePlan on the run's live VMM; a failure ends the run. (The
// guest channel the identity was given on is closed with the plan: the monitor of this rare
// path connects anew.)
func (a *Agent) finishRestore(ctx context.Context, vm *impv1.ImpVM, dir string, m *vmrun.Meta, rec *vmm.Record) error {
	r := &vmrun.Run{VM: vm, Dir: dir, Old: m, Meta: m, Resume: true, Record: rec}
	defer r.Done()
	ctx, span := tracing.RunSpan(ctx, a.tracer, vm, tracing.SpanAgent)
	defer span.End()
	err := a.finishRestorePlan(vm).Run(ctx, r)
	var failed *plan.Failed
	if errors.As(err, &failed) {
		span.SetStatus(codes.Error, failed.Reason)
		if rec.Alive() {
			_ = a.drivers.For(string(m.VMM)).Quit(ctx, vm.HostUID())
		}
		if vm.HostUID() != vm.UID {
			failed.Reason = impv1.ReasonWarmHandoverFailed // the claim is placed again, restored
		}
		return a.startFailed(ctx, vm, failed.Reason, failed.Err)
	}
	return err
}
