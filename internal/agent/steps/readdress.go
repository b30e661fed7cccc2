package steps

import (
	"context"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// Readdressers move a running VM's tap rules to its own address (nodenet.Networks).
type Readdressers interface {
	Readdress(ctx context.Context, vm *impv1.ImpVM) (hostnet.Attachment, *guestinit.Net, error)
}

// Readdress is the Network step of a run whose VMM runs and holds its tap (a warm pool member
// handed to its claim, a restore finished after an agent restart): the tap's anti-spoofing
// rules are moved to the VM's MAC and address, and what the guest sends from any other is
// dropped from then on.
type Readdress struct{ Networks Readdressers }

func (Readdress) Name() string { return "readdress" }

func (Readdress) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return r.VM.Spec.NetworkRef != nil && !r.Attachment.IP.IsValid(), nil
}

func (s Readdress) Do(ctx context.Context, r *vmrun.Run) error {
	at, gnet, err := s.Networks.Readdress(ctx, r.VM)
	if err != nil {
		return plan.Fail("NetworkFailed", err)
	}
	r.Attachment, r.Net = at, gnet
	return nil
}
