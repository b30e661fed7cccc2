package agent

import "context"

// SweepSnapshots is sweepSnapshots, for the tests of package agent_test.
func (a *Agent) SweepSnapshots(ctx context.Context) error { return a.sweepSnapshots(ctx) }

// MemoryCgroup is the cgroup of node's snapshot memory cache, for the tests of package
// agent_test.
func MemoryCgroup(node string) string { return memoryCgroupOf(node) }
