package main

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// noStartLabel marks the placement phase's VMs: the simulated agents do not start them.
const noStartLabel = "bench.imp.dev/no-start"

// tracker records when each VM was created, first seen Scheduled, first seen Running with
// its guest ready, deleted and gone, from a watch of every ImpVM.
type tracker struct {
	mu      sync.Mutex
	at      map[string]map[string]time.Time // "created", "scheduled", … → "ns/name" → time
	changed chan struct{}
}

func track(ctx context.Context, cl *testcluster.Cluster) (*tracker, error) {
	tr := &tracker{at: map[string]map[string]time.Time{}, changed: make(chan struct{}, 1)}
	informers, err := cache.New(cl.Config, cache.Options{Scheme: cl.Scheme})
	if err != nil {
		return nil, err
	}
	inf, err := informers.GetInformer(ctx, &impv1.ImpVM{})
	if err != nil {
		return nil, err
	}
	observe := func(obj any) {
		vm, ok := obj.(*impv1.ImpVM)
		if !ok {
			return
		}
		now := time.Now()
		if meta.IsStatusConditionTrue(vm.Status.Conditions, impv1.ScheduledCondition) {
			tr.markOnce(vm.Namespace, vm.Name, "scheduled", now)
		}
		if vm.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(vm.Status.Conditions, impv1.ReadyCondition) {
			tr.markOnce(vm.Namespace, vm.Name, "ready", now)
		}
	}
	if _, err := inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { observe(obj) },
		UpdateFunc: func(_, obj any) { observe(obj) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if vm, ok := obj.(*impv1.ImpVM); ok {
				tr.markOnce(vm.Namespace, vm.Name, "gone", time.Now())
			}
		},
	}); err != nil {
		return nil, err
	}
	go func() { _ = informers.Start(ctx) }()
	if !informers.WaitForCacheSync(ctx) {
		return nil, fmt.Errorf("syncing the VM informer")
	}
	return tr, nil
}

func (tr *tracker) mark(ns, name, what string, t time.Time) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if tr.at[what] == nil {
		tr.at[what] = map[string]time.Time{}
	}
	tr.at[what][ns+"/"+name] = t
}

func (tr *tracker) markOnce(ns, name, what string, t time.Time) {
	tr.mu.Lock()
	if _, seen := tr.at[what][ns+"/"+name]; !seen {
		if tr.at[what] == nil {
			tr.at[what] = map[string]time.Time{}
		}
		tr.at[what][ns+"/"+name] = t
	}
	tr.mu.Unlock()
	select {
	case tr.changed <- struct{}{}:
	default:
	}
}

func (tr *tracker) count(ns, what string) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	n := 0
	for k := range tr.at[what] {
		if len(k) > len(ns) && k[:len(ns)+1] == ns+"/" {
			n++
		}
	}
	return n
}

// wait waits for n VMs of ns to reach what, printing progress every 5 s.
func (tr *tracker) wait(ctx context.Context, ns, what string, n int, agentErr <-chan error) error {
	start := time.Now()
	deadline := time.After(15 * time.Minute)
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for tr.count(ns, what) < n {
		select {
		case <-tr.changed:
		case <-tick.C:
			fmt.Fprintf(os.Stderr, "  ... %v: %d of %d VMs of %s %s\n", time.Since(start).Round(time.Second), tr.count(ns, what), n, ns, what)
		case err := <-agentErr:
			return err
		case <-deadline:
			return fmt.Errorf("only %d of %d VMs of %s %s after 15 minutes", tr.count(ns, what), n, ns, what)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// latencies are, for each VM of ns, the time from one mark to another.
func (tr *tracker) latencies(ns, from, to string) []time.Duration {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var out []time.Duration
	for k, t0 := range tr.at[from] {
		if len(k) <= len(ns) || k[:len(ns)+1] != ns+"/" {
			continue
		}
		if t1, ok := tr.at[to][k]; ok {
			out = append(out, t1.Sub(t0))
		}
	}
	return out
}

func (e *eventCounts) snapshot() eventSnapshot {
	return eventSnapshot{vms: e.vms.Load(), addresses: e.addresses.Load(), networks: e.networks.Load(), nodes: e.nodes.Load()}
}

type eventSnapshot struct{ vms, addresses, networks, nodes int64 }

func (s eventSnapshot) total() int64 { return s.vms + s.addresses + s.networks + s.nodes }
