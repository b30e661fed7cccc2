// Package vmstats exports the figures of each VM its node runs, as imp_vm_* series labelled with
// the VM's namespace and name (docs/metrics.md, "Each VM's figures"). The node's side needs
// nothing of the guest: its VMM's CPU time and resident memory, and what its writable disk
// takes on the node. The guest's side is what its imp-init says of itself over the guest
// channel (package monitor takes at most one report a second, only after ready, only figures
// that hold together and fit the VM's memory): its memory, CPU time and root filesystem. A
// guest's word is exported for its own VM only, and not once it is a minute old.
package vmstats

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/syscode-labs/imp/internal/agent/monitor"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Runs lists the runs a node follows (monitor.Registry).
type Runs interface {
	Followed() []monitor.Followed
}

var _ Runs = (*monitor.Registry)(nil)

// Stale is the age past which a guest's figures are no longer exported.
const Stale = time.Minute

var labels = []string{"namespace", "name"}

var (
	vmmCPU = prometheus.NewDesc("imp_vm_vmm_cpu_seconds_total",
		"CPU time of the VM's VMM process on its node: its guest's vCPUs and the VMM's own work.", labels, nil)
	vmmResident = prometheus.NewDesc("imp_vm_vmm_resident_bytes",
		"Memory the VM's VMM process holds on its node (resident set): the guest memory it has touched and the VMM's own.", labels, nil)
	diskAllocated = prometheus.NewDesc("imp_vm_disk_allocated_bytes",
		"What the VM's writable disk takes on its node (allocated blocks of its sparse file).", labels, nil)
	guestMemory = prometheus.NewDesc("imp_vm_guest_memory_bytes",
		"The guest's memory as its kernel says (MemTotal), as reported by imp-init: the guest's word.", labels, nil)
	guestAvailable = prometheus.NewDesc("imp_vm_guest_memory_available_bytes",
		"The guest's available memory as its kernel says (MemAvailable), as reported by imp-init: the guest's word.", labels, nil)
	guestCPU = prometheus.NewDesc("imp_vm_guest_cpu_seconds_total",
		"CPU time the guest's vCPUs spent busy, as its kernel says, as reported by imp-init: the guest's word.", labels, nil)
	guestFSSize = prometheus.NewDesc("imp_vm_guest_filesystem_size_bytes",
		"Size of the guest's root filesystem (its writable disk under the image), as reported by imp-init: the guest's word.", labels, nil)
	guestFSFree = prometheus.NewDesc("imp_vm_guest_filesystem_free_bytes",
		"Free space of the guest's root filesystem, as reported by imp-init: the guest's word.", labels, nil)
)

// collector exports the figures of the runs of every source added (one per agent in the
// process: tests run several).
type collector struct {
	mu      sync.Mutex
	sources map[Runs]struct{}
}

var global = &collector{sources: map[Runs]struct{}{}}

func init() { metrics.Registry.MustRegister(global) }

// Add exports the figures of runs' VMs until the returned function is called.
func Add(runs Runs) (remove func()) {
	global.mu.Lock()
	global.sources[runs] = struct{}{}
	global.mu.Unlock()
	return func() {
		global.mu.Lock()
		delete(global.sources, runs)
		global.mu.Unlock()
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{vmmCPU, vmmResident, diskAllocated, guestMemory, guestAvailable, guestCPU, guestFSSize, guestFSFree} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	var runs []monitor.Followed
	for s := range c.sources {
		runs = append(runs, s.Followed()...)
	}
	c.mu.Unlock()
	now := time.Now()
	for _, r := range runs {
		lv := []string{r.Key.Namespace, r.Key.Name}
		if cpu, rss, err := Process(r.Pid); err == nil {
			ch <- prometheus.MustNewConstMetric(vmmCPU, prometheus.CounterValue, cpu.Seconds(), lv...)
			ch <- prometheus.MustNewConstMetric(vmmResident, prometheus.GaugeValue, float64(rss), lv...)
		}
		if fi, err := os.Stat(filepath.Join(r.Dir, vmrun.WritableDisk)); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				ch <- prometheus.MustNewConstMetric(diskAllocated, prometheus.GaugeValue, float64(st.Blocks*512), lv...)
			}
		}
		g := r.Guest
		if g == nil || now.Sub(g.At) > Stale {
			continue
		}
		ch <- prometheus.MustNewConstMetric(guestMemory, prometheus.GaugeValue, float64(g.MemoryTotal), lv...)
		ch <- prometheus.MustNewConstMetric(guestAvailable, prometheus.GaugeValue, float64(g.MemoryAvailable), lv...)
		ch <- prometheus.MustNewConstMetric(guestCPU, prometheus.CounterValue, float64(g.CPUMillis)/1000, lv...)
		if g.FilesystemSize > 0 {
			ch <- prometheus.MustNewConstMetric(guestFSSize, prometheus.GaugeValue, float64(g.FilesystemSize), lv...)
			ch <- prometheus.MustNewConstMetric(guestFSFree, prometheus.GaugeValue, float64(g.FilesystemFree), lv...)
		}
	}
}

// clockTicks is USER_HZ, what /proc/<pid>/stat counts CPU time in.
const clockTicks = 100

// Process is the CPU time (user and system) and resident bytes of process pid, from
// /proc/<pid>/stat and /proc/<pid>/statm.
func Process(pid int) (time.Duration, uint64, error) {
	if pid <= 0 {
		return 0, 0, fmt.Errorf("no process")
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// The command is in parentheses and may hold spaces: fields count from its end.
	i := strings.LastIndexByte(string(stat), ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: no command", pid)
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 13 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	utime, err1 := strconv.ParseUint(f[11], 10, 64) // field 14
	stime, err2 := strconv.ParseUint(f[12], 10, 64) // field 15
	if err1 != nil || err2 != nil {
		return 0, 0, fmt.Errorf("/proc/%d/stat: CPU times", pid)
	}
	statm, err := os.ReadFile(fmt.Sprintf("/proc/%d/statm", pid))
	if err != nil {
		return 0, 0, err
	}
	m := strings.Fields(string(statm))
	if len(m) < 2 {
		return 0, 0, fmt.Errorf("/proc/%d/statm: %q", pid, statm)
	}
	pages, err := strconv.ParseUint(m[1], 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("/proc/%d/statm: %w", pid, err)
	}
	cpu := time.Duration(utime+stime) * time.Second / clockTicks
	return cpu, pages * uint64(os.Getpagesize()), nil
}
