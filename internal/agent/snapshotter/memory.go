package snapshotter

import (
	"fmt"

	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
)

// MemoryCgroup is the cgroup (under cgroup.Parent) charged with the snapshots' memory that
// restores share on node, one per node (tests run several on one host): not a VM's UID, so
// never a VM's cgroup.
func MemoryCgroup(node string) string { return "snapshot-memory." + node }

// NewMemoryCache is node's cache of snapshots' memory, of budget bytes, bounded by its cgroup
// under cgroupRoot too; nil (no cache: each restore copies) without a budget or cgroups, or,
// with the error, if the cgroup cannot be made or has no memory controller to tell what it
// holds.
func NewMemoryCache(cgroupRoot, node string, budget int64) (*guestmem.Cache, error) {
	if cgroupRoot == "" || budget <= 0 {
		return nil, nil
	}
	// Beyond the budget, room for what a fill's child holds while it copies (its runtime, the
	// image's page cache, which the kernel reclaims first): the budget is the cache's shared
	// memory alone.
	set, err := cgroup.Prepare(cgroupRoot, MemoryCgroup(node), cgroup.Limits{MemoryBytes: budget + fillHeadroom, Pids: 128})
	if err != nil {
		return nil, fmt.Errorf("the snapshot memory cache's cgroup: %w", err)
	}
	if _, err := set.MemoryStat("shmem"); err != nil {
		return nil, fmt.Errorf("the snapshot memory cache's cgroup: %w", err)
	}
	return guestmem.NewCache(budget, memoryCharge{set}), nil
}

// fillHeadroom is what a fill of the cache's may hold beyond the memory it fills.
const fillHeadroom = 64 << 20

// memoryCharge is the cache's cgroup.
type memoryCharge struct{ set *cgroup.Set }

func (m memoryCharge) Join(pid int) error {
	_, err := m.set.Join(pid, false)
	return err
}

func (m memoryCharge) Shmem() (int64, error) { return m.set.MemoryStat("shmem") }

// remove removes the node's files of snapshot uid and lets go of its cached memory (restored
// VMs keep what they map).
func (s *Snapshotter) remove(uid types.UID) error {
	s.Memories.Forget(s.Store.Path(uid))
	return s.Store.Remove(uid)
}

var _ guestmem.Charge = memoryCharge{}
