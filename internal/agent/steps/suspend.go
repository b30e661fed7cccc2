package steps

import (
	"context"
	"errors"
	"fmt"
	"time"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// SuspendStep is a step of the suspend plan.
type SuspendStep = plan.Step[*vmrun.Suspend]

// RuntimeReports write a run's state at once.
type RuntimeReports interface {
	Report(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error
}

// Suspending reports the run Suspending: its memory is being saved.
type Suspending struct{ Reports RuntimeReports }

func (Suspending) Name() string { return "suspending" }

func (Suspending) ShouldDo(_ context.Context, s *vmrun.Suspend) (bool, error) {
	return s.Runtime.State != impv1.RuntimeSuspending, nil
}

func (st Suspending) Do(ctx context.Context, s *vmrun.Suspend) error {
	rt := s.Runtime
	rt.State, rt.Message = impv1.RuntimeSuspending, "saving the VM's memory and device state"
	if err := st.Reports.Report(ctx, s.VM, rt); err != nil {
		return plan.Retry(err)
	}
	return nil
}

// Freezer has a running VM's guest freeze its workload: a suspended VM's saved state may be
// snapshotted, and its copies restored. A workload that is not frozen is told in an Event; the
// suspension goes on.
type Freezer interface {
	FreezeWorkload(vm *impv1.ImpVM, action string)
}

// Freeze has the guest freeze its workload before its state is saved; the next run's monitor
// thaws it, resumed or not.
type Freeze struct{ Freezer Freezer }

func (Freeze) Name() string { return "freeze" }

func (Freeze) ShouldDo(_ context.Context, s *vmrun.Suspend) (bool, error) { return s.Alive(), nil }

func (st Freeze) Do(_ context.Context, s *vmrun.Suspend) error {
	st.Freezer.FreezeWorkload(s.VM, "Suspend")
	return nil
}

// Savers save a running VM's state and end its VMM (its monitor stopped first: the VMM exits
// on purpose).
type Savers interface {
	Save(ctx context.Context, s *vmrun.Suspend) error
}

// Save saves the VM's memory and device state in its state directory and waits for its VMM to
// end.
type Save struct{ Savers Savers }

func (Save) Name() string { return "save" }

func (Save) ShouldDo(_ context.Context, s *vmrun.Suspend) (bool, error) { return s.Alive(), nil }

func (st Save) Do(ctx context.Context, s *vmrun.Suspend) error {
	began := time.Now()
	if err := st.Savers.Save(ctx, s); err != nil {
		return err
	}
	s.Record.WaitGone(30 * time.Second)
	if s.Record.Alive() {
		return errors.New("the VMM did not exit after saving its state")
	}
	s.Took = time.Since(began)
	return nil
}

// Suspended reports the run Suspended, its VMM gone and its state saved.
type Suspended struct{ Reports RuntimeReports }

func (Suspended) Name() string { return "suspended" }

func (Suspended) ShouldDo(_ context.Context, s *vmrun.Suspend) (bool, error) { return !s.Alive(), nil }

func (st Suspended) Do(ctx context.Context, s *vmrun.Suspend) error {
	rt := s.Runtime
	rt.State, rt.GuestReady, rt.Reason, rt.Message = impv1.RuntimeSuspended, false, "", "state saved"
	if s.Took > 0 {
		rt.Message = fmt.Sprintf("state saved in %v", s.Took.Round(time.Millisecond))
		if res := s.VM.Status.Resources; res != nil {
			rt.Message += fmt.Sprintf("; %s of memory freed", res.Memory.String())
		}
	}
	if err := st.Reports.Report(ctx, s.VM, rt); err != nil {
		return plan.Retry(err)
	}
	return nil
}
