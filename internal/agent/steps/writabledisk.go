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
// across its runs.
type WritableDisk struct{ Disks Disks }

func (WritableDisk) Name() string { return "writable_disk" }

func (WritableDisk) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	if r.VM.Status.Resources == nil { // what the VMM is sized by, too: never started without it
		return false, errors.New("the VM has no resources recorded by its placement")
	}
	_, err := os.Stat(r.Path(vmrun.WritableDisk))
	if errors.Is(err, fs.ErrNotExist) {
		return true, nil
	}
	return false, err
}

func (s WritableDisk) Do(_ context.Context, r *vmrun.Run) error {
	return s.Disks.Ensure(r.Path(vmrun.WritableDisk), r.VM.Status.Resources.DiskSize.Value())
}
