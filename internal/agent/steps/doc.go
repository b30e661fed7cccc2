// Package steps holds the steps of the agent's plans for a VM's run (plan.Step on a
// *vmrun.Run), one type a file: each names the little it needs of the agent as an interface of
// its own, measures before it acts, and knows nothing of the other steps.
//
// The start plan (a boot) runs Provenance, StateDir, Image, ConfigDisk, WritableDisk,
// Identity, Intent, Network (for a VM on an ImpNetwork) and Exec; the resume plan runs Intent,
// Network and Exec on the run's saved state, then Resumed; the suspend plan (on a
// *vmrun.Suspend) runs Suspending, Freeze, Save and Suspended. docs/agent.md lists them.
package steps

import (
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Step is a step of a VM run's plan.
type Step = plan.Step[*vmrun.Run]
