package steps

import (
	"context"

	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// VolumeMaker makes a run's volumes (package volume).
type VolumeMaker interface {
	Make(r *vmrun.Run) (*vmrun.Volumes, error)
}

// Volumes makes the run's volumes: its disks, kept across its runs, and its volumes' files,
// which ConfigDisk writes for the guest. A VM without volumes has no such step.
type Volumes struct{ Maker VolumeMaker }

func (Volumes) Name() string { return "volumes" }

func (Volumes) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return r.Volumes == nil, nil
}

func (s Volumes) Do(_ context.Context, r *vmrun.Run) error {
	v, err := s.Maker.Make(r)
	if err != nil {
		return err
	}
	r.Volumes = v
	return nil
}
