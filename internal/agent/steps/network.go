package steps

import (
	"context"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// Attacher plumbs a VM into its ImpNetwork on the node.
type Attacher interface {
	// Attach gives the VM its tap on its network's bridge, with its anti-spoofing rules, and
	// returns the guest's side of the network.
	Attach(ctx context.Context, vm *impv1.ImpVM) (hostnet.Attachment, *guestinit.Net, error)
}

// Network attaches a VM on an ImpNetwork to it (reason NetworkFailed); the plan of a VM
// without one has no Network step. The tap's descriptor is closed when the plan ends: the VMM
// holds its own.
type Network struct{ Attacher Attacher }

func (Network) Name() string { return "network" }

func (Network) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return r.VM.Spec.NetworkRef != nil && r.Attachment.Tap == nil, nil
}

func (s Network) Do(ctx context.Context, r *vmrun.Run) error {
	at, gnet, err := s.Attacher.Attach(ctx, r.VM)
	if err != nil {
		return plan.Fail("NetworkFailed", err)
	}
	r.Attachment, r.Net = at, gnet
	if at.Tap != nil {
		r.Defer(func() { at.Tap.Close() })
	}
	return nil
}
