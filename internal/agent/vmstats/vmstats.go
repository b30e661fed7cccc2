// Package vmstats exports the figures of each VM its node runs, as imp_vm_* series labelled with
// the VM's namespace and name (docs/metrics.md, "Each VM's figures"). The node's side needs
// nothing of the guest: its VMM's CPU time and resident memory, what its writable disk takes
// on the node, and what its tap carried. The guest's side is what its imp-init says of itself over the guest
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
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/access"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/monitor"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Runs lists the runs a node follows (monitor.Registry).
type Runs interface {
	Followed() []monitor.Followed
}

var _ Runs = (*monitor.Registry)(nil)

// Taps reads what each VM's tap carried, by tap name (hostnet.Host).
type Taps interface {
	Taps() (map[string]hostnet.TapTraffic, error)
}

var _ Taps = (*hostnet.Host)(nil)

// Cached is taps read at most once every every, whoever asks (the scrape, each GET of a VM's
// stats): a reader of the view role asking again and again costs the node one read of its
// taps per every, and holds its networks' lock no longer. Concurrent callers share one read.
func Cached(taps Taps, every time.Duration) Taps {
	return &cachedTaps{taps: taps, every: every}
}

type cachedTaps struct {
	taps  Taps
	every time.Duration

	mu   sync.Mutex
	at   time.Time
	last map[string]hostnet.TapTraffic
	err  error
}

func (c *cachedTaps) Taps() (map[string]hostnet.TapTraffic, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.at.IsZero() || time.Since(c.at) >= c.every {
		c.last, c.err = c.taps.Taps()
		c.at = time.Now()
	}
	return c.last, c.err
}

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
	netReceiveBytes = prometheus.NewDesc("imp_vm_network_receive_bytes_total",
		"Bytes the node delivered to the VM over its tap, as the node counts them.", labels, nil)
	netReceivePackets = prometheus.NewDesc("imp_vm_network_receive_packets_total",
		"Frames the node delivered to the VM over its tap, as the node counts them.", labels, nil)
	netTransmitBytes = prometheus.NewDesc("imp_vm_network_transmit_bytes_total",
		"Bytes the VM sent over its tap (including what its network's rules then dropped), as the node counts them.", labels, nil)
	netTransmitPackets = prometheus.NewDesc("imp_vm_network_transmit_packets_total",
		"Frames the VM sent over its tap (including what its network's rules then dropped), as the node counts them.", labels, nil)
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
	sources map[*source]struct{}
}

// source is one agent's runs and the taps of its node (nil: none counted).
type source struct {
	runs Runs
	taps Taps
}

var global = &collector{sources: map[*source]struct{}{}}

func init() { metrics.Registry.MustRegister(global) }

