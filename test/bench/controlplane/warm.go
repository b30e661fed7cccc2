package main

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// warmRun is the warm pool phase (-warm N, make bench-warmpool): an ImpVMTemplate of benchVM's
// spec and an ImpWarmPool of N members on the simulated nodes, whose agents take snapshots at
// once and hand a member to a claim after -handover (the guest's new identity: the real
// agent's reidentify). It measures claim → Running with the guest ready (exec possible) for
// one claim at a time and ten at once, each against a pool refilled first; then N claims at
// once (claims/s, how many were served warm); the API writes each claim costs; and the API
// server's floor for one claim: its create and the two status writes a claim needs (the
// binding, the agent's report), each made on the watch event of the one before, by a bench
// that decides nothing.
func warmRun(ctx context.Context, cl *testcluster.Cluster, o options, tr *tracker, f *figures, auditLog string, agentErr <-chan error) error {
	c := cl.Client
	const ns = "warm"
	tmpl := &impv1.ImpVMTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "bench"}, Spec: impv1.ImpVMTemplateSpec{VM: benchVM(ns, "x").Spec}}
	if err := c.Create(ctx, tmpl); err != nil {
		return fmt.Errorf("creating the template: %w", err)
	}
	pool := &impv1.ImpWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "bench"}, Spec: impv1.ImpWarmPoolSpec{
		TemplateRef: impv1.TemplateReference{Name: "bench"}, Replicas: ptr.To(int32(o.warm))}}
	start := time.Now()
	if err := c.Create(ctx, pool); err != nil {
		return fmt.Errorf("creating the pool: %w", err)
	}
	if err := waitIdle(ctx, c, o.warm, agentErr); err != nil {
		return err
	}
	fmt.Printf("  warm: a pool of %d idle members (its template's snapshot made first) in %v\n", o.warm, time.Since(start).Round(time.Millisecond))

	claimed := 0
	claims := func(n int) error {
		names := make([]string, n)
		for i := range names {
			names[i] = fmt.Sprintf("claim-%05d", claimed+i)
		}
		claimed += n
		err := parallel(n, min(n, o.creators), func(i int) error {
			tr.mark(ns, names[i], "created", time.Now())
			return c.Create(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: names[i]},
				Spec: impv1.ImpVMSpec{WarmPoolRef: &impv1.WarmPoolReference{Name: "bench"}}})
		})
		if err != nil {
			return err
		}
		return tr.waitNames(ctx, ns, names, "ready", agentErr)
	}
	var one, oneBound, ten []time.Duration
	for range o.warmRounds {
		if err := claims(1); err != nil {
			return err
		}
		one = append(one, tr.latenciesOf(ns, claimNames(claimed-1, 1), "created", "ready")...)
		oneBound = append(oneBound, tr.latenciesOf(ns, claimNames(claimed-1, 1), "created", "scheduled")...)
		if err := waitIdle(ctx, c, o.warm, agentErr); err != nil {
			return err
		}
	}
	for range 3 {
		if err := claims(10); err != nil {
			return err
		}
		ten = append(ten, tr.latenciesOf(ns, claimNames(claimed-10, 10), "created", "ready")...)
		if err := waitIdle(ctx, c, o.warm, agentErr); err != nil {
			return err
		}
	}
	// A burst of as many claims as the pool has members.
	idleBefore, err := idleMembers(ctx, c)
	if err != nil {
		return err
	}
	from, op := size(auditLog), claimed
	start = time.Now()
	if err := claims(o.warm); err != nil {
		return err
	}
	elapsed := time.Since(start)
	time.Sleep(2 * time.Second) // writes in flight
	writes, err := countNamedWrites(auditLog, from, size(auditLog), "impvms", claimNames(op, o.warm))
	if err != nil {
		return err
	}
	all, err := countRequests(auditLog, from, size(auditLog))
	if err != nil {
		return err
	}
	var list impv1.ImpVMList
	if err := c.List(ctx, &list, client.InNamespace(ns)); err != nil {
		return err
	}
	served := map[impv1.VMStart]int{}
	for _, vm := range list.Items {
		if vm.IsClaim() && slices.Contains(claimNames(op, o.warm), vm.Name) {
			served[vm.Status.Start]++
		}
	}
	floor := f.warmFloor

	f.latencies("warm: one claim→guest ready", one)
	f.latencies("warm: ten at once→guest ready", ten)
	f.latencies("warm: floor, one claim", floor)
	fmt.Printf("  %-34s P50 %v (target ≤ 100 ms), %.2f× the API server's floor (create and two writes, each on the watch event of the one before: P50 %v)\n",
		"warm: one claim→guest ready", pct(one, .5), float64(pct(one, .5))/float64(max(pct(floor, .5), 1)), pct(floor, .5))
	fmt.Printf("  %-34s P50 %v: the operator's binding, seen on the watch (then the agent's handover, %v here, its report, the operator's Ready)\n",
		"warm: one claim→bound", pct(oneBound, .5), o.handover)
	f.latencies("warm: one claim→bound", oneBound)
	fmt.Printf("  %-34s P50 %v P99 %v (target ≤ 300 ms P50)\n", "warm: ten at once→guest ready", pct(ten, .5), pct(ten, .99))
	f.set("warm: burst claims/s", "/s", float64(o.warm)/elapsed.Seconds())
	total, byWho := 0, ""
	for _, who := range []string{"operator", "agents"} {
		total += writes[who]
		byWho += fmt.Sprintf(" %s %.2f", who, float64(writes[who])/float64(o.warm))
	}
	f.set("warm: writes per claim", "", float64(total)/float64(o.warm))
	fmt.Printf("  %-34s %d claims at once against %d idle members: %.1f claims/s (target ≥ 20) to guest ready; served warm %d, restored %d\n",
		"warm: burst", o.warm, idleBefore, float64(o.warm)/elapsed.Seconds(), served[impv1.StartWarm], served[impv1.StartRestored])
	fmt.Printf("  %-34s %.2f besides its create (target ≤ 3):%s\n", "warm: API writes per claim", float64(total)/float64(o.warm), byWho)
	fmt.Printf("  %-34s every request of the burst per claim, its member's deletion and the pool's refill included: operator %s\n",
		"warm: requests per claim", all.describe("operator", o.warm))
	return nil
}

