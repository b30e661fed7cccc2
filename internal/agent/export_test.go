package agent

import "context"

// SweepSnapshots is the snapshotter's sweep, for the tests of package agent_test.
func (a *Agent) SweepSnapshots(ctx context.Context) error { return a.snapshots.Sweep(ctx) }