// Add exports the figures of runs' VMs, their taps' read from taps (nil: none), until the
// returned function is called.
func Add(runs Runs, taps Taps) (remove func()) {
	src := &source{runs: runs, taps: taps}
	global.mu.Lock()
	global.sources[src] = struct{}{}
	global.mu.Unlock()
	return func() {
		global.mu.Lock()
		delete(global.sources, src)
		global.mu.Unlock()
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{vmmCPU, vmmResident, diskAllocated, netReceiveBytes, netReceivePackets, netTransmitBytes, netTransmitPackets, guestMemory, guestAvailable, guestCPU, guestFSSize, guestFSFree} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	sources := make([]*source, 0, len(c.sources))
	for s := range c.sources {
		sources = append(sources, s)
	}
	c.mu.Unlock()
	var runs []monitor.Followed
	taps := map[types.UID]hostnet.TapTraffic{}
	for _, s := range sources {
		followed := s.runs.Followed()
		runs = append(runs, followed...)
		for uid, t := range tapsOf(s.taps, followed) {
			taps[uid] = t
		}
	}
	now := time.Now()
	for _, r := range newest(runs) {
		lv := []string{r.Key.Namespace, r.Key.Name}
		f, vmm, disk := Of(r, taps, now)
		if n := f.Network; n != nil {
			ch <- prometheus.MustNewConstMetric(netReceiveBytes, prometheus.CounterValue, float64(n.ReceiveBytes), lv...)
			ch <- prometheus.MustNewConstMetric(netReceivePackets, prometheus.CounterValue, float64(n.ReceivePackets), lv...)
			ch <- prometheus.MustNewConstMetric(netTransmitBytes, prometheus.CounterValue, float64(n.TransmitBytes), lv...)
			ch <- prometheus.MustNewConstMetric(netTransmitPackets, prometheus.CounterValue, float64(n.TransmitPackets), lv...)
		}
		if vmm {
			ch <- prometheus.MustNewConstMetric(vmmCPU, prometheus.CounterValue, f.VMMCPUSeconds, lv...)
			ch <- prometheus.MustNewConstMetric(vmmResident, prometheus.GaugeValue, float64(f.VMMResidentBytes), lv...)
		}
		if disk {
			ch <- prometheus.MustNewConstMetric(diskAllocated, prometheus.GaugeValue, float64(f.DiskAllocatedBytes), lv...)
		}
		g := f.Guest
		if g == nil {
			continue
		}
		ch <- prometheus.MustNewConstMetric(guestMemory, prometheus.GaugeValue, float64(g.MemoryBytes), lv...)
		ch <- prometheus.MustNewConstMetric(guestAvailable, prometheus.GaugeValue, float64(g.MemoryAvailableBytes), lv...)
		ch <- prometheus.MustNewConstMetric(guestCPU, prometheus.CounterValue, g.CPUSeconds, lv...)
		if g.FilesystemSizeBytes > 0 {
			ch <- prometheus.MustNewConstMetric(guestFSSize, prometheus.GaugeValue, float64(g.FilesystemSizeBytes), lv...)
			ch <- prometheus.MustNewConstMetric(guestFSFree, prometheus.GaugeValue, float64(g.FilesystemFreeBytes), lv...)
		}
	}
}

// newest keeps, of runs of one VM's name, the one started last: a VM deleted without its
// finalizer and made again under its name may have its old run followed a while beside its
// new one, and two series of one name would fail the whole scrape.
func newest(runs []monitor.Followed) []monitor.Followed {
	byKey := map[types.NamespacedName]int{}
	var out []monitor.Followed
	for _, r := range runs {
		i, ok := byKey[r.Key]
		switch {
		case !ok:
			byKey[r.Key] = len(out)
			out = append(out, r)
		case r.Started.After(out[i].Started):
			out[i] = r
		}
	}
	return out
}

// tapsOf is what the taps of runs carried, by their VM's host UID: the node's taps read once.
// A node whose taps cannot be read has none counted (its other figures still are).
func tapsOf(taps Taps, runs []monitor.Followed) map[types.UID]hostnet.TapTraffic {
	if taps == nil || len(runs) == 0 {
		return nil
	}
	byName, _ := taps.Taps() // a namespace that could not be read: the others' taps still count
	out := map[types.UID]hostnet.TapTraffic{}
	for _, r := range runs {
		if t, ok := byName[hostnet.TapName(string(r.UID))]; ok {
			out[r.UID] = t
		}
	}
	return out
}

// Of is the figures of run r at now, with what its tap carried when taps has it, and whether
// its VMM's and its disk's could be read.
func Of(r monitor.Followed, taps map[types.UID]hostnet.TapTraffic, now time.Time) (f impv1.VMFigures, vmm, disk bool) {
	f.At = metav1.NewMicroTime(now)
	if t, ok := taps[r.UID]; ok {
		f.Network = &impv1.NetworkFigures{At: metav1.NewMicroTime(t.At), ReceiveBytes: t.ReceiveBytes, ReceivePackets: t.ReceivePackets,
			TransmitBytes: t.TransmitBytes, TransmitPackets: t.TransmitPackets}
	}
	if cpu, rss, err := Process(r.Pid, r.StartTime); err == nil {
		f.VMMCPUSeconds, f.VMMResidentBytes, vmm = cpu, rss, true
	}
	if fi, err := os.Stat(filepath.Join(r.Dir, vmrun.WritableDisk)); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			f.DiskAllocatedBytes, disk = uint64(st.Blocks)*512, true
		}
	}
	if g := r.Guest; g != nil && now.Sub(g.At) <= Stale {
		f.Guest = &impv1.GuestFigures{At: metav1.NewMicroTime(g.At), MemoryBytes: g.MemoryTotal, MemoryAvailableBytes: g.MemoryAvailable,
			CPUSeconds: float64(g.CPUMillis) / 1000, FilesystemSizeBytes: g.FilesystemSize, FilesystemFreeBytes: g.FilesystemFree}
	}
	return f, vmm, disk
}

// Serving is the node's runs as the access endpoint serves them, with their figures (GET
// .../stats, kubectl imp top).
type Serving struct {
	*monitor.Registry
	// Taps, when set, counts what the VMs' taps carried.
	Taps Taps
}

var _ access.Figurer = Serving{}

// Figures are the figures of the VM key with uid, followed on the node.
func (s Serving) Figures(key types.NamespacedName, uid types.UID) (impv1.VMFigures, error) {
	for _, r := range s.Followed() {
		if r.Key == key && r.UID == uid {
			f, _, _ := Of(r, tapsOf(s.Taps, []monitor.Followed{r}), time.Now())
			return f, nil
		}
	}
	return impv1.VMFigures{}, fmt.Errorf("ImpVM %s does not run on this node", key)
}

// clockTicks is USER_HZ, what /proc/<pid>/stat counts CPU time in.
const clockTicks = 100

// Process is the CPU time in seconds (user and system) and the resident bytes of process pid,
// from /proc/<pid>/stat and /proc/<pid>/statm, when it is the process that started at
// startTime (clock ticks after boot, stat's field 22): a pid reused by another is not measured.
func Process(pid int, startTime uint64) (float64, uint64, error) {
	if pid <= 0 {
		return 0, 0, fmt.Errorf("no process")
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// The command is in parentheses and may hold spaces: fields count from its end (field 3).
	i := strings.LastIndexByte(string(stat), ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: no command", pid)
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 20 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	if st, err := strconv.ParseUint(f[19], 10, 64); err != nil || st != startTime { // field 22
		return 0, 0, fmt.Errorf("process %d is not the one started at %d", pid, startTime)
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
	return float64(utime+stime) / clockTicks, pages * uint64(os.Getpagesize()), nil
}
