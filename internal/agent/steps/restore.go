package steps

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Snapshots find the node-local snapshot a VM starts from.
type Snapshots interface {
	// Find returns the snapshot the VM's snapshotRef names, checked: of the VM's namespace,
	// Ready, on this node, and taken on a host like this one with the VM's resources and
	// devices. Its errors are plan failures with their reason (SnapshotNotFound,
	// SnapshotIncompatible, ...).
	Find(ctx context.Context, vm *impv1.ImpVM) (*vmrun.Snapshot, error)
}

// Snapshot is the first step of a restore: the snapshot the run starts from, found and
// checked before anything of the run is made.
type Snapshot struct{ Snapshots Snapshots }

func (Snapshot) Name() string { return "snapshot" }

func (Snapshot) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return r.Snapshot == nil, nil
}

func (s Snapshot) Do(ctx context.Context, r *vmrun.Run) error {
	snap, err := s.Snapshots.Find(ctx, r.VM)
	if err != nil {
		return err
	}
	r.Snapshot = snap
	return nil
}

// RestoreDisk gives the VM its own writable disk, a copy of the snapshot's (sparse, or a reflink
// where the file system shares blocks), and a link to the snapshot's base disk, in the place of
// whatever disk it had: the snapshot's
// memory runs on the snapshot's disk and no other (an older disk of the VM under it would be
// corrupted). A marker beside it (restoredDisk) says which snapshot and placement it is the copy
// for, so that a plan run again does not copy it twice.
type RestoreDisk struct{}

// restoredDisk is the marker of RestoreDisk's copy: "<snapshot uid> <instance>".
const restoredDisk = "rw.restored"

func (RestoreDisk) Name() string { return "restore_disk" }

func (RestoreDisk) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	b, err := os.ReadFile(r.Path(restoredDisk))
	if errors.Is(err, fs.ErrNotExist) {
		return true, nil
	} else if err != nil {
		return false, err
	}
	if string(b) != diskMarker(r) {
		return true, nil
	}
	for _, f := range []string{vmrun.WritableDisk, vmrun.RestoredBase} {
		if _, err := os.Stat(r.Path(f)); errors.Is(err, fs.ErrNotExist) {
			return true, nil
		}
	}
	return false, nil
}

func (RestoreDisk) Do(_ context.Context, r *vmrun.Run) error {
	tmp := r.Path(vmrun.WritableDisk + ".restoring")
	_ = os.Remove(tmp)
	if err := snapshot.CopyDisk(r.Snapshot.Disk, tmp); err != nil {
		return plan.Fail(impv1.ReasonRestoreFailed, err)
	}
	if err := os.Rename(tmp, r.Path(vmrun.WritableDisk)); err != nil {
		return err
	}
	// The run runs on the snapshot's base disk (vmrun.RestoredBase), which its memory knows.
	base := r.Path(vmrun.RestoredBase)
	if err := os.Remove(base); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := snapshot.LinkDisk(r.Snapshot.Base, base); err != nil {
		return plan.Fail(impv1.ReasonRestoreFailed, fmt.Errorf("the snapshot's base disk: %w", err))
	}
	return os.WriteFile(r.Path(restoredDisk), []byte(diskMarker(r)), 0o600)
}

func diskMarker(r *vmrun.Run) string {
	return fmt.Sprintf("%s %d", r.Snapshot.Manifest.UID, r.VM.Status.Instance)
}

// Guests give a restored guest its own identity.
type Guests interface {
	// Reidentify has the guest of r, restored from a snapshot, take on r's identity: its
	// token, network, hostname, configuration, a reseeded random state and the clock.
	Reidentify(ctx context.Context, r *vmrun.Run) error
}

// Reidentify is the step after a restore's VMM runs: the guest takes on the run's own identity
// before the run is reported or watched. Until then the guest holds the snapshot's, and the
// network's rules drop what it sends from the snapshot's MAC. The meta records that it is done.
type Reidentify struct{ Guests Guests }

func (Reidentify) Name() string { return "reidentify" }

func (Reidentify) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return r.Meta != nil && r.Meta.Restore != nil && !r.Meta.Restore.Done, nil
}

func (s Reidentify) Do(ctx context.Context, r *vmrun.Run) error {
	if err := s.Guests.Reidentify(ctx, r); err != nil {
		return plan.Fail(impv1.ReasonRestoreFailed, err)
	}
	r.Meta.Restore.Done = true
	return vmrun.WriteMeta(r.Dir, r.Meta)
}
