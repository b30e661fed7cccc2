package impvm_test

import (
	"context"
	"encoding/json"
	"slices"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// TestStartingReportsWait: an agent's Starting and booting reports wait StartingReportDelay
// before the phase shows them. A run whose guest is ready within the delay goes from Scheduled
// to Running without the phase ever showing Starting (one status write instead of three); a
// slower one shows Starting once the delay has passed.
func TestStartingReportsWait(t *testing.T) {
	e := newEnv(t)
	e.opts.VM.StartingReportDelay = 3 * time.Second
	e.node("n", 16, 16)
	e.startOperator()
	ctx := context.Background()

	// Every phase each VM's status shows, from a watch: it sees every write.
	wc, err := client.NewWithWatch(e.cl.Config, client.Options{Scheme: e.cl.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	w, err := wc.Watch(ctx, &impv1.ImpVMList{}, client.InNamespace(e.ns))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Stop)
	var mu sync.Mutex
	phases := map[string][]impv1.VMPhase{}
	go func() {
		for ev := range w.ResultChan() {
			vm, ok := ev.Object.(*impv1.ImpVM)
			if !ok {
				continue
			}
			mu.Lock()
			if p := phases[vm.Name]; len(p) == 0 || p[len(p)-1] != vm.Status.Phase {
				phases[vm.Name] = append(p, vm.Status.Phase)
			}
			mu.Unlock()
		}
	}()
	seen := func(name string) []impv1.VMPhase {
		mu.Lock()
		defer mu.Unlock()
		return append([]impv1.VMPhase(nil), phases[name]...)
	}

	e.create(e.vm("fast", 1, "256Mi"), e.vm("slow", 1, "256Mi"))
	for _, n := range []string{"fast", "slow"} {
		eventually(t, func() string { return scheduled(e.get(n)) }).Should(Equal("True"))
	}
	report := func(name string, state impv1.RuntimeState, ready bool) {
		t.Helper()
		vm := e.get(name)
		now := metav1.Now()
		rt := impv1.RuntimeStatus{Instance: vm.Status.Instance, Run: vm.Status.RestartCount, State: state, GuestReady: ready}
		if state == impv1.RuntimeRunning {
			rt.StartedAt = &now
		}
		patch, _ := json.Marshal(map[string]any{"status": map[string]any{"runtime": rt}})
		if err := e.c.Status().Patch(ctx, vm, client.RawPatch(types.MergePatchType, patch)); err != nil {
			t.Fatal(err)
		}
	}
	report("fast", impv1.RuntimeStarting, false)
	report("slow", impv1.RuntimeStarting, false)
	time.Sleep(300 * time.Millisecond)
	report("fast", impv1.RuntimeRunning, false)
	time.Sleep(300 * time.Millisecond)
	report("fast", impv1.RuntimeRunning, true)

	eventually(t, func() impv1.VMPhase { return e.get("fast").Status.Phase }).Should(Equal(impv1.VMRunning))
	eventually(t, func() impv1.VMPhase { return e.get("slow").Status.Phase }).Should(Equal(impv1.VMStarting))
	time.Sleep(time.Second) // the fast VM's delayed reconciles come and write nothing
	if got, want := seen("fast"), []impv1.VMPhase{"", impv1.VMScheduled, impv1.VMRunning}; !slices.Equal(got, want) {
		t.Errorf("fast VM's status showed phases %v, want %v", got, want)
	}
	if got, want := seen("slow"), []impv1.VMPhase{"", impv1.VMScheduled, impv1.VMStarting}; !slices.Equal(got, want) {
		t.Errorf("slow VM's status showed phases %v, want %v", got, want)
	}
}
