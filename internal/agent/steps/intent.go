package steps

import (
	"context"

	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Intent makes a start safe to interrupt: a VMM that an earlier start began but did not record
// (a crash in between) holds the VM's disks and tap, and goes first; then the intent to start
// one is written, so that a crash before this start's record is found the same way. A run whose
// VMM is recorded already (a resume an agent began before it stopped) has nothing to start.
type Intent struct{}

func (Intent) Name() string { return "intent" }

func (Intent) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) { return r.Record == nil, nil }

func (Intent) Do(ctx context.Context, r *vmrun.Run) error {
	if pids := vmm.KillUnrecorded(r.Dir, string(r.VM.HostUID())); len(pids) > 0 {
		log.FromContext(ctx).Info("killed VMMs an interrupted start left unrecorded", "vm", r.VM.HostUID(), "pids", pids)
	}
	return vmm.WriteIntent(r.Dir)
}
