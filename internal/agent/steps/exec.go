package steps

import (
	"context"

	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Launcher starts a run's VMM through its driver.
type Launcher interface {
	// Launch starts the VMM of r (r.Meta's kind): a boot, or with r.Resume its saved state,
	// and records it.
	Launch(ctx context.Context, r *vmrun.Run) (*vmm.Record, error)
}

// Exec starts the VMM, in its cgroups and under its confinement, and records it; the intent
// is cleared once the record is written.
type Exec struct{ Launcher Launcher }

func (Exec) Name() string { return "exec" }

func (Exec) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) { return r.Record == nil, nil }

func (s Exec) Do(ctx context.Context, r *vmrun.Run) error {
	rec, err := s.Launcher.Launch(ctx, r)
	if err != nil {
		return err
	}
	if err := vmm.ClearIntent(r.Dir); err != nil {
		return err
	}
	r.Record = rec
	return nil
}
