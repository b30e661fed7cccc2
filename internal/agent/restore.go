package agent

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/guestchan"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// restores reports whether the VM's run starts by restoring its snapshot: a VM with a
// snapshotRef, or a copy of a template, whose placement has not had a run restored yet (none
// recorded of this placement, or one whose guest never took on its identity). Once one was,
// later runs of the placement boot from the VM's disk, as a restarted machine does: their meta
// records no restore.
func restores(vm *impv1.ImpVM, old *meta) bool {
	if vm.RestoreFrom() == "" {
		return false
	}
	return old == nil || old.Instance != vm.Status.Instance || (old.Restore != nil && !old.Restore.Done)
}

// finishRestorePlan finishes a restore an agent began and did not see through (it stopped
// after the VMM started): the guest run on, and given its identity.
func (a *Agent) finishRestorePlan(vm *impv1.ImpVM) plan.Plan[*vmrun.Run] {
	var ss []steps.Step
	if vm.Spec.NetworkRef != nil {
		ss = append(ss, steps.Network{Attacher: a.networks})
	}
	ss = append(ss, steps.Resumed{Resumer: launcher{a}}, steps.Reidentify{Guests: guests{a}})
	return plan.Plan[*vmrun.Run]{Name: "restore", Reason: impv1.ReasonRestoreFailed, Steps: ss}
}

// snapshotFinder finds a restore's snapshot: the ImpVMSnapshot as the API server has it now,
// and its files on this node.
type snapshotFinder struct{ a *Agent }

func (f snapshotFinder) Find(ctx context.Context, vm *impv1.ImpVM) (*vmrun.Snapshot, error) {
	a := f.a
	name := vm.RestoreFrom()
	snap := &impv1.ImpVMSnapshot{}
	if err := a.APIReader.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: name}, snap); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, plan.Fail(impv1.ReasonSnapshotNotFound, fmt.Errorf("ImpVMSnapshot %q does not exist in namespace %s", name, vm.Namespace))
		}
		return nil, plan.Retry(err)
	}
	switch {
	case snap.Status.Source == nil && snap.Status.Phase == impv1.SnapshotReady:
		return nil, plan.Fail(impv1.ReasonSnapshotNotReady, fmt.Errorf("ImpVMSnapshot %s says nothing of what it was taken of", name))
	case !snap.DeletionTimestamp.IsZero():
		return nil, plan.Fail(impv1.ReasonSnapshotNotFound, fmt.Errorf("ImpVMSnapshot %s is being deleted", name))
	case snap.Status.Phase != impv1.SnapshotReady:
		return nil, plan.Fail(impv1.ReasonSnapshotNotReady, fmt.Errorf("ImpVMSnapshot %s is not Ready", name))
	case snap.Status.NodeName != a.Opts.NodeName && (snap.Spec.Registry == nil || snap.Status.Digest == ""):
		return nil, plan.Fail(impv1.ReasonSnapshotIncompatible, fmt.Errorf("ImpVMSnapshot %s is on node %s, not %s, and not pushed to a registry", name, snap.Status.NodeName, a.Opts.NodeName))
	case snap.Status.NodeName != a.Opts.NodeName:
		// Another node's, pushed: pulled into this node's store first.
		if err := a.pulled(vm, snap); err != nil {
			if errors.Is(err, plan.ErrWait) {
				return nil, err
			}
			return nil, plan.Fail(impv1.ReasonRestoreFailed, err)
		}
	}
	m, err := a.snapshots.Read(snap.UID)
	if err != nil {
		return nil, plan.Fail(impv1.ReasonSnapshotNotFound, fmt.Errorf("ImpVMSnapshot %s has no files on node %s: %w", name, a.Opts.NodeName, err))
	}
	// The files say whose they are: never another namespace's memory, whatever the API says.
	if m.Namespace != vm.Namespace || m.Name != snap.Name {
		return nil, plan.Fail(impv1.ReasonSnapshotNotFound, fmt.Errorf("the files of ImpVMSnapshot %s on node %s are of %s/%s, not of namespace %s", name, a.Opts.NodeName, m.Namespace, m.Name, vm.Namespace))
	}
	if err := f.fits(vm, m); err != nil {
		return nil, plan.Fail(impv1.ReasonSnapshotIncompatible, fmt.Errorf("ImpVMSnapshot %s: %w", name, err))
	}
	base := a.snapshots.File(snap.UID, snapshot.BaseFile)
	if _, err := os.Stat(base); err != nil {
		// Its memory knows a base disk it did not keep: no node's disk of the image stands in.
		return nil, plan.Fail(impv1.ReasonSnapshotIncompatible, fmt.Errorf("ImpVMSnapshot %s has no base disk on node %s (taken by an older agent: take it again): %w", name, a.Opts.NodeName, err))
	}
	return &vmrun.Snapshot{Name: name, Manifest: m, Dir: a.snapshots.Path(snap.UID), Disk: a.snapshots.File(snap.UID, snapshot.DiskFile), Base: base}, nil
}

