package agent

import (
	"context"
	"errors"

	"github.com/google/go-containerregistry/pkg/name"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/cloudinit"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/idle"
	"github.com/syscode-labs/imp/internal/agent/imagefetch"
	"github.com/syscode-labs/imp/internal/agent/monitor"
	"github.com/syscode-labs/imp/internal/agent/nodenet"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/pullnet"
	"github.com/syscode-labs/imp/internal/agent/runreport"
	"github.com/syscode-labs/imp/internal/agent/snapshotter"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmmdriver"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// The agent's plans, each a list of steps (package steps) run by plan.Plan, its failpoints
// "<plan>/<step>" after each step that acted (docs/agent.md lists them):
//
//	start          a run booted, or restored from its snapshot
//	restore        a restore an agent began and did not see through, finished
//	resume         a suspended run back from its saved state (an idle one's held traffic replayed)
//	suspend        a running run's state saved and its VMM ended
//	stop           a run's VMM ended: drained, asked, given its grace, made to quit, killed
//	teardown       a VM removed from the node, whatever is left of it

// restores reports whether the VM's run starts by restoring its snapshot: a VM with a
// snapshotRef, or a copy of a template, whose placement has not had a run restored yet (none
// recorded of this placement, or one whose guest never took on its identity). Once one was,
// later runs of the placement boot from the VM's disk, as a restarted machine does: their meta
// records no restore.
func restores(vm *impv1.ImpVM, old *vmrun.Meta) bool {
	if vm.RestoreFrom() == "" {
		return false
	}
	return old == nil || old.Instance != vm.Status.Instance || (old.Restore != nil && !old.Restore.Done)
}

// startPlan is the plan of a run that starts, its steps chosen by what the VM asks (volumes:
// package volume): booted, or restored from its snapshot (restore: the snapshot found and
// checked first, the writable disk a copy of the snapshot's, the VMM started on the snapshot's
// state, the guest run on and then given its own identity; package snapshotter); a VM on no
// ImpNetwork has no network step, a node with no pins no provenance step. Each step that acts
// is timed in imp_agent_vm_start_step_seconds{step}, and its failpoint is "start/<step>".
func (a *Agent) startPlan(vm *impv1.ImpVM, restore bool) plan.Plan[*vmrun.Run] {
	var ss []steps.Step
	if len(a.Opts.Pins) > 0 {
		ss = append(ss, steps.Provenance{Pins: a.Opts.Pins, Fetches: a.fetches})
	}
	ss = append(ss, steps.StateDir{})
	if restore {
		ss = append(ss, steps.Snapshot{Snapshots: a.snapshots})
	}
	if vm.Spec.Boot == impv1.BootOS {
		ss = append(ss, steps.OSBoot{ChooseVMM: a.drivers.ChooseVMM})
	}
	insecure := a.Opts.InsecureRegistries
	ss = append(ss, steps.Image{Fetches: a.fetches, Reports: a.reports, FetchWait: imagefetch.FetchWait,
		NameOptions: func(image string) []name.Option { return pullnet.NameOptions(image, insecure) }})
	if len(vm.Spec.Volumes) > 0 {
		ss = append(ss, steps.Volumes{Maker: a.volumes})
	}
	if vm.Spec.CloudInit != nil {
		ss = append(ss, cloudinit.Seed{})
	}
	ss = append(ss, steps.ConfigDisk{})
	if restore {
		ss = append(ss, steps.RestoreDisk{})
	} else {
		ss = append(ss, steps.WritableDisk{Disks: a.writables})
	}
	ss = append(ss, steps.Identity{IDs: a.drivers}, steps.Intent{})
	if vm.Spec.NetworkRef != nil {
		ss = append(ss, steps.Network{Attacher: a.networks}, steps.Expose{Exposer: a.exposer})
	}
	ss = append(ss, steps.Exec{Launcher: launcher{a.drivers}})
	if restore {
		ss = append(ss, steps.Resumed{Resumer: launcher{a.drivers}}, steps.Reidentify{Guests: a.snapshots})
	}
	return plan.Plan[*vmrun.Run]{Name: "start", Reason: "StartFailed", Steps: ss, Observe: steps.ObserveStart}
}

// finishRestorePlan finishes a restore an agent began and did not see through (it stopped
// after the VMM started, or a warm pool member handed to its claim): the guest run on, and
// given its identity. The VMM runs and holds its tap: only the tap's rules are made the VM's,
// and its ports forwarded at its endpoint (a handover may have stopped before its expose).
func (a *Agent) finishRestorePlan(vm *impv1.ImpVM) plan.Plan[*vmrun.Run] {
	var ss []steps.Step
	if vm.Spec.NetworkRef != nil {
		ss = append(ss, steps.Network{Attacher: nodenet.Readdressing{Networks: a.networks}}, steps.Expose{Exposer: a.exposer})
	}
	if vm.HostUID() != vm.UID { // a warm claim: its member was restored in the background, and waits paused
		ss = append(ss, a.handovers.Steps.Foreground, steps.Continue{Continuers: a.drivers})
	}
	ss = append(ss, steps.Resumed{Resumer: launcher{a.drivers}}, steps.Reidentify{Guests: a.snapshots})
	return plan.Plan[*vmrun.Run]{Name: "restore", Reason: impv1.ReasonRestoreFailed, Steps: ss}
}

// resumePlan is the plan of a run that comes back from its saved state: no image, disks or
// identity to make (the run has them), its VMM started on the saved state, then resumed; a run
// whose VMM an agent started before it stopped is only resumed (intent and exec measure that
// it runs). It is timed as a whole (imp_agent_vm_resume_duration_seconds); its failpoints are
// "resume/<step>".
func (a *Agent) resumePlan(vm *impv1.ImpVM) plan.Plan[*vmrun.Run] {
	ss := []steps.Step{steps.Intent{}}
	if len(vm.Spec.Volumes) > 0 {
		ss = append(ss, steps.Volumes{Maker: a.volumes}) // its disks, to attach again
	}
	if vm.Spec.CloudInit != nil {
		ss = append(ss, cloudinit.Seed{}) // the seed its guest saw, attached again
	}
	if vm.Spec.NetworkRef != nil {
		// What stood in for an idle-suspended VM gives its tap back first, and what it held
		// reaches the guest once it runs (package idle).
		ss = append(ss, idle.StandDown{StandIns: a.idle}, steps.Network{Attacher: a.networks}, steps.Expose{Exposer: a.exposer})
	}
	ss = append(ss, steps.Exec{Launcher: launcher{a.drivers}}, steps.Resumed{Resumer: launcher{a.drivers}})
	if vm.Spec.NetworkRef != nil {
		ss = append(ss, idle.Replay{StandIns: a.idle})
	}
	return plan.Plan[*vmrun.Run]{Name: "resume", Reason: "ResumeFailed", Steps: ss}
}

// suspendPlan saves a running run's memory and device state on the node and ends its VMM:
// reported Suspending, its workload frozen, saved, reported Suspended. Run again after a crash
// it does what is left (a VMM gone with its state saved is only reported). Its failpoints are
// "suspend/<step>"; a failure leaves the VM running (ReasonSuspendFailed).
func (a *Agent) suspendPlan() plan.Plan[*vmrun.Suspend] {
	return plan.Plan[*vmrun.Suspend]{Name: "suspend", Reason: impv1.ReasonSuspendFailed, Steps: []steps.SuspendStep{
		steps.Suspending{Reports: a.reports}, steps.Freeze{Freezer: freezer{a}}, steps.Save{Savers: savers{a.Runs, a.drivers}},
		steps.Suspended{Reports: a.reports},
	}}
}

// stopPlan ends a run's VMM: a VM with an endpoint drained, the guest asked to stop, its grace
// period, the VMM made to quit, then killed; it waits (plan.WaitFor) while the VMM runs, so that
// no worker waits out a grace period. Its failpoints are "stop/<step>".
func (a *Agent) stopPlan() plan.Plan[*vmrun.Stop] {
	s := stoppers{a.Runs, a.drivers}
	return plan.Plan[*vmrun.Stop]{Name: "stop", Reason: "StopFailed", Steps: []steps.StopStep{
		steps.Drain{}, steps.Ask{Stoppers: s}, steps.Grace{}, steps.Quit{Stoppers: s}, steps.Kill{},
	}}
}

// teardownPlan removes a VM from the node, whatever is left of it: its processes, the agent's
// memory of it, its cgroups, network attachment, jail and state directory. Its failpoints are
// "teardown/<step>".
func (a *Agent) teardownPlan() plan.Plan[*vmrun.Teardown] {
	var cgroups func(types.UID)
	if a.Opts.CgroupRoot != "" {
		root := a.Opts.CgroupRoot
		cgroups = func(uid types.UID) { cgroup.Remove(root, string(uid)) }
	}
	td := teardowns{a}
	return plan.Plan[*vmrun.Teardown]{Name: "teardown", Reason: "TeardownFailed", Steps: []steps.TeardownStep{
		steps.KillVMMs{}, steps.Forget{Memory: td}, steps.Cgroups{Remove: cgroups}, steps.Detach{Detacher: td},
		steps.Jail{Jails: a.drivers}, steps.RemoveState{},
	}}
}

// stoppers ask the VM's guest to stop, through its monitor, and its VMM to quit.
type stoppers struct {
	runs    *monitor.Registry
	drivers *vmmdriver.Drivers
}

func (s stoppers) RequestStop(uid types.UID) bool { return s.runs.RequestStop(uid) }

func (s stoppers) Quit(ctx context.Context, kind string, uid types.UID) error {
	return s.drivers.For(kind).Quit(ctx, uid)
}

// freezer has the guest of a run its monitor follows freeze its workload, and says in an Event
// when it did not.
type freezer struct{ a *Agent }

func (f freezer) FreezeWorkload(vm *impv1.ImpVM, action string) {
	_, err := f.a.Runs.Freeze(types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}, vm.HostUID())
	if err != nil && !errors.Is(err, monitor.ErrNotRunning) {
		f.a.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, snapshotter.ReasonNotFrozen, action,
			"The VM is suspended with its workload running (%v): a snapshot of its saved state would be too", err)
	}
}

