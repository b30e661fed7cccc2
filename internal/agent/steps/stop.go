package steps

import (
	"context"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// StopStep is a step of the plan that stops a run's VMM.
type StopStep = plan.Step[*vmrun.Stop]

// The stop plan ends a VMM that runs, over as many passes as it takes, holding no worker: Drain,
// Ask, Grace, Quit, Kill. Every step does nothing once the VMM is gone.

// Stoppers ask and make VMMs stop.
type Stoppers interface {
	// RequestStop asks the guest to stop (its workload gets SIGTERM), and says whether it
	// could ask (a channel to the guest).
	RequestStop(uid types.UID) bool
	// Quit asks the VMM of kind to end at once (QMP quit, Firecracker's Ctrl-Alt-Del).
	Quit(ctx context.Context, kind string, uid types.UID) error
}

// Drain waits, before the guest is asked to stop, until DrainUntil (a VM with an endpoint):
// its endpoint is terminating in every slice from the moment the stop began, and the cluster's
// proxies stop sending it new connections meanwhile.
type Drain struct{}

func (Drain) Name() string { return "drain" }

func (Drain) ShouldDo(_ context.Context, s *vmrun.Stop) (bool, error) {
	return s.Record.Alive() && !s.Asked && time.Until(s.DrainUntil) > 0, nil
}

func (Drain) Do(_ context.Context, s *vmrun.Stop) error {
	return plan.WaitFor(min(time.Until(s.DrainUntil), 500*time.Millisecond))
}

// Ask asks the guest to stop, once.
type Ask struct{ Stoppers Stoppers }

func (Ask) Name() string { return "ask" }

func (Ask) ShouldDo(_ context.Context, s *vmrun.Stop) (bool, error) {
	return s.Record.Alive() && !s.Asked, nil
}

func (a Ask) Do(_ context.Context, s *vmrun.Stop) error {
	s.Asked = a.Stoppers.RequestStop(s.VM.HostUID())
	return nil
}

// Grace leaves the guest its grace period (terminationGracePeriodSeconds): the plan waits,
// coming back every half second to see whether the VMM ended.
type Grace struct{}

func (Grace) Name() string { return "grace" }

func (Grace) ShouldDo(_ context.Context, s *vmrun.Stop) (bool, error) {
	return s.Record.Alive() && time.Until(s.Deadline) > 0, nil
}

func (Grace) Do(_ context.Context, s *vmrun.Stop) error {
	return plan.WaitFor(min(time.Until(s.Deadline), 500*time.Millisecond))
}

// Quit has the VMM quit once the grace period is over, and waits a little for it.
type Quit struct{ Stoppers Stoppers }

func (Quit) Name() string { return "quit" }

func (Quit) ShouldDo(_ context.Context, s *vmrun.Stop) (bool, error) { return s.Record.Alive(), nil }

func (q Quit) Do(ctx context.Context, s *vmrun.Stop) error {
	if err := q.Stoppers.Quit(ctx, s.Record.Kind, s.VM.HostUID()); err != nil {
		log.FromContext(ctx).Info("quitting the VMM failed; killing it", "error", err.Error())
	}
	s.Record.WaitGone(2 * time.Second)
	return nil
}

// Kill kills a VMM that did not quit; one that outlives SIGKILL is looked at again in a second.
type Kill struct{}

func (Kill) Name() string { return "kill" }

func (Kill) ShouldDo(_ context.Context, s *vmrun.Stop) (bool, error) { return s.Record.Alive(), nil }

func (Kill) Do(_ context.Context, s *vmrun.Stop) error {
	_ = syscall.Kill(s.Record.Pid, syscall.SIGKILL)
	if !s.Record.WaitGone(5 * time.Second) {
		return plan.WaitFor(time.Second)
	}
	return nil
}
