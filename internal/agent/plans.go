package agent

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// startPlan is the plan of a run that starts, its steps chosen by what the VM asks (volumes:
// package volume): booted, or
// restored from its snapshot (restore: the snapshot found and checked first, the writable disk a
// copy of the snapshot's, the VMM started on the snapshot's state, the guest run on and then
// given its own identity; restore.go); a VM on no ImpNetwork has no network step, a node with no
// pins no provenance step. Each step that acts is timed in imp_agent_vm_start_step_seconds{step},
// and its failpoint is "start/<step>".
func (a *Agent) startPlan(vm *impv1.ImpVM, restore bool) plan.Plan[*vmrun.Run] {
	var ss []steps.Step
	if len(a.Opts.Pins) > 0 {
		ss = append(ss, steps.Provenance{Pins: a.Opts.Pins, Fetches: a.fetches})
	}
	ss = append(ss, steps.StateDir{})
	if restore {
		ss = append(ss, steps.Snapshot{Snapshots: snapshotFinder{a}})
	}
	ss = append(ss, steps.Image{Fetches: a.fetches, Reports: reports{a}, NameOptions: a.nameOptions, FetchWait: fetchWait})
	if len(vm.Spec.Volumes) > 0 {
		ss = append(ss, steps.Volumes{Maker: a.volumes})
	}
	ss = append(ss, steps.ConfigDisk{})
	if restore {
		ss = append(ss, steps.RestoreDisk{})
	} else {
		ss = append(ss, steps.WritableDisk{Disks: a.writables})
	}
	ss = append(ss, steps.Identity{IDs: identities{a}}, steps.Intent{})
	if vm.Spec.NetworkRef != nil {
		ss = append(ss, steps.Network{Attacher: a.networks}, steps.Expose{Exposer: a.exposer})
	}
	ss = append(ss, steps.Exec{Launcher: launcher{a}})
	if restore {
		ss = append(ss, steps.Resumed{Resumer: launcher{a}}, steps.Reidentify{Guests: guests{a}})
	}
	return plan.Plan[*vmrun.Run]{Name: "start", Reason: "StartFailed", Steps: ss, Observe: observeStartStep}
}

// resumePlan is the plan of a run that comes back from its saved state: no image, disks or
// identity to make (the run has them), its VMM started on the saved state, then resumed. It is
// timed as a whole (imp_agent_vm_resume_duration_seconds); its failpoints are "resume/<step>".
func (a *Agent) resumePlan(vm *impv1.ImpVM) plan.Plan[*vmrun.Run] {
	ss := []steps.Step{steps.Intent{}}
	if len(vm.Spec.Volumes) > 0 {
		ss = append(ss, steps.Volumes{Maker: a.volumes}) // its disks, to attach again
	}
	if vm.Spec.NetworkRef != nil {
		ss = append(ss, steps.Network{Attacher: a.networks}, steps.Expose{Exposer: a.exposer})
	}
	ss = append(ss, steps.Exec{Launcher: launcher{a}}, steps.Resumed{Resumer: launcher{a}})
	return plan.Plan[*vmrun.Run]{Name: "resume", Reason: "ResumeFailed", Steps: ss}
}

// stopPlan ends a run's VMM: a VM with an endpoint drained, the guest asked to stop, its grace
// period, the VMM made to quit, then killed; it waits (plan.WaitFor) while the VMM runs, so that
// no worker waits out a grace period. Its failpoints are "stop/<step>".
func (a *Agent) stopPlan() plan.Plan[*vmrun.Stop] {
	s := stoppers{a}
	return plan.Plan[*vmrun.Stop]{Name: "stop", Reason: "StopFailed", Steps: []steps.StopStep{
		steps.Drain{}, steps.Ask{Stoppers: s}, steps.Grace{}, steps.Quit{Stoppers: s}, steps.Kill{},
	}}
}

// stoppers ask the VM's guest to stop, through its monitor, and its VMM to quit.
type stoppers struct{ a *Agent }

func (s stoppers) RequestStop(uid types.UID) bool {
	s.a.mu.Lock()
	mon := s.a.monitors[uid]
	s.a.mu.Unlock()
	return mon != nil && mon.requestStop()
}

func (s stoppers) Quit(ctx context.Context, kind string, uid types.UID) error {
	return s.a.driver(kind).quit(ctx, uid)
}

