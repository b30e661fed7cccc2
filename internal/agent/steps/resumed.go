package steps

import (
	"context"

	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Resumer finishes a resume.
type Resumer interface {
	// Resumed finishes the resume of the VM in dir once its VMM runs (QEMU: the incoming
	// migration done, the guest continued).
	Resumed(ctx context.Context, r *vmrun.Run, rec *vmm.Record) error
}

// Resumed finishes a resume the Exec step began: the guest runs on where it stopped.
type Resumed struct{ Resumer Resumer }

func (Resumed) Name() string { return "resumed" }

func (Resumed) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return (r.Resume || r.Snapshot != nil) && r.Record != nil, nil
}

func (s Resumed) Do(ctx context.Context, r *vmrun.Run) error {
	return s.Resumer.Resumed(ctx, r, r.Record)
}
