package steps

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// TeardownStep is a step of the plan that removes a VM from the node.
type TeardownStep = plan.Step[*vmrun.Teardown]

// The teardown plan removes everything of a VM from the node, in this order: KillVMMs,
// Forget, Cgroups, Detach, Jail, RemoveState. Each is safe to run again: a teardown
// interrupted anywhere is finished by the next.

// KillVMMs kills what runs of the VM: its recorded VMM, and any process that carries its
// marker (a VMM a crash left unrecorded). Nothing of a VM being removed may run on.
type KillVMMs struct{}

func (KillVMMs) Name() string { return "kill_vmms" }

func (KillVMMs) ShouldDo(_ context.Context, t *vmrun.Teardown) (bool, error) {
	if rec, err := vmm.ReadRecord(t.Dir); err == nil && rec.Alive() {
		return true, nil
	}
	return len(vmm.MarkedIn(string(t.UID), t.Dir)) > 0, nil
}

func (KillVMMs) Do(_ context.Context, t *vmrun.Teardown) error {
	if rec, err := vmm.ReadRecord(t.Dir); err == nil && rec.Alive() {
		_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
	}
	vmm.KillMarkedIn(string(t.UID), t.Dir, 5*time.Second)
	return nil
}

// Memory is the agent's memory of its VMs' work under way.
type Memory interface {
	// Forget drops what the agent keeps of the VM: its fetch, its monitor, its stop.
	Forget(uid types.UID)
}

// Forget drops the agent's memory of the VM.
type Forget struct{ Memory Memory }

func (Forget) Name() string { return "forget" }

func (Forget) ShouldDo(context.Context, *vmrun.Teardown) (bool, error) { return true, nil }

func (s Forget) Do(_ context.Context, t *vmrun.Teardown) error {
	s.Memory.Forget(t.UID)
	return nil
}

// Cgroups removes the cgroups of a VM: the VMM's, made by the agent or the jailer.
type Cgroups struct {
	// Remove removes the VM's cgroups ("" root: the agent makes none).
	Remove func(uid types.UID)
}

func (Cgroups) Name() string { return "cgroups" }

func (s Cgroups) ShouldDo(context.Context, *vmrun.Teardown) (bool, error) {
	return s.Remove != nil, nil
}

func (s Cgroups) Do(_ context.Context, t *vmrun.Teardown) error {
	s.Remove(t.UID)
	return nil
}

// Detacher takes a VM off its network.
type Detacher interface {
	// Detach removes the VM's tap and its rules (nothing when it has none).
	Detach(uid types.UID) error
}

// Detach removes the VM's network attachment.
type Detach struct{ Detacher Detacher }

func (Detach) Name() string { return "detach" }

func (Detach) ShouldDo(context.Context, *vmrun.Teardown) (bool, error) { return true, nil }

func (s Detach) Do(_ context.Context, t *vmrun.Teardown) error {
	if err := s.Detacher.Detach(t.UID); err != nil {
		return fmt.Errorf("removing the network attachment of %s: %w", t.Name, err)
	}
	return nil
}

// Jails remove Firecracker jails.
type Jails interface {
	// RemoveJail removes the VM's jail, when it has one.
	RemoveJail(uid types.UID) error
}

// Jail removes the VM's jail.
type Jail struct{ Jails Jails }

func (Jail) Name() string { return "jail" }

func (Jail) ShouldDo(context.Context, *vmrun.Teardown) (bool, error) { return true, nil }

func (s Jail) Do(_ context.Context, t *vmrun.Teardown) error {
	if err := s.Jails.RemoveJail(t.UID); err != nil {
		return fmt.Errorf("removing the jail of %s: %w", t.Name, err)
	}
	return nil
}

// RemoveState removes the VM's state directory: its disks, console, records.
type RemoveState struct{}

func (RemoveState) Name() string { return "remove_state" }

func (RemoveState) ShouldDo(_ context.Context, t *vmrun.Teardown) (bool, error) {
	_, err := os.Lstat(t.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return true, err
}

func (RemoveState) Do(_ context.Context, t *vmrun.Teardown) error {
	if err := os.RemoveAll(t.Dir); err != nil {
		return fmt.Errorf("removing the state of %s: %w", t.Name, err)
	}
	return nil
}
