package agent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/go-logr/logr"
	dto "github.com/prometheus/client_model/go"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/access"
)

// TestEachVMsFigures (docs/metrics.md, "Each VM's figures"): a real guest whose workload takes
// 64 MiB, gives it back and takes it again is seen doing so in imp_vm_guest_memory_available_bytes
// (its imp-init's word, every 5 s); its node's side (its VMM's CPU and resident memory, its
// disk's allocation) is there without the guest, and its memory is no more than the VM's.
func TestEachVMsFigures(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	vm := w.vm("hog", "memcycle", "64", "12")
	if err := w.c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	series := func() map[string]float64 {
		families, err := metrics.Registry.Gather()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]float64{}
		for _, f := range families {
			for _, m := range f.Metric {
				if label(m, "namespace") == w.ns && label(m, "name") == "hog" {
					out[f.GetName()] = m.GetGauge().GetValue() + m.GetCounter().GetValue()
				}
			}
		}
		return out
	}
	// Available memory: its highest before a low 48 MiB under it, then back up 48 MiB.
	var high, low float64
	fell, rose := false, false
	deadline := time.Now().Add(5 * time.Minute)
	for !rose {
		if time.Now().After(deadline) {
			t.Fatalf("available memory high %.0f MiB, low %.0f MiB, fell %v: never fell and rose again by 48 MiB; series %v; console:\n%s",
				high/(1<<20), low/(1<<20), fell, series(), w.console(w.get("hog")))
		}
		avail, ok := series()["imp_vm_guest_memory_available_bytes"]
		switch {
		case !ok:
		case !fell:
			high = max(high, avail)
			if avail < high-48<<20 {
				fell, low = true, avail
			}
		default:
			low = min(low, avail)
			rose = avail > low+48<<20
		}
		time.Sleep(500 * time.Millisecond)
	}
	s := series()
	t.Logf("the guest's available memory went from %.0f MiB down to %.0f MiB and back up; now %v", high/(1<<20), low/(1<<20), fmt.Sprint(s))
	if total := s["imp_vm_guest_memory_bytes"]; total <= 0 || total > 192<<20 {
		t.Errorf("the guest says it has %.0f bytes of memory; the VM has 192 MiB", total)
	}
	for _, name := range []string{"imp_vm_vmm_cpu_seconds_total", "imp_vm_vmm_resident_bytes", "imp_vm_disk_allocated_bytes",
		"imp_vm_guest_cpu_seconds_total", "imp_vm_guest_filesystem_size_bytes"} {
		if s[name] <= 0 {
			t.Errorf("%s of the VM is %v", name, s[name])
		}
	}
	if s["imp_vm_vmm_resident_bytes"] < 64<<20 {
		t.Errorf("its VMM holds %.0f MiB on the node, less than the 64 MiB its guest touched", s["imp_vm_vmm_resident_bytes"]/(1<<20))
	}

	// The same figures through the node's access endpoint (what kubectl imp top reads); none
	// for a UID the node does not run.
	srv := httptest.NewServer(access.Handler(w.agent.Figures, logr.Discard()))
	defer srv.Close()
	v := w.get("hog")
	get := func(uid string) (*impv1.VMFigures, int) {
		resp, err := http.Get(srv.URL + "/vms/" + v.Namespace + "/" + v.Name + "/" + uid + "/stats")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		f := &impv1.VMFigures{}
		_ = json.NewDecoder(resp.Body).Decode(f)
		return f, resp.StatusCode
	}
	if f, code := get(string(v.HostUID())); code != http.StatusOK || f.Guest == nil || f.Guest.MemoryBytes != uint64(s["imp_vm_guest_memory_bytes"]) ||
		f.VMMCPUSeconds < s["imp_vm_vmm_cpu_seconds_total"] || f.DiskAllocatedBytes == 0 {
		t.Errorf("the endpoint's figures: %d %+v (guest %+v); the series say %v", code, f, f.Guest, s)
	}
	if _, code := get("00000000-0000-0000-0000-000000000000"); code != http.StatusNotFound {
		t.Errorf("another UID's figures: %d, want 404", code)
	}
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.Label {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}
