package steps

import (
	"context"
	"errors"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// OSBoot refuses to start a VM that boots an OS (spec.boot OS) under Firecracker, which is not
// built: no test boots it there, and its guest channel's vsock ports are above 1023, which any
// user of the OS may bind while the guest side does not hold them (docs/os.md).
type OSBoot struct {
	// ChooseVMM is the VMM a run without a record yet will have.
	ChooseVMM func(*impv1.ImpVM) (impv1.VMMKind, error)
}

func (OSBoot) Name() string { return "os_boot" }

func (OSBoot) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return r.VM.Spec.Boot == impv1.BootOS, nil
}

func (s OSBoot) Do(_ context.Context, r *vmrun.Run) error {
	kind := impv1.VMMKind("")
	if r.Meta != nil {
		kind = r.Meta.VMM
	} else if s.ChooseVMM != nil {
		var err error
		if kind, err = s.ChooseVMM(r.VM); err != nil {
			return err
		}
	}
	if kind == impv1.VMMFirecracker {
		return errors.New("boot OS under Firecracker is not built yet (docs/os.md): give the VM a class of VMM qemu")
	}
	return nil
}