// savers stop following the run (its VMM exits on purpose) and have its driver save it.
type savers struct {
	runs    *monitor.Registry
	drivers *vmmdriver.Drivers
}

func (s savers) Save(ctx context.Context, su *vmrun.Suspend) error {
	s.runs.Stop(su.VM.HostUID())
	return s.drivers.For(string(su.Meta.VMM)).Suspend(ctx, su.VM, su.Dir, su.Meta, su.Record)
}

// teardowns is what the teardown plan needs of the agent.
type teardowns struct{ a *Agent }

// Forget drops the VM's fetch, monitor and stop, and its claim on a snapshot's shared memory.
func (t teardowns) Forget(uid types.UID) {
	t.a.fetches.Drop(uid)
	t.a.idle.Drop(uid)                          // what stood in for it, idle-suspended, lets go of its tap
	t.a.snapshots.Memories.Release(string(uid)) // its VMM is gone
	t.a.Runs.Stop(uid)
	t.a.mu.Lock()
	delete(t.a.stops, uid)
	t.a.mu.Unlock()
}

// Detach removes the VM's tap, then has the networks looked at again (one may have lost its
// last VM on the node).
func (t teardowns) Detach(uid types.UID) error {
	defer t.a.networks.Kick(types.NamespacedName{})
	if err := t.a.net.Detach(string(uid)); err != nil {
		return err
	}
	// Its endpoint address is free once nothing of its exposure is left.
	t.a.exposer.Release(string(uid))
	return nil
}

