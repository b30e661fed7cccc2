package steps

import (
	"context"
	"errors"
	"io/fs"
	"os"

	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Disks makes writable disks.
type Disks interface {
	// Ensure makes a fresh ext4 disk of size bytes at path unless one is there.
	Ensure(path string, size int64) error
}

// WritableDisk gives the VM its own writable disk, of the size its placement recorded, kept
// across its runs. A booted run needs no restored run's base disk (vmrun.RestoredBase): it goes,
// so that it holds the node's disk no longer than the restored run.
type WritableDisk struct{ Disks Disks }

func (WritableDisk) Name() string { return "writable_disk" }

func (WritableDisk) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	if r.VM.Status.Resources == nil { // what the VMM is sized by, too: never started without it
		return false, errors.New("the VM has no resources recorded by its placement")
	}
	if _, err := os.Stat(r.Path(vmrun.WritableDisk)); errors.Is(err, fs.ErrNotExist) {
		return true, nil
	} else if err != nil {
		return false, err
	}
	_, err := os.Lstat(r.Path(vmrun.RestoredBase)) // a restored run's, to remove
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return err == nil, err
}

func (s WritableDisk) Do(_ context.Context, r *vmrun.Run) error {
	if err := os.Remove(r.Path(vmrun.RestoredBase)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return s.Disks.Ensure(r.Path(vmrun.WritableDisk), r.VM.Status.Resources.DiskSize.Value())
}
