package steps

import (
	"context"
	"errors"
	"net/netip"
	"reflect"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Exposer makes a VM's declared ports reachable at its endpoint address.
type Exposer interface {
	// Expose gives the VM attached at at its endpoint address (want, its record's, when it
	// can keep it) and forwards its declared ports there; it returns the address, or the zero
	// address when the VM declares no ports or the node has no endpoint block (nothing is
	// exposed then).
	Expose(ctx context.Context, vm *impv1.ImpVM, at hostnet.Attachment, want netip.Addr) (netip.Addr, error)
}

// Expose makes the VM reachable by Services: its endpoint address, routed into its network's
// namespace, forwarding its declared ports and nothing else (reason ExposeFailed). Only VMs on
// a network have the step. The address goes into the run's record, so the next run, and an
// agent that restarted, keep it.
type Expose struct{ Exposer Exposer }

func (Expose) Name() string { return "expose" }

func (Expose) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return r.VM.Spec.NetworkRef != nil && r.Attachment.IP.IsValid() && r.Meta != nil, nil
}

func (s Expose) Do(ctx context.Context, r *vmrun.Run) error {
	want, _ := netip.ParseAddr(r.Meta.Endpoint)
	e, err := s.Exposer.Expose(ctx, r.VM, r.Attachment, want)
	if errors.Is(err, plan.ErrWait) {
		return err // the node's endpoint block is not assigned yet
	}
	if err != nil {
		return plan.Fail("ExposeFailed", err)
	}
	ep, ports := "", []impv1.VMPort(nil)
	if e.IsValid() {
		ep, ports = e.String(), r.VM.Spec.Ports
	}
	if ep == r.Meta.Endpoint && reflect.DeepEqual(ports, r.Meta.Ports) {
		return nil
	}
	r.Meta.Endpoint, r.Meta.Ports = ep, ports
	return vmrun.WriteMeta(r.Dir, r.Meta)
}