// fits says why the snapshot m cannot run as vm on this node, or nil: its host (VMM, version,
// acceleration, kernel, initramfs, CPU), its resources and its devices must be the VM's.
func (f snapshotFinder) fits(vm *impv1.ImpVM, m *snapshot.Manifest) error {
	kind, err := f.a.chooseVMM(vm)
	if err != nil {
		return err
	}
	host, err := f.a.snapshotHost(kind)
	if err != nil {
		return err
	}
	if err := m.Compatible(host); err != nil {
		return err
	}
	res := vm.Status.Resources
	switch {
	case res == nil:
		return fmt.Errorf("the VM has no resources recorded by its placement")
	case res.VCPUs != m.VCPUs || res.Memory.Value()>>20 != m.MemoryMiB:
		return fmt.Errorf("it was taken of a VM with %d vCPUs and %d MiB; this VM has %d and %d MiB", m.VCPUs, m.MemoryMiB, res.VCPUs, res.Memory.Value()>>20)
	case m.DiskBytes != 0 && res.DiskSize.Value() != m.DiskBytes:
		return fmt.Errorf("it was taken of a VM with a disk of %d bytes; this VM's is %d", m.DiskBytes, res.DiskSize.Value())
	case (vm.Spec.NetworkRef != nil) != m.Network:
		return fmt.Errorf("the network interface of its VM and this VM's differ (one has none)")
	}
	return nil
}

// snapshotHost is what a snapshot taken under kind on this node depends on.
func (a *Agent) snapshotHost(kind impv1.VMMKind) (snapshot.Host, error) {
	h := snapshot.Host{VMM: kind}
	for _, c := range a.vmms {
		if c.Kind == kind {
			h.VMMVersion, h.Accel = c.Version, c.Acceleration
		}
	}
	var err error
	if h.Kernel, err = a.hashes.Of(a.Opts.Kernel); err != nil {
		return h, fmt.Errorf("hashing the guest kernel: %w", err)
	}
	if h.Initramfs, err = a.hashes.Of(a.Opts.Initramfs); err != nil {
		return h, fmt.Errorf("hashing the initramfs: %w", err)
	}
	cpuinfo, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return h, err
	}
	h.CPU = snapshot.CPU(string(cpuinfo))
	return h, nil
}

// guests give restored guests their identity over the guest channel.
type guests struct{ a *Agent }

// restoreTimeout bounds a restored guest's taking on its identity.
const restoreTimeout = 20 * time.Second

func (g guests) Reidentify(ctx context.Context, r *vmrun.Run) error {
	conn, err := g.a.driver(string(r.Meta.VMM)).dial(r.Dir)
	if err != nil {
		return fmt.Errorf("connecting to the restored guest's channel: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	// Kept open, once the guest answered on it, for the run's monitor (vmrun.Run.Channel).
	kept := false
	defer func() {
		if !kept {
			conn.Close()
		}
	}()
	req := guestinit.Restore{Token: r.Meta.Token, UnixNano: time.Now().UnixNano(), Entropy: make([]byte, 64)}
	if _, err := rand.Read(req.Entropy); err != nil {
		return err
	}
	if r.Net != nil {
		req.Net = r.Net.Params()
	}
	// The run's configuration as the config_disk step made it: the guest need not read its
	// disk (block I/O of cold code under TCG). A restore finished after an agent restart has
	// none, and the guest reads the disk: the agent never reads back that file, which a
	// Firecracker VMM, whose jail holds it, may write.
	req.Config = r.Config
	answered, err := guestchan.Restore(conn, r.Meta.Restore.Token, req, restoreTimeout)
	if err != nil {
		return err
	}
	if stop() && conn.SetDeadline(time.Time{}) == nil {
		r.Channel, kept = answered, true
	}
	return nil
}

var (
	_ steps.Snapshots = snapshotFinder{}
	_ steps.Guests    = guests{}
)

// finishRestore runs finishRestorePlan on the run's live VMM; a failure ends the run. (The
// guest channel the identity was given on is closed with the plan: the monitor of this rare
// path connects anew.)
func (a *Agent) finishRestore(ctx context.Context, vm *impv1.ImpVM, dir string, m *meta, rec *vmm.Record) error {
	r := &vmrun.Run{VM: vm, Dir: dir, Old: m, Meta: m, Resume: true, Record: rec}
	defer r.Done()
	err := a.finishRestorePlan(vm).Run(ctx, r)
	var failed *plan.Failed
	if errors.As(err, &failed) {
		if rec.Alive() {
			_ = a.driver(string(m.VMM)).quit(ctx, vm.UID)
		}
		return a.startFailed(ctx, vm, failed.Reason, failed.Err)
	}
	return err
}
