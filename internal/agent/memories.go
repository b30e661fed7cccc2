package agent

import (
	"fmt"

	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
)

// memoryCgroup is the cgroup (under cgroup.Parent) charged with the snapshots' memory that
// restores share, one per node (tests run several on one host): not a VM's UID, so never a
// VM's cgroup.
func (a *Agent) memoryCgroup() string { return memoryCgroupOf(a.Opts.NodeName) }

func memoryCgroupOf(node string) string { return "snapshot-memory." + node }

// memoryCache is the node's cache of snapshots' memory (Options.SnapshotMemoryCache), bounded
// by its cgroup too; nil (no cache: each restore copies) without a budget or cgroups, or, with
// the error, if the cgroup cannot be made or has no memory controller to tell what it holds.
func (a *Agent) memoryCache() (*guestmem.Cache, error) {
	if a.Opts.CgroupRoot == "" || a.Opts.SnapshotMemoryCache <= 0 {
		return nil, nil
	}
	// Beyond the budget, room for what a fill's child holds while it copies (its runtime, the
	// image's page cache, which the kernel reclaims first): the budget is the cache's shared
	// memory alone.
	set, err := cgroup.Prepare(a.Opts.CgroupRoot, a.memoryCgroup(), cgroup.Limits{MemoryBytes: a.Opts.SnapshotMemoryCache + fillHeadroom, Pids: 128})
	if err != nil {
		return nil, fmt.Errorf("the snapshot memory cache's cgroup: %w", err)
	}
	if _, err := set.MemoryStat("shmem"); err != nil {
		return nil, fmt.Errorf("the snapshot memory cache's cgroup: %w", err)
	}
	return guestmem.NewCache(a.Opts.SnapshotMemoryCache, memoryCharge{set}), nil
}

// fillHeadroom is what a fill of the cache's may hold beyond the memory it fills.
const fillHeadroom = 64 << 20

// memoryCacheBytes is the memory the cache may hold, which the node does not offer VMs.
func (a *Agent) memoryCacheBytes() int64 {
	if a.memories == nil {
		return 0
	}
	return a.Opts.SnapshotMemoryCache
}

// memoryCharge is the cache's cgroup.
type memoryCharge struct{ set *cgroup.Set }

func (m memoryCharge) Join(pid int) error {
	_, err := m.set.Join(pid, false)
	return err
}

func (m memoryCharge) Shmem() (int64, error) { return m.set.MemoryStat("shmem") }

// removeSnapshot removes the node's files of snapshot uid and lets go of its cached memory
// (restored VMs keep what they map).
func (a *Agent) removeSnapshot(uid types.UID) error {
	a.memories.Forget(a.snapshots.Path(uid))
	return a.snapshots.Remove(uid)
}

var _ guestmem.Charge = memoryCharge{}
