package vmstats

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/monitor"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
)

type runs []monitor.Followed

func (r runs) Followed() []monitor.Followed { return r }

type taps map[string]hostnet.TapTraffic

func (t taps) Taps() (map[string]hostnet.TapTraffic, error) { return t, nil }

// TestFigures (docs/security.md): a run's figures are its VMM's only while the pid is the
// process its record names (a pid reused is not measured), its guest's only while a minute
// fresh; two runs of one VM's name (a VM made again under its name while its old run is still
// followed) give one series, the newer's, and the scrape does not fail.
func TestFigures(t *testing.T) {
	start, err := vmm.StartTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, vmrun.WritableDisk), make([]byte, 64<<10), 0o600); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	key := types.NamespacedName{Namespace: "ns-vmstats", Name: "vm"}
	run := monitor.Followed{Key: key, UID: "u1", Pid: os.Getpid(), StartTime: start, Started: now, Dir: dir,
		Guest: &monitor.GuestStats{Stats: guestinit.Stats{MemoryTotal: 100 << 20, MemoryAvailable: 40 << 20, CPUMillis: 1500}, At: now}}
	f, vmmOK, disk := Of(run, nil, now)
	if !vmmOK || !disk || f.VMMResidentBytes == 0 || f.DiskAllocatedBytes < 64<<10 || f.Guest == nil || f.Guest.MemoryBytes != 100<<20 || f.Guest.CPUSeconds != 1.5 {
		t.Errorf("a live run's figures: %+v (guest %+v), VMM %v, disk %v", f, f.Guest, vmmOK, disk)
	}
	reused := run
	reused.StartTime++
	if f, vmmOK, _ := Of(reused, nil, now); vmmOK || f.VMMResidentBytes != 0 {
		t.Errorf("a pid reused by another process was measured: %+v", f)
	}
	stale := run
	stale.Guest = &monitor.GuestStats{Stats: run.Guest.Stats, At: now.Add(-2 * Stale)}
	if f, _, _ := Of(stale, nil, now); f.Guest != nil {
		t.Errorf("a guest's figures two minutes old are still served: %+v", f.Guest)
	}

	older := run
	older.UID, older.Started = "u0", now.Add(-time.Hour)
	older.Guest = &monitor.GuestStats{Stats: guestinit.Stats{MemoryTotal: 999 << 20, MemoryAvailable: 1}, At: now}
	other := run
	other.Key.Name = "other"
	remove := Add(runs{older, run, other}, taps{hostnet.TapName("u1"): {ReceiveBytes: 7}, hostnet.TapName("u0"): {ReceiveBytes: 999}})
	defer remove()
	families, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatalf("the scrape failed with two runs of one name: %v", err)
	}
	series := func(name string) map[string][]float64 {
		seen := map[string][]float64{}
		for _, fam := range families {
			if fam.GetName() != name {
				continue
			}
			for _, m := range fam.Metric {
				lv := map[string]string{}
				for _, l := range m.Label {
					lv[l.GetName()] = l.GetValue()
				}
				if lv["namespace"] == key.Namespace {
					seen[lv["name"]] = append(seen[lv["name"]], m.GetGauge().GetValue()+m.GetCounter().GetValue())
				}
			}
		}
		return seen
	}
	if seen := series("imp_vm_guest_memory_bytes"); len(seen["vm"]) != 1 || seen["vm"][0] != 100<<20 || len(seen["other"]) != 1 {
		t.Errorf("series of the runs: %v; want one of vm, the newer run's (100 MiB), and one of other", seen)
	}
	if seen := series("imp_vm_network_receive_bytes_total"); len(seen["vm"]) != 1 || seen["vm"][0] != 7 {
		t.Errorf("network series of the runs: %v; want one of vm, its newer run's tap's (7 bytes)", seen)
	}
}

type countedTaps struct{ n int }

func (c *countedTaps) Taps() (map[string]hostnet.TapTraffic, error) {
	c.n++
	return map[string]hostnet.TapTraffic{"t": {ReceiveBytes: uint64(c.n)}}, nil
}

// TestTapsAreReadAtMostSoOften (docs/security.md): a reader asking for a VM's stats again and
// again (the view role may) has the node's taps read once per interval, not once per request.
func TestTapsAreReadAtMostSoOften(t *testing.T) {
	under := &countedTaps{}
	taps := Cached(under, time.Hour)
	for range 1000 {
		if m, err := taps.Taps(); err != nil || m["t"].ReceiveBytes != 1 {
			t.Fatalf("a read within the interval: %v %v, want the first read's", m, err)
		}
	}
	if under.n != 1 {
		t.Errorf("1,000 asks within the interval read the taps %d times", under.n)
	}
	again := Cached(under, time.Nanosecond)
	again.Taps()
	time.Sleep(time.Millisecond)
	if m, _ := again.Taps(); m["t"].ReceiveBytes != 3 {
		t.Errorf("after the interval: %v, %d reads; want a read each time", m, under.n)
	}
}