// teardownPlan removes a VM from the node, whatever is left of it: its processes, the agent's
// memory of it, its cgroups, network attachment, jail and state directory. Its failpoints are
// "teardown/<step>".
func (a *Agent) teardownPlan() plan.Plan[*vmrun.Teardown] {
	var cgroups func(types.UID)
	if a.Opts.CgroupRoot != "" {
		cgroups = func(uid types.UID) { cgroup.Remove(a.Opts.CgroupRoot, string(uid)) }
	}
	td := teardowns{a}
	return plan.Plan[*vmrun.Teardown]{Name: "teardown", Reason: "TeardownFailed", Steps: []steps.TeardownStep{
		steps.KillVMMs{}, steps.Forget{Memory: td}, steps.Cgroups{Remove: cgroups}, steps.Detach{Detacher: td},
		steps.Jail{Jails: td}, steps.RemoveState{},
	}}
}

// teardowns is what the teardown plan needs of the agent.
type teardowns struct{ a *Agent }

// Forget drops the VM's fetch, monitor and stop, and its claim on a snapshot's shared memory.
func (t teardowns) Forget(uid types.UID) {
	t.a.fetches.Drop(uid)
	t.a.memories.Release(string(uid)) // its VMM is gone
	t.a.stopMonitor(uid)
	t.a.mu.Lock()
	delete(t.a.stops, uid)
	t.a.mu.Unlock()
}

// Detach removes the VM's tap, then has the networks looked at again (one may have lost its
// last VM on the node).
func (t teardowns) Detach(uid types.UID) error {
	defer t.a.networks.kick(types.NamespacedName{})
	if err := t.a.net.Detach(string(uid)); err != nil {
		return err
	}
	// Its endpoint address is free once nothing of its exposure is left.
	t.a.exposer.alloc.Release(string(uid))
	return nil
}

func (t teardowns) RemoveJail(uid types.UID) error { return t.a.removeJail(uid) }

func observeStartStep(step string, took time.Duration) {
	startStepSeconds.WithLabelValues(step).Observe(took.Seconds())
}

// reports is the agent's deferred reports, for the steps.
type reports struct{ a *Agent }

func (r reports) ReportLater(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error {
	return r.a.reportLater(ctx, vm, rt)
}

// identities choose a run's VMM and give it the VM's uid.
type identities struct{ a *Agent }

func (i identities) ChooseVMM(vm *impv1.ImpVM) (impv1.VMMKind, error) { return i.a.chooseVMM(vm) }

// Record allocates the VM's uid and writes its meta under the agent's lock, so that two starts
// never take one uid.
func (i identities) Record(dir string, m *vmrun.Meta) error {
	i.a.mu.Lock()
	defer i.a.mu.Unlock()
	uid, err := i.a.allocJailUID(m.UID)
	if err != nil {
		return err
	}
	m.JailUID = uid
	return vmrun.WriteMeta(dir, m)
}

// launcher starts a run's VMM through the driver of its kind.
type launcher struct{ a *Agent }

func (l launcher) Launch(ctx context.Context, r *vmrun.Run) (*vmm.Record, error) {
	base := r.BaseDisk
	switch {
	case r.Snapshot != nil:
		base = r.Path(vmrun.RestoredBase) // the disk the snapshot's memory knows
	case r.Image != nil:
		base = r.Image.BaseDisk
	}
	spec := launchSpec{vm: r.VM, dir: r.Dir, m: r.Meta, baseDisk: base, at: r.Attachment, net: r.Net, resume: r.Resume}
	if r.Volumes != nil {
		spec.drives = r.Volumes.Drives
	}
	if r.Snapshot != nil {
		spec.restore = r.Snapshot.Dir
	}
	return l.a.driver(string(r.Meta.VMM)).start(ctx, spec)
}

func (l launcher) Resumed(ctx context.Context, r *vmrun.Run, rec *vmm.Record) error {
	return l.a.driver(string(r.Meta.VMM)).resumed(ctx, r.Dir, rec)
}

var (
	_ steps.Reports    = reports{}
	_ steps.Identities = identities{}
	_ steps.Launcher   = launcher{}
	_ steps.Resumer    = launcher{}
	_ steps.Attacher   = (*networks)(nil)
	_ steps.Disks      = (*disk.Writables)(nil)
	_ steps.Memory     = teardowns{}
	_ steps.Detacher   = teardowns{}
	_ steps.Jails      = teardowns{}
	_ steps.Stoppers   = stoppers{}
)