// launcher starts a run's VMM through the driver of its kind.
type launcher struct{ drivers *vmmdriver.Drivers }

func (l launcher) Launch(ctx context.Context, r *vmrun.Run) (*vmm.Record, error) {
	base := r.BaseDisk
	switch {
	case r.Snapshot != nil:
		base = r.Path(vmrun.RestoredBase) // the disk the snapshot's memory knows
	case r.Image != nil:
		base = r.Image.BaseDisk
	}
	spec := vmmdriver.Launch{VM: r.VM, Dir: r.Dir, Meta: r.Meta, BaseDisk: base, Attachment: r.Attachment, Net: r.Net, Resume: r.Resume, Incoming: r.Incoming}
	if r.Volumes != nil {
		spec.Drives = r.Volumes.Drives
	}
	if r.Snapshot != nil {
		spec.Restore = r.Snapshot.Dir
	}
	return l.drivers.For(string(r.Meta.VMM)).Start(ctx, spec)
}

func (l launcher) Resumed(ctx context.Context, r *vmrun.Run, rec *vmm.Record) error {
	return l.drivers.For(string(r.Meta.VMM)).Resumed(ctx, r.Dir, rec)
}

var (
	_ steps.Reports        = (*runreport.Reporter)(nil)
	_ steps.RuntimeReports = (*runreport.Reporter)(nil)
	_ steps.Identities     = (*vmmdriver.Drivers)(nil)
	_ steps.Jails          = (*vmmdriver.Drivers)(nil)
	_ steps.Launcher       = launcher{}
	_ steps.Resumer        = launcher{}
	_ steps.Continuers     = (*vmmdriver.Drivers)(nil)
	_ steps.Attacher       = (*nodenet.Networks)(nil)
	_ steps.Attacher       = nodenet.Readdressing{}
	_ steps.Disks          = (*disk.Writables)(nil)
	_ steps.Memory         = teardowns{}
	_ steps.Detacher       = teardowns{}
	_ steps.Stoppers       = stoppers{}
	_ steps.Freezer        = freezer{}
	_ steps.Savers         = savers{}
)
