package steps

import (
	"context"

	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Continuers run a paused VM on (vmmdriver.Drivers).
type Continuers interface {
	// Continue runs the VM kept under uid on if it is paused.
	Continue(ctx context.Context, uid types.UID, rec *vmm.Record) error
}

// Continue runs on the paused guest of a warm pool's idle member handed to its claim, before
// the guest is given the claim's identity (its clock is stepped then).
type Continue struct{ Continuers Continuers }

func (Continue) Name() string { return "continue" }

func (Continue) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return r.Record != nil && r.Meta != nil && r.Meta.Restore != nil && !r.Meta.Restore.Done, nil
}

func (s Continue) Do(ctx context.Context, r *vmrun.Run) error {
	if err := s.Continuers.Continue(ctx, r.Meta.HostUID(), r.Record); err != nil {
		return plan.Fail("ContinueFailed", err)
	}
	return nil
}