func claimNames(from, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("claim-%05d", from+i)
	}
	return out
}

func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[int(p*float64(len(s)-1)+0.5)].Round(time.Millisecond)
}

// waitIdle waits until the pool has n idle members, as the API server has them (the pool's
// status may not have counted the last claims yet) and as the pool says.
func waitIdle(ctx context.Context, c client.Client, n int, agentErr <-chan error) error {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		p := &impv1.ImpWarmPool{}
		if err := c.Get(ctx, types.NamespacedName{Namespace: "warm", Name: "bench"}, p); err != nil {
			return err
		}
		idle, err := idleMembers(ctx, c)
		if err != nil {
			return err
		}
		if idle >= n && int(p.Status.Idle) >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the warm pool has %d of %d members idle after 5 minutes (%d by its status)", idle, n, p.Status.Idle)
		}
		select {
		case err := <-agentErr:
			return err
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// warmFloor is the API server's floor for one claim, rounds times: the claim's create, then a
// status write (the binding) on the watch event of the create, then another (the agent's
// report) on the watch event of the first, until the watch shows the last.
func warmFloor(ctx context.Context, cl *testcluster.Cluster, rounds int) ([]time.Duration, error) {
	const ns = "warm-floor"
	c, err := client.NewWithWatch(cl.Config, client.Options{Scheme: cl.Scheme})
	if err != nil {
		return nil, err
	}
	var out []time.Duration
	for i := range rounds {
		name := fmt.Sprintf("floor-%03d", i)
		w, err := c.Watch(ctx, &impv1.ImpVMList{}, client.InNamespace(ns))
		if err != nil {
			return nil, err
		}
		step := 0
		began := time.Now()
		vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMSpec{WarmPoolRef: &impv1.WarmPoolReference{Name: "bench"}}}
		if err := c.Create(ctx, vm); err != nil {
			w.Stop()
			return nil, err
		}
		for ev := range w.ResultChan() {
			got, ok := ev.Object.(*impv1.ImpVM)
			if !ok || got.Name != name || (ev.Type != watch.Added && ev.Type != watch.Modified) {
				continue
			}
			var patch map[string]any
			switch {
			case step == 0 && got.Status.NodeName == "":
				st := floorStatus(nodeName(1), false, time.Now())
				st.Start, st.Warm = impv1.StartWarm, &impv1.WarmStatus{Pool: "bench", Member: "bench-abcde", MemberUID: "00000000-0000-0000-0000-000000000000"}
				patch = map[string]any{"status": st}
			case step == 1 && got.Status.NodeName != "":
				now := metav1.Now()
				patch = map[string]any{"status": map[string]any{"runtime": impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeRunning, StartedAt: &now, GuestReady: true}}}
			case step == 2 && got.Status.Runtime != nil && got.Status.Runtime.GuestReady:
				out = append(out, time.Since(began))
				w.Stop() // the channel closes: the next round
				continue
			default:
				continue
			}
			data, _ := json.Marshal(patch)
			if err := c.Status().Patch(ctx, got, client.RawPatch(types.MergePatchType, data)); err != nil {
				w.Stop()
				return nil, err
			}
			step++
		}
		w.Stop()
		// Gone before IMP starts (no finalizer yet): nothing of the floor reaches it.
		if err := c.Delete(ctx, vm); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// waitNames waits until each VM of names in ns reached what.
func (tr *tracker) waitNames(ctx context.Context, ns string, names []string, what string, agentErr <-chan error) error {
	deadline := time.After(5 * time.Minute)
	for {
		tr.mu.Lock()
		left := 0
		for _, n := range names {
			if _, ok := tr.at[what][ns+"/"+n]; !ok {
				left++
			}
		}
		tr.mu.Unlock()
		if left == 0 {
			return nil
		}
		select {
		case <-tr.changed:
		case err := <-agentErr:
			return err
		case <-deadline:
			return fmt.Errorf("%d of %d claims not %s after 5 minutes", left, len(names), what)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// latenciesOf are, for the VMs of names in ns, the time from one mark to another.
func (tr *tracker) latenciesOf(ns string, names []string, from, to string) []time.Duration {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var out []time.Duration
	for _, n := range names {
		t0, ok0 := tr.at[from][ns+"/"+n]
		t1, ok1 := tr.at[to][ns+"/"+n]
		if ok0 && ok1 {
			out = append(out, t1.Sub(t0))
		}
	}
	return out
}

// idleMembers counts the pool's members that are idle as the API server has them: running,
// guest ready, not being deleted, not bound to a claim.
func idleMembers(ctx context.Context, c client.Client) (int, error) {
	var list impv1.ImpVMList
	if err := c.List(ctx, &list, client.InNamespace("warm")); err != nil {
		return 0, err
	}
	bound := map[string]bool{}
	for _, vm := range list.Items {
		if w := vm.Status.Warm; w != nil {
			bound[w.MemberUID] = true
		}
	}
	n := 0
	for i := range list.Items {
		vm := &list.Items[i]
		rt := vm.Status.Runtime
		if impv1.WarmPoolOf(vm) == "bench" && vm.DeletionTimestamp.IsZero() && !bound[string(vm.UID)] && rt != nil && rt.GuestReady && vm.Status.Phase == impv1.VMRunning {
			n++
		}
	}
	return n, nil
}
