package steps

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/preflight"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// FetchState is what Provenance asks of the run's image fetch.
type FetchState interface {
	// Fetching: the run's image fetch began and has not finished.
	Fetching(vm *impv1.ImpVM) bool
	// Drop cancels the VM's fetch and lets go of what it holds.
	Drop(uid types.UID)
}

// Provenance refuses to make anything of the VM while a pinned artifact of the node differs
// (reason PinMismatch, and the run's fetch is dropped). It checks as the run's image fetch
// begins and again once it is done, not on every pass in between.
type Provenance struct {
	Pins    []preflight.Pin
	Fetches FetchState
}

func (Provenance) Name() string { return "provenance" }

func (p Provenance) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return len(p.Pins) > 0 && !p.Fetches.Fetching(r.VM), nil
}

func (p Provenance) Do(_ context.Context, r *vmrun.Run) error {
	for _, pin := range p.Pins {
		if err := pin.Verify(); err != nil {
			p.Fetches.Drop(r.VM.HostUID())
			return plan.Fail("PinMismatch", fmt.Errorf("pinned %s: %w", pin.Name, err))
		}
	}
	return nil
}
