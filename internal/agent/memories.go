package agent

import (
	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
)

// memoryCgroup is the cgroup (under cgroup.Parent) charged with the snapshots' memory that
// restores share, one per node (tests run several on one host): not a VM's UID, so never a
// VM's cgroup.
func (a *Agent) memoryCgroup() string { return "snapshot-memory." + a.Opts.NodeName }

// memoryCache is the node's cache of snapshots' memory (Options.SnapshotMemoryCache), bounded
// by its cgroup too; nil (no cache: each restore copies) without a budget or cgroups, or if the
// cgroup cannot be made or has no memory controller to tell what it holds.
func (a *Agent) memoryCache() *guestmem.Cache {
	if a.memoryCacheBytes() == 0 {
		return nil
	}
	set, err := cgroup.Prepare(a.Opts.CgroupRoot, a.memoryCgroup(), cgroup.Limits{MemoryBytes: a.Opts.SnapshotMemoryCache, Pids: 128})
	if err != nil {
		return nil
	}
	if _, err := set.MemoryUsage(); err != nil {
		return nil
	}
	return guestmem.NewCache(a.Opts.SnapshotMemoryCache, memoryCharge{set})
}

// memoryCacheBytes is the memory the cache may hold, which the node does not offer VMs.
func (a *Agent) memoryCacheBytes() int64 {
	if a.Opts.CgroupRoot == "" {
		return 0
	}
	return max(a.Opts.SnapshotMemoryCache, 0)
}

// memoryCharge is the cache's cgroup.
type memoryCharge struct{ set *cgroup.Set }

func (m memoryCharge) Join(pid int) error {
	_, err := m.set.Join(pid, false)
	return err
}

func (m memoryCharge) Usage() (int64, error) { return m.set.MemoryUsage() }

// removeSnapshot removes the node's files of snapshot uid and lets go of its cached memory
// (restored VMs keep what they map).
func (a *Agent) removeSnapshot(uid types.UID) error {
	a.memories.Forget(a.snapshots.Path(uid))
	return a.snapshots.Remove(uid)
}

var _ guestmem.Charge = memoryCharge{}
