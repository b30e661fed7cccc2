package agent

import "context"

// SweepSnapshots is sweepSnapshots, for the tests of package agent_test.
func (a *Agent) SweepSnapshots(ctx context.Context) error { return a.sweepSnapshots(ctx) }
