// Command controlplane benchmarks IMP's whole control-plane path on a real API server: the
// operator as a process, and M simulated nodes whose agents make the real agent's requests
// (ImpNode report and heartbeats; Starting → Running → guest ready; Gone on deletion), in this
// process, except one, run as a child process so that an agent's memory can be measured.
//
// Each run starts its own control plane and measures, for N VMs created by C clients at once:
//   - bare: the API server alone, the same creates each followed by a watcher's status patch
//     and Event (the writes IMP makes to place a VM), with no IMP: the floor IMP's placement is
//     compared with;
//   - placement: create → Scheduled, on nodes whose agents do not start these VMs;
//   - run: create → Scheduled and create → Running with the guest ready;
//   - delete: every VM deleted → gone (the agents' Gone handshake);
//   - pool (with -pool N): an ImpVMPool scaled from 0 to N → each member Running with its
//     guest ready, against the run phase's VMs created at once.
//
// It prints latencies (P50, P99, max), VMs/s, API requests per VM by verb and resource split
// operator / agents (from the API server's audit log), the operator's CPU seconds and memory,
// an agent's memory, and the watch events the agents received per VM; then, over the runs,
// each figure's median and range.
//
//	go run ./test/bench/controlplane -n 1000 -m 100 -runs 3      (make bench-controlplane)
//
// BENCH_OPERATOR_PROFILE=<dir> keeps the operator's CPU profile of the placement and run phases
// and its allocations over each (profileOperator); BENCH_APISERVER_PROFILE=<dir> the API
// server's CPU profile of the run phase and of its floor's (profileAPIServer).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap/zapcore"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/runreport"
	"github.com/syscode-labs/imp/internal/scheme"
	"github.com/syscode-labs/imp/internal/testcluster"
)

type options struct {
	n, m, creators, runs, concurrency int
	nodeVCPUs, runN, pool             int
	warm, warmRounds                  int
	handover                          time.Duration
	start, boot, heartbeat, delay     time.Duration
	idle                              time.Duration
	fleet, bare, bareEvents, bareRun  bool
	impNodeBeats                      bool
	operator, operatorArgs            string
}

func main() {
	var o options
	flag.IntVar(&o.n, "n", 1000, "VMs per phase")
	flag.IntVar(&o.m, "m", 100, "nodes, each with a simulated agent")
	flag.IntVar(&o.creators, "creators", 32, "concurrent clients creating (and deleting) VMs")
	flag.IntVar(&o.runs, "runs", 3, "runs, each on a new control plane")
	flag.IntVar(&o.concurrency, "vm-concurrency", 0, "the operator's --vm-concurrency (0: its default)")
	flag.DurationVar(&o.start, "start", 50*time.Millisecond, "a simulated agent's placement seen → VMM started")
	flag.DurationVar(&o.boot, "boot", 150*time.Millisecond, "a simulated guest's VMM started → ready")
	flag.IntVar(&o.runN, "run-n", 0, "VMs of the run phase (0: n), for a scale run whose placement phase fills the cluster")
	flag.IntVar(&o.pool, "pool", 0, "after the delete phase, scale an ImpVMPool from 0 to this many members: scale → Running, guest ready, against the run phase's VMs created at once (0: no pool phase)")
	flag.IntVar(&o.warm, "warm", 0, "after the other phases, an ImpWarmPool of this many members: claims one at a time, ten at once and this many at once (0: no warm phase)")
	flag.IntVar(&o.warmRounds, "warm-rounds", 20, "claims made one at a time in the warm phase")
	flag.DurationVar(&o.handover, "handover", 20*time.Millisecond, "a simulated agent's claim seen → the member's guest took on the claim's identity (the real agent's reidentify)")
	flag.IntVar(&o.nodeVCPUs, "node-vcpus", 64, "each node's allocatable vCPUs (each VM has 1): with 2N/M close to it, placement must spread and may not overbook")
	flag.DurationVar(&o.delay, "report-delay", time.Second, "the agents' --starting-report-delay")
	flag.DurationVar(&o.heartbeat, "heartbeat", 10*time.Second, "the agents' heartbeat interval (the real agent's default; they read their Node every third beat, as their 30 s report does)")
	flag.DurationVar(&o.idle, "idle", 0, "after the run phase, count the watch events the agents get this long with nothing happening (heartbeats)")
	flag.BoolVar(&o.impNodeBeats, "impnode-heartbeats", false, "the agents beat by patching their ImpNode every 30 s, as agents before the Lease did (for comparison)")
	flag.BoolVar(&o.fleet, "fleet", true, "agents also watch every ImpNetwork, ImpIPAddress and ImpNode, as the real agent does for the overlay")
	flag.BoolVar(&o.bare, "bare", true, "measure the bare API server first")
	flag.BoolVar(&o.bareRun, "bare-run", true, "the bare API server's floor of the run phase too: its writes, by watchers that decide nothing")
	flag.BoolVar(&o.bareEvents, "bare-events", true, "the bare API server's watcher also creates an Event per VM, as the operator does on placing it: the same writes")
	flag.StringVar(&o.operator, "operator", "bin/imp-operator", "imp-operator binary")
	flag.StringVar(&o.operatorArgs, "operator-args", "", "more flags for the operator, space-separated")
	agentNode := flag.String("agent-node", "", "internal: run one simulated agent for this node")
	agentKubeconfig := flag.String("agent-kubeconfig", "", "internal: its kubeconfig")
	flag.Parse()
	// The simulated agents' caches log through controller-runtime: keep their errors.
	ctrllog.SetLogger(zap.New(zap.WriteTo(os.Stderr), zap.Level(zapcore.ErrorLevel)))
	if o.runN == 0 {
		o.runN = o.n
	}
	if *agentNode != "" {
		if err := runChildAgent(o, *agentNode, *agentKubeconfig); err != nil {
			fmt.Fprintln(os.Stderr, "simulated agent:", err)
			os.Exit(1)
		}
		return
	}
	var all []figures
	for i := 1; i <= o.runs; i++ {
		fmt.Printf("run %d of %d: N=%d VMs placed, %d run, M=%d nodes, %d creators, start %v, boot %v, report delay %v, heartbeat %v, fleet watches %v\n",
			i, o.runs, o.n, o.runN, o.m, o.creators, o.start, o.boot, o.delay, o.heartbeat, o.fleet)
		f, err := run(o)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench-controlplane:", err)
			os.Exit(1)
		}
		all = append(all, f)
	}
	summarize(all)
}

// figures are one run's measurements, by name, in the order measured.
type figures struct {
	names  []string
	values map[string]float64
	units  map[string]string
	// warmFloor is the floor of one claim (warmFloor), measured before IMP starts.
	warmFloor []time.Duration
}

func (f *figures) set(name, unit string, v float64) {
	if f.values == nil {
		f.values, f.units = map[string]float64{}, map[string]string{}
	}
	if _, ok := f.values[name]; !ok {
		f.names = append(f.names, name)
	}
	f.values[name], f.units[name] = v, unit
}

func (f *figures) latencies(name string, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) float64 { return lat[min(len(lat)-1, int(p*float64(len(lat))))].Seconds() * 1000 }
	f.set(name+" P50", "ms", pct(.50))
	f.set(name+" P99", "ms", pct(.99))
	f.set(name+" max", "ms", lat[len(lat)-1].Seconds()*1000)
	fmt.Printf("  %-34s P50 %.0f ms  P99 %.0f ms  max %.0f ms\n", name, pct(.50), pct(.99), lat[len(lat)-1].Seconds()*1000)
}

func summarize(all []figures) {
	if len(all) == 0 {
		return
	}
	fmt.Printf("\nover %d runs: median (min–max)\n", len(all))
	for _, name := range all[0].names {
		var vs []float64
		for _, f := range all {
			if v, ok := f.values[name]; ok {
				vs = append(vs, v)
			}
		}
		sort.Float64s(vs)
		unit := all[0].units[name]
		fmt.Printf("  %-44s %s (%s–%s) %s\n", name, num(vs[len(vs)/2]), num(vs[0]), num(vs[len(vs)-1]), unit)
	}
}

func num(v float64) string {
	if v >= 100 || v == float64(int64(v)) {
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

func run(o options) (figures, error) {
	var f figures
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dir, err := os.MkdirTemp("", "bench-controlplane")
	if err != nil {
		return f, err
	}
	defer os.RemoveAll(dir)
	audit, auditLog, err := testcluster.WithAudit(dir)
	if err != nil {
		return f, err
	}
	cl, err := testcluster.Start(audit)
	if err != nil {
		return f, err
	}
	defer func() { _ = cl.Stop() }()
	c := cl.Client

	for i := 0; i < o.m; i++ {
		if err := addNode(ctx, c, nodeName(i)); err != nil {
			return f, err
		}
	}
	for _, ns := range []string{"bare", "bare-run", "place", "run", "pool", "warm", "warm-floor"} {
		if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
			return f, err
		}
	}
	tr, err := track(ctx, cl)
	if err != nil {
		return f, err
	}

	if o.bare {
		// IMP's FlowSchema first: the floor's requests are classified as IMP's are.
		if err := cl.ApplyChartObjects(ctx, "FlowSchema"); err != nil {
			return f, err
		}
		if err := bareRun(ctx, cl, o, tr, &f); err != nil {
			return f, err
		}
		if o.warm > 0 {
			if f.warmFloor, err = warmFloor(ctx, cl, o.warmRounds); err != nil {
				return f, err
			}
		}
	}

	// IMP, as the chart installs it: its RBAC, admission policies and identities.
	if err := cl.ApplyChartObjects(ctx, "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
		"MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding", "FlowSchema"); err != nil {
		return f, err
	}
	op, err := startOperator(cl, dir, o)
	if err != nil {
		return f, err
	}
	defer func() { _ = op.Process.Kill(); _ = op.Wait() }()

	var ev eventCounts
	var agents sync.WaitGroup
	agentErr := make(chan error, o.m)
	for i := 1; i < o.m; i++ {
		cfg, err := cl.ConfigAs(testcluster.Agent, nodeName(i))
		if err != nil {
			return f, err
		}
		a, err := newSimAgent(cfg, cl.Scheme, nodeName(i), o.fleet, &ev)
		if err != nil {
			return f, err
		}
		a.start, a.boot, a.delay, a.heartbeat, a.vcpus, a.handover = o.start, o.boot, o.delay, jitter(o.heartbeat, i), int32(o.nodeVCPUs), o.handover
		if o.impNodeBeats {
			a.impNodeBeats, a.heartbeat = true, jitter(30*time.Second, i)
		}
		agents.Add(1)
		go func() {
			defer agents.Done()
			if err := a.run(ctx, o.fleet); err != nil && ctx.Err() == nil {
				agentErr <- err
			}
		}()
	}
	child, err := startChildAgent(cl, dir, o, nodeName(0))
	if err != nil {
		return f, err
	}
	defer func() { _ = child.Process.Kill(); _ = child.Wait() }()
	if err := waitReports(ctx, c, o.m, agentErr); err != nil {
		return f, err
	}
	agentRSSIdle, _ := memory(child.Process.Pid)

	// Placement alone.
	rec0 := reconciles()
	stopProfile := profileOperator(ctx, "place")
	from, cpu0 := size(auditLog), cpuSeconds(op.Process.Pid)
	start := time.Now()
	createdIn, err := create(ctx, c, "place", o.n, o, tr)
	if err != nil {
		return f, err
	}
	if err := tr.wait(ctx, "place", "scheduled", o.n, agentErr); err != nil {
		return f, err
	}
	elapsed := time.Since(start)
	stopProfile()
	time.Sleep(2 * time.Second) // Events in flight
	reqs, err := countRequests(auditLog, from, size(auditLog))
	if err != nil {
		return f, err
	}
	fmt.Printf("  placement (agents do not start these VMs): %d created in %v\n", o.n, createdIn.Round(time.Millisecond))
	f.latencies("place: create→Scheduled", tr.latencies("place", "created", "scheduled"))
	f.set("place: throughput", "VMs/s", float64(o.n)/elapsed.Seconds())
	if bare, ok := f.values["bare: create→patched P50"]; ok && bare > 0 {
		ratio := f.values["place: create→Scheduled P50"] / bare
		f.set("place: P50 over the bare floor's", "×", ratio)
		fmt.Printf("  %-34s %.2f× the bare API server's\n", "place: create→Scheduled P50", ratio)
	}
	writes, events := reqs.writes("operator")
	f.set("place: operator writes/VM", "", float64(writes)/float64(o.n))
	f.set("place: operator CPU", "s", cpuSeconds(op.Process.Pid)-cpu0)
	reportReconciles(&f, "place", rec0, reconciles(), o.n)
	fmt.Printf("  %-34s %.0f VMs/s; operator writes/VM %.2f (Events %.2f): %s\n", "place: throughput", float64(o.n)/elapsed.Seconds(),
		float64(writes)/float64(o.n), float64(events)/float64(o.n), reqs.describe("operator", o.n))

	// Create → Running, guest ready.
	from, cpu0 = size(auditLog), cpuSeconds(op.Process.Pid)
	watch0, err := scrapeAPIServer(ctx, cl.Config)
	if err != nil {
		return f, err
	}
	ev0 := ev.snapshot()
	stopAPIProfile := profileAPIServer(ctx, cl.Config, "run")
	cpuRun := machineCPU(op.Process.Pid, child.Process.Pid)
	rec0 = reconciles()
	stopProfile = profileOperator(ctx, "run")
	start = time.Now()
	createdIn, err = create(ctx, c, "run", o.runN, o, tr)
	if err != nil {
		return f, err
	}
	if err := tr.wait(ctx, "run", "ready", o.runN, agentErr); err != nil {
		return f, err
	}
	elapsed = time.Since(start)
	stopProfile()
	stopAPIProfile()
	cpuRun = machineCPU(op.Process.Pid, child.Process.Pid).since(cpuRun)
	time.Sleep(2 * time.Second)
	reqs, err = countRequests(auditLog, from, size(auditLog))
	if err != nil {
		return f, err
	}
	watch1, err := scrapeAPIServer(ctx, cl.Config)
	if err != nil {
		return f, err
	}
	ev1 := ev.snapshot()
	fmt.Printf("  run (agents start the VMs): %d created in %v\n", o.runN, createdIn.Round(time.Millisecond))
	f.latencies("run: create→Scheduled", tr.latencies("run", "created", "scheduled"))
	f.latencies("run: create→Running, guest ready", tr.latencies("run", "created", "ready"))
	vmSize(ctx, c, "run", "run: a VM ready, bytes", &f)
	if bare, ok := f.values["bare: create→Running, guest ready P50"]; ok && bare > 0 {
		ratio := f.values["run: create→Running, guest ready P50"] / bare
		f.set("run: P50 over the bare floor's", "×", ratio)
		fmt.Printf("  %-34s %.2f× the bare API server's\n", "run: guest ready P50", ratio)
	}
	f.set("run: throughput", "VMs/s", float64(o.runN)/elapsed.Seconds())
	f.set("run: create→all ready", "s", elapsed.Seconds())
	fmt.Printf("  %-34s %.0f VMs/s ready\n", "run: throughput", float64(o.runN)/elapsed.Seconds())
	for _, who := range []string{"operator", "agents"} {
		writes, events := reqs.writes(who)
		f.set("run: "+who+" writes/VM", "", float64(writes)/float64(o.runN))
		fmt.Printf("  run: %-29s writes/VM %.2f (Events %.2f); all requests/VM: %s\n", who, float64(writes)/float64(o.runN), float64(events)/float64(o.runN), reqs.describe(who, o.runN))
	}
	f.set("run: operator CPU", "s", cpuSeconds(op.Process.Pid)-cpu0)
	reportReconciles(&f, "run", rec0, reconciles(), o.runN)
	busy := cpuRun.total() / (elapsed.Seconds() * float64(runtime.NumCPU()))
	f.set("run: machine CPU busy", "%", 100*busy)
	fmt.Printf("  %-34s %.0f%% of %d CPUs over %v: %s\n", "run: CPU", 100*busy, runtime.NumCPU(), elapsed.Round(time.Second), cpuRun)
	rss, hwm := memory(op.Process.Pid)
	agentRSS, _ := memory(child.Process.Pid)
	f.set("operator RSS", "MiB", float64(rss)/1024)
	f.set("operator peak RSS", "MiB", float64(hwm)/1024)
	f.set("agent RSS idle", "MiB", float64(agentRSSIdle)/1024)
	f.set("agent RSS", "MiB", float64(agentRSS)/1024)
	fmt.Printf("  %-34s RSS %.0f MiB, peak %.0f MiB; one agent (child process) %.0f MiB before, %.0f MiB after\n", "operator memory",
		float64(rss)/1024, float64(hwm)/1024, float64(agentRSSIdle)/1024, float64(agentRSS)/1024)
	perAgent := func(a, b int64) float64 { return float64(b-a) / float64(o.m-1) / float64(o.runN) }
	f.set("run: watch events per agent per VM", "", perAgent(ev0.total(), ev1.total()))
	fmt.Printf("  %-34s %.3f per agent per VM (ImpVM %.3f, ImpIPAddress %.3f, ImpNetwork %.3f, ImpNode %.3f)\n", "run: watch events to agents",
		perAgent(ev0.total(), ev1.total()), perAgent(ev0.vms, ev1.vms), perAgent(ev0.addresses, ev1.addresses), perAgent(ev0.networks, ev1.networks), perAgent(ev0.nodes, ev1.nodes))
	fmt.Printf("  %-34s %s\n", "run: API server watch events/VM", describeWatch(watch0.watch, watch1.watch, o.runN))
	fmt.Printf("  %-34s %s\n", "run: API server queue waits", describeWaits(watch0, watch1))
	if o.idle > 0 {
		// Nothing happens but heartbeats: what each agent hears of the others.
		i0 := ev.snapshot()
		time.Sleep(o.idle)
		i1 := ev.snapshot()
		perMin := func(a, b int64) float64 { return float64(b-a) / float64(o.m-1) / o.idle.Minutes() }
		f.set("idle: watch events per agent per minute", "", perMin(i0.total(), i1.total()))
		fmt.Printf("  %-34s %.2f per agent per minute (ImpNode %.2f), %d nodes\n", "idle: watch events to agents",
			perMin(i0.total(), i1.total()), perMin(i0.nodes, i1.nodes), o.m)
	}

	// Every VM placed, no node given more vCPUs than it has.
	placed, overbooked, err := checkPlacement(ctx, c, o)
	if err != nil {
		return f, err
	}
	f.set("overbooked nodes", "", float64(overbooked))
	fmt.Printf("  %-34s %d of %d VMs placed; %d of %d nodes overbooked (each has %d vCPUs)\n", "placement check", placed, o.n+o.runN, overbooked, o.m, o.nodeVCPUs)

	// Delete everything: the agents' Gone handshake.
	from = size(auditLog)
	if err := deleteAll(ctx, c, o, tr, map[string]int{"place": o.n, "run": o.runN}); err != nil {
		return f, err
	}
	for ns, n := range map[string]int{"place": o.n, "run": o.runN} {
		if err := tr.wait(ctx, ns, "gone", n, agentErr); err != nil {
			return f, err
		}
	}
	time.Sleep(2 * time.Second)
	reqs, err = countRequests(auditLog, from, size(auditLog))
	if err != nil {
		return f, err
	}
	f.latencies("delete→gone", append(tr.latencies("place", "deleting", "gone"), tr.latencies("run", "deleting", "gone")...))
	writes, _ = reqs.writes("operator")
	awrites, _ := reqs.writes("agents")
	fmt.Printf("  %-34s operator writes/VM %.2f (%s); agents %.2f\n", "delete", float64(writes)/float64(o.n+o.runN), reqs.describe("operator", o.n+o.runN), float64(awrites)/float64(o.n+o.runN))
	if o.pool > 0 {
		if err := poolRun(ctx, c, o, tr, &f, agentErr); err != nil {
			return f, err
		}
	}
	if o.warm > 0 {
		if err := warmRun(ctx, cl, o, tr, &f, auditLog, agentErr); err != nil {
			return f, err
		}
	}
	select {
	case err := <-agentErr:
		return f, err
	default:
	}
	cancel()
	agents.Wait()
	return f, nil
}

// poolRun scales an ImpVMPool of benchVM's template from 0 to o.pool members and measures,
// for each member, scale → Running with the guest ready, and the whole scale; beside the run
// phase's figures for VMs created by o.creators clients at once.
func poolRun(ctx context.Context, c client.Client, o options, tr *tracker, f *figures, agentErr <-chan error) error {
	tmpl := benchVM("pool", "x").Spec
	p := &impv1.ImpVMPool{ObjectMeta: metav1.ObjectMeta{Namespace: "pool", Name: "bench"}, Spec: impv1.ImpVMPoolSpec{
		Replicas: ptr.To[int32](0),
		Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "bench"}},
		Template: impv1.ImpVMPoolTemplate{Metadata: impv1.PoolMemberMetadata{Labels: map[string]string{"app": "bench"}}, Spec: tmpl},
	}}
	if err := c.Create(ctx, p); err != nil {
		return fmt.Errorf("creating the pool: %w", err)
	}
	time.Sleep(time.Second) // its first reconcile (a revision, no member) done
	orig := p.DeepCopy()
	p.Spec.Replicas = ptr.To(int32(o.pool))
	start := time.Now()
	for i := range o.pool {
		tr.mark("pool", fmt.Sprintf("bench-%d", i), "created", start)
	}
	if err := c.Patch(ctx, p, client.MergeFrom(orig)); err != nil {
		return fmt.Errorf("scaling the pool: %w", err)
	}
	if err := tr.wait(ctx, "pool", "ready", o.pool, agentErr); err != nil {
		return err
	}
	elapsed := time.Since(start)
	fmt.Printf("  pool: scaled 0 → %d, all Running with their guests ready in %v\n", o.pool, elapsed.Round(time.Millisecond))
	f.latencies("pool: scale→Running, guest ready", tr.latencies("pool", "created", "ready"))
	f.set("pool: scale→all ready", "s", elapsed.Seconds())
	if run, ok := f.values["run: create→Running, guest ready P50"]; ok && run > 0 {
		ratio := f.values["pool: scale→Running, guest ready P50"] / run
		f.set("pool: P50 over plain VMs'", "×", ratio)
		fmt.Printf("  %-34s %.2f× the run phase's (%d VMs created by %d clients at once)\n", "pool: guest ready P50", ratio, o.runN, o.creators)
	}
	return nil
}

func nodeName(i int) string { return fmt.Sprintf("node-%04d", i) }

// jitter spreads the agents' heartbeats over the interval, as independent hosts do.
func jitter(d time.Duration, i int) time.Duration {
	return d + time.Duration(i*7919%1000)*d/10000
}

func benchVM(ns, name string) *impv1.ImpVM {
	vm := &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: impv1.ImpVMSpec{
			Image:     benchImage,
			Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("256Mi"))},
		},
	}
	return vm
}

func addNode(ctx context.Context, c client.Client, name string) error {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{impv1.NodeEnabledLabel: "true"}}}
	if err := c.Create(ctx, node); err != nil {
		return err
	}
	node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastTransitionTime: metav1.Now()}}
	return c.Status().Update(ctx, node)
}

func waitReports(ctx context.Context, c client.Client, m int, agentErr <-chan error) error {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		var list impv1.ImpNodeList
		if err := c.List(ctx, &list); err != nil {
			return err
		}
		if len(list.Items) == m {
			return nil
		}
		select {
		case err := <-agentErr:
			return err
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d agents reported", len(list.Items), m)
		}
	}
}

// create makes n VMs in ns with o.creators clients and returns how long it took.
func create(ctx context.Context, c client.Client, ns string, n int, o options, tr *tracker) (time.Duration, error) {
	start := time.Now()
	err := parallel(n, o.creators, func(i int) error {
		vm := benchVM(ns, fmt.Sprintf("vm-%05d", i))
		if ns == "place" {
			vm.Labels = map[string]string{noStartLabel: "true"}
		}
		tr.mark(ns, vm.Name, "created", time.Now())
		return c.Create(ctx, vm)
	})
	return time.Since(start), err
}

// deleteAll deletes the VMs create made, by namespace and count.
func deleteAll(ctx context.Context, c client.Client, o options, tr *tracker, vms map[string]int) error {
	for ns, n := range vms {
		err := parallel(n, o.creators, func(i int) error {
			name := fmt.Sprintf("vm-%05d", i)
			tr.mark(ns, name, "deleting", time.Now())
			return client.IgnoreNotFound(c.Delete(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}))
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// parallel runs f(0..n-1) on workers goroutines; the first error stops it.
func parallel(n, workers int, f func(int) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				if err := f(i); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// bareRun is the floor: the same creates, each answered by a watcher's status patch and Event
// (the operator's writes to place a VM), with no IMP installed. With -bare-run, it then
// measures the floor of the run phase too: the same writes as IMP's to reach Running with the
// guest ready — the placement's patch and Event; a patch by the VM's "agent" with the guest
// ready, -start plus -boot later; a patch to Running with an Event — by watchers that decide
// nothing.
func bareRun(ctx context.Context, cl *testcluster.Cluster, o options, tr *tracker, f *figures) error {
	// The creates as the admin, as IMP's; the watchers' writes as the operator and an agent,
	// so that API Priority and Fairness treats them as it treats IMP's.
	c := cl.Client
	opCfg, err := cl.ConfigAs(testcluster.Operator, "")
	if err != nil {
		return err
	}
	agCfg, err := cl.ConfigAs(testcluster.Agent, nodeName(0))
	if err != nil {
		return err
	}
	// Each writer its own field manager, as IMP's (the managed fields each write carries).
	opCfg.UserAgent, agCfg.UserAgent = "imp-operator", "imp-agent-sim/"+nodeName(0)
	opc, err := client.New(opCfg, client.Options{Scheme: cl.Scheme})
	if err != nil {
		return err
	}
	agc, err := client.New(agCfg, client.Options{Scheme: cl.Scheme})
	if err != nil {
		return err
	}
	informers, err := cache.New(opCfg, cache.Options{Scheme: cl.Scheme, DefaultNamespaces: map[string]cache.Config{"bare": {}, "bare-run": {}}})
	if err != nil {
		return err
	}
	bctx, stop := context.WithCancel(ctx)
	defer stop()
	inf, err := informers.GetInformer(bctx, &impv1.ImpVM{})
	if err != nil {
		return err
	}
	type step struct {
		key     types.NamespacedName
		running bool // the patch to Running, else the placement
	}
	operator := make(chan step, 2*max(o.n, o.runN))
	// The agents' part: the guest ready, -start plus -boot after the placement is seen.
	agentStart := func(key types.NamespacedName) {
		time.Sleep(o.start + o.boot)
		boot := (o.start + o.boot).Milliseconds()
		started := metav1.Now()
		p, err := runreport.RuntimePatch(impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeRunning, StartedAt: &started, GuestReady: true, BootMilliseconds: &boot, Message: "the guest is ready"})
		if err == nil {
			_ = agc.Status().Patch(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}}, client.RawPatch(types.MergePatchType, p))
		}
	}
	if _, err := inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { operator <- step{key: client.ObjectKeyFromObject(obj.(*impv1.ImpVM))} },
		UpdateFunc: func(oldObj, newObj any) {
			old, vm := oldObj.(*impv1.ImpVM), newObj.(*impv1.ImpVM)
			if vm.Namespace != "bare-run" {
				return
			}
			switch {
			case old.Status.NodeName == "" && vm.Status.NodeName != "":
				go agentStart(client.ObjectKeyFromObject(vm))
			case vm.Status.Runtime != nil && vm.Status.Runtime.GuestReady && (old.Status.Runtime == nil || !old.Status.Runtime.GuestReady):
				operator <- step{key: client.ObjectKeyFromObject(vm), running: true}
			}
		},
	}); err != nil {
		return err
	}
	go func() { _ = informers.Start(bctx) }()
	informers.WaitForCacheSync(bctx)
	event := func(key types.NamespacedName, reason, note string) {
		if o.bareEvents {
			// As the operator's recorder does: its own write, off the patch's path.
			go func() { _ = opc.Create(bctx, bareEvent(key, reason, note)) }()
		}
	}
	for w := 0; w < o.creators; w++ {
		go func() {
			for {
				select {
				case <-bctx.Done():
					return
				case st := <-operator:
					// The statuses IMP's operator writes, field for field (floorStatus): the
					// floor's writes carry what IMP's do through admission, validation, etcd
					// and the watches.
					node := nodeName(0)
					orig := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: st.key.Namespace, Name: st.key.Name}}
					if st.running {
						orig.Status = floorStatus(node, false, time.Now())
						vm := orig.DeepCopy()
						vm.Status = floorStatus(node, true, time.Now())
						_ = opc.Status().Patch(bctx, vm, client.MergeFrom(orig))
						event(st.key, "Started", "The guest is ready")
						continue
					}
					vm := orig.DeepCopy()
					vm.Status = floorStatus(node, false, time.Now())
					_ = opc.Status().Patch(bctx, vm, client.MergeFrom(orig))
					event(st.key, "Scheduled", "Placed on node "+node)
				}
			}
		}()
	}
	start := time.Now()
	if _, err := create(ctx, c, "bare", o.n, o, tr); err != nil {
		return err
	}
	if err := tr.wait(ctx, "bare", "scheduled", o.n, nil); err != nil {
		return err
	}
	elapsed := time.Since(start)
	if o.bareEvents {
		fmt.Printf("  bare API server (create, then a watcher's status patch and Event, as IMP writes to place; no IMP):\n")
	} else {
		fmt.Printf("  bare API server (create, then one status patch by a watcher; no IMP):\n")
	}
	f.latencies("bare: create→patched", tr.latencies("bare", "created", "scheduled"))
	f.set("bare: throughput", "VMs/s", float64(o.n)/elapsed.Seconds())
	fmt.Printf("  %-34s %.0f VMs/s\n", "bare: throughput", float64(o.n)/elapsed.Seconds())
	if err := deleteAll(ctx, c, o, tr, map[string]int{"bare": o.n}); err != nil {
		return err
	}
	if err := tr.wait(ctx, "bare", "gone", o.n, nil); err != nil {
		return err
	}
	if !o.bareRun {
		return nil
	}
	stopAPIProfile := profileAPIServer(ctx, cl.Config, "bare-run")
	cpu := machineCPU(0, 0)
	start = time.Now()
	if _, err := create(ctx, c, "bare-run", o.runN, o, tr); err != nil {
		return err
	}
	if err := tr.wait(ctx, "bare-run", "ready", o.runN, nil); err != nil {
		return err
	}
	elapsed = time.Since(start)
	stopAPIProfile()
	cpu = machineCPU(0, 0).since(cpu)
	fmt.Printf("  bare API server, the run's writes (create; placement patch and Event; a patch with the guest ready %v later; Running patch and Event; no IMP):\n", o.start+o.boot)
	f.latencies("bare: create→Running, guest ready", tr.latencies("bare-run", "created", "ready"))
	vmSize(ctx, c, "bare-run", "bare: a VM ready, bytes", f)
	f.set("bare: run throughput", "VMs/s", float64(o.runN)/elapsed.Seconds())
	fmt.Printf("  %-34s %.0f VMs/s\n", "bare: run throughput", float64(o.runN)/elapsed.Seconds())
	fmt.Printf("  %-34s %.0f%% of %d CPUs over %v: API server %.1f s, etcd %.1f s, this process %.1f s\n", "bare: run CPU",
		100*cpu.total()/(elapsed.Seconds()*float64(runtime.NumCPU())), runtime.NumCPU(), elapsed.Round(time.Second), cpu.apiserver, cpu.etcd, cpu.bench)
	if err := deleteAll(ctx, c, o, tr, map[string]int{"bare-run": o.runN}); err != nil {
		return err
	}
	return tr.wait(ctx, "bare-run", "gone", o.runN, nil)
}

// benchImage is every bench VM's image.
var benchImage = "registry.test/app@sha256:" + strings.Repeat("ab", 32)

// floorStatus is the status IMP's operator writes for a VM of the bench (create's) placed on
// node, before its guest is ready and once it is (the fields a merge patch from one to the
// other changes: the phase, the Ready condition, the start).
func floorStatus(node string, running bool, now time.Time) impv1.ImpVMStatus {
	t := metav1.NewTime(now.Truncate(time.Second))
	st := impv1.ImpVMStatus{ObservedGeneration: 1, Phase: impv1.VMScheduled, NodeName: node, Instance: 1, Image: benchImage, Start: impv1.StartBooted,
		Resources: &impv1.ResolvedResources{VCPUs: 1, Memory: resource.MustParse("256Mi"), DiskSize: resource.MustParse("1Gi"), MemoryOverhead: ptr.To(resource.MustParse("0"))},
		Conditions: []metav1.Condition{
			{Type: impv1.ScheduledCondition, Status: metav1.ConditionTrue, ObservedGeneration: 1, LastTransitionTime: t, Reason: impv1.ReasonPlaced, Message: "placed on node " + node},
			{Type: impv1.ReadyCondition, Status: metav1.ConditionFalse, ObservedGeneration: 1, LastTransitionTime: t, Reason: impv1.ReasonStarting, Message: fmt.Sprintf("waiting for node %s to start the VM", node)},
		}}
	if running {
		st.Phase, st.StartedAt = impv1.VMRunning, &t
		st.Conditions[1] = metav1.Condition{Type: impv1.ReadyCondition, Status: metav1.ConditionTrue, ObservedGeneration: 1, LastTransitionTime: t, Reason: impv1.ReasonGuestReady, Message: "the guest reported ready"}
	}
	return st
}

// bareEvent is an Event like the operator's about the VM key.
func bareEvent(key types.NamespacedName, reason, note string) *eventsv1.Event {
	return &eventsv1.Event{
		ObjectMeta:          metav1.ObjectMeta{Namespace: key.Namespace, GenerateName: key.Name + "."},
		EventTime:           metav1.NewMicroTime(time.Now()),
		ReportingController: "imp.dev/bench", ReportingInstance: "bench",
		Action: reason, Reason: reason, Type: corev1.EventTypeNormal,
		Regarding: corev1.ObjectReference{APIVersion: impv1.GroupVersion.String(), Kind: "ImpVM", Namespace: key.Namespace, Name: key.Name},
		Note:      note,
	}
}

func startOperator(cl *testcluster.Cluster, dir string, o options) (*exec.Cmd, error) {
	kubeconfig, err := cl.WriteKubeconfigAs(dir, testcluster.Operator)
	if err != nil {
		return nil, err
	}
	args := []string{"--kubeconfig", kubeconfig, "--leader-elect=false", "--metrics-bind-address", operatorMetrics,
		"--health-probe-bind-address", "0", "--log-level", "error"}
	if o.concurrency > 0 {
		args = append(args, "--vm-concurrency", strconv.Itoa(o.concurrency))
	}
	if os.Getenv("BENCH_OPERATOR_PROFILE") != "" {
		args = append(args, "--pprof-bind-address", operatorPprof)
	}
	args = append(args, strings.Fields(o.operatorArgs)...)
	op := exec.Command(o.operator, args...)
	op.Stderr = os.Stderr
	op.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := op.Start(); err != nil {
		return nil, fmt.Errorf("starting %s (make build): %w", o.operator, err)
	}
	return op, nil
}

// startChildAgent runs node's simulated agent as a child process, for its memory.
func startChildAgent(cl *testcluster.Cluster, dir string, o options, node string) (*exec.Cmd, error) {
	kubeconfig, err := cl.WriteKubeconfigAs(dir, testcluster.Agent, node)
	if err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, "-agent-node", node, "-agent-kubeconfig", kubeconfig, "-start", o.start.String(), "-boot", o.boot.String(), "-report-delay", o.delay.String(),
		"-heartbeat", o.heartbeat.String(), "-node-vcpus", strconv.Itoa(o.nodeVCPUs), "-fleet="+strconv.FormatBool(o.fleet))
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd, cmd.Start()
}

func runChildAgent(o options, node, kubeconfig string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = 50, 100
	s, err := scheme.New()
	if err != nil {
		return err
	}
	var ev eventCounts
	a, err := newSimAgent(cfg, s, node, o.fleet, &ev)
	if err != nil {
		return err
	}
	a.start, a.boot, a.delay, a.heartbeat, a.vcpus = o.start, o.boot, o.delay, o.heartbeat, int32(o.nodeVCPUs)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	return a.run(ctx, o.fleet)
}

// apiMetrics is what the benchmark reads of the API server's metrics: watch events sent
// (apiserver_watch_events_total) by resource, and the time requests waited in API Priority
// and Fairness queues by priority level.
type apiMetrics struct {
	watch          map[string]float64
	waitSum, waits map[string]float64
	seats          map[string]float64
}

func scrapeAPIServer(ctx context.Context, cfg *rest.Config) (apiMetrics, error) {
	m := apiMetrics{watch: map[string]float64{}, waitSum: map[string]float64{}, waits: map[string]float64{}, seats: map[string]float64{}}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return m, err
	}
	raw, err := cs.RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return m, fmt.Errorf("reading the API server's metrics: %w", err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil {
			continue
		}
		switch {
		case strings.HasPrefix(line, "apiserver_watch_events_total{"):
			res := label(line, "resource")
			if res == "" {
				res = label(line, "kind")
			}
			m.watch[res] += v
		case strings.HasPrefix(line, "apiserver_flowcontrol_request_wait_duration_seconds_sum{"):
			m.waitSum[label(line, "priority_level")] += v
		case strings.HasPrefix(line, "apiserver_flowcontrol_request_wait_duration_seconds_count{"):
			m.waits[label(line, "priority_level")] += v
		case strings.HasPrefix(line, "apiserver_flowcontrol_current_limit_seats{"):
			m.seats[label(line, "priority_level")] = v
		}
	}
	return m, nil
}

// describeWaits is the mean wait in each priority level's queues between two scrapes.
func describeWaits(before, after apiMetrics) string {
	var parts []string
	for pl, n := range after.waits {
		if d := n - before.waits[pl]; d > 0 {
			parts = append(parts, fmt.Sprintf("%s (%.0f seats) %.0f ms × %.0f", pl, after.seats[pl], (after.waitSum[pl]-before.waitSum[pl])/d*1000, d))
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

func label(line, name string) string {
	i := strings.Index(line, name+`="`)
	if i < 0 {
		return ""
	}
	v := line[i+len(name)+2:]
	return v[:strings.IndexByte(v, '"')]
}

func describeWatch(before, after map[string]float64, n int) string {
	var parts []string
	for res, v := range after {
		if d := v - before[res]; d >= float64(n)/10 {
			parts = append(parts, fmt.Sprintf("%s %.1f", res, d/float64(n)))
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

// cpuSeconds is the process's user and system CPU time.
// cpuUse is the CPU seconds of the processes that share the machine in a run.
type cpuUse struct{ apiserver, etcd, operator, bench, agent float64 }

// machineCPU reads the CPU seconds of the API server and etcd (this process's children), the
// operator, this process (the simulated agents, the tracker and the creators) and the child
// agent.
func machineCPU(operator, agent int) cpuUse {
	u := cpuUse{operator: cpuSeconds(operator), bench: cpuSeconds(os.Getpid()), agent: cpuSeconds(agent)}
	for _, pid := range children() {
		switch comm(pid) {
		case "kube-apiserver":
			u.apiserver += cpuSeconds(pid)
		case "etcd":
			u.etcd += cpuSeconds(pid)
		}
	}
	return u
}

func (u cpuUse) since(before cpuUse) cpuUse {
	return cpuUse{u.apiserver - before.apiserver, u.etcd - before.etcd, u.operator - before.operator, u.bench - before.bench, u.agent - before.agent}
}

func (u cpuUse) total() float64 { return u.apiserver + u.etcd + u.operator + u.bench + u.agent }

func (u cpuUse) String() string {
	return fmt.Sprintf("API server %.1f s, etcd %.1f s, operator %.1f s, simulated agents, tracker and creators %.1f s, child agent %.1f s",
		u.apiserver, u.etcd, u.operator, u.bench, u.agent)
}

// children lists the processes whose parent is this one.
func children() []int {
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var pids []int
	for _, p := range stats {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		s := string(raw)
		fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		if len(fields) > 1 && fields[1] == strconv.Itoa(os.Getpid()) {
			if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil {
				pids = append(pids, pid)
			}
		}
	}
	return pids
}

func comm(pid int) string {
	raw, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	return strings.TrimSpace(string(raw))
}

func cpuSeconds(pid int) float64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(raw)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(fields) < 13 {
		return 0
	}
	u, _ := strconv.ParseFloat(fields[11], 64)
	k, _ := strconv.ParseFloat(fields[12], 64)
	return (u + k) / 100 // USER_HZ
}

// memory returns the process's resident and peak resident memory in KiB.
func memory(pid int) (rss, hwm int64) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0
	}
	for _, line := range strings.Split(string(raw), "\n") {
		fields := strings.Fields(line)
		if len(fields) < 2 {
			continue
		}
		v, _ := strconv.ParseInt(fields[1], 10, 64)
		switch fields[0] {
		case "VmRSS:":
			rss = v
		case "VmHWM:":
			hwm = v
		}
	}
	return rss, hwm
}

// vmSize prints the size of one of namespace ns's VMs as the API server stores it, once ready
// (managed fields included), its status's and its field managers: what each of its writes
// carries through admission, validation, etcd and every watch. It is figure.
func vmSize(ctx context.Context, c client.Client, ns, figure string, f *figures) {
	var list impv1.ImpVMList
	if err := c.List(ctx, &list, client.InNamespace(ns), client.Limit(1)); err != nil || len(list.Items) == 0 {
		return
	}
	vm := &list.Items[0]
	all, err := json.Marshal(vm)
	if err != nil {
		return
	}
	status, _ := json.Marshal(vm.Status)
	managed, _ := json.Marshal(vm.ManagedFields)
	var managers []string
	for _, m := range vm.ManagedFields {
		managers = append(managers, m.Manager)
	}
	f.set(figure, "B", float64(len(all)))
	fmt.Printf("  %-34s %d (status %d, managed fields %d: %s)\n", figure, len(all), len(status), len(managed), strings.Join(managers, ", "))
}

// profileAPIServer keeps the API server's CPU profile of a phase in BENCH_APISERVER_PROFILE, a
// directory, in two-second chunks (<phase>-cpu-*.pprof, merged by go tool pprof), until stop:
// where its time goes over the whole phase, IMP's run beside its floor's.
func profileAPIServer(ctx context.Context, cfg *rest.Config, phase string) (stop func()) {
	dir := os.Getenv("BENCH_APISERVER_PROFILE")
	if dir == "" {
		return func() {}
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "profiling the API server:", err)
		return func() {}
	}
	_ = os.MkdirAll(dir, 0o755)
	return inChunks(ctx, func(ctx context.Context) error {
		raw, err := cs.RESTClient().Get().AbsPath("/debug/pprof/profile").Param("seconds", "2").Timeout(time.Minute).DoRaw(ctx)
		if err == nil {
			err = os.WriteFile(nextProfile(dir, phase, "cpu"), raw, 0o600)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "profiling the API server:", err)
		}
		return err
	})
}

// inChunks calls take, a profile of two seconds, again and again until stop (which waits for the
// one under way) or its first error.
func inChunks(ctx context.Context, take func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			if take(context.WithoutCancel(ctx)) != nil {
				return
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// nextProfile is the path of the next <phase>-<kind>-<n>.pprof in dir: runs add to the same
// numbering, so that the chunks of every run are kept.
func nextProfile(dir, phase, kind string) string {
	n, _ := filepath.Glob(filepath.Join(dir, phase+"-"+kind+"-*.pprof"))
	return filepath.Join(dir, fmt.Sprintf("%s-%s-%03d.pprof", phase, kind, len(n)))
}

// operatorMetrics is where the operator serves its metrics (plain HTTP, on loopback).
const operatorMetrics = "127.0.0.1:18080"

// reconciles are the operator's reconciles so far by controller
// (controller_runtime_reconcile_total, every result).
func reconciles() map[string]float64 {
	resp, err := http.Get("http://" + operatorMetrics + "/metrics")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil
	}
	out := map[string]float64{}
	for _, line := range strings.Split(string(raw), "\n") {
		if strings.HasPrefix(line, "controller_runtime_reconcile_total{") {
			v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			out[label(line, "controller")] += v
		}
	}
	return out
}

// reportReconciles prints the reconciles per VM of each controller over a phase of n VMs, and
// keeps their sum.
func reportReconciles(f *figures, phase string, before, after map[string]float64, n int) {
	if after == nil {
		return
	}
	var names []string
	total := 0.0
	for name := range after {
		if d := after[name] - before[name]; d > 0 {
			names = append(names, name)
			total += d
		}
	}
	sort.Strings(names)
	var parts []string
	for _, name := range names {
		parts = append(parts, fmt.Sprintf("%s %.2f", name, (after[name]-before[name])/float64(n)))
	}
	f.set(phase+": operator reconciles/VM", "", total/float64(n))
	fmt.Printf("  %-34s %.2f: %s\n", phase+": operator reconciles/VM", total/float64(n), strings.Join(parts, ", "))
}

// operatorPprof is where the operator serves /debug/pprof when BENCH_OPERATOR_PROFILE is set.
const operatorPprof = "127.0.0.1:16061"

// profileOperator, when BENCH_OPERATOR_PROFILE names a directory, takes the operator's CPU
// profile in chunks of two seconds from now until stop, into <dir>/<phase>-cpu-<i>.pprof (go
// tool pprof merges the chunks it is given), and its allocations at the start and at stop
// (<phase>-allocs-{0,1}.pprof: go tool pprof -diff_base 0 1). Runs add to the same files'
// numbering, so that the chunks of every run are kept.
func profileOperator(ctx context.Context, phase string) (stop func()) {
	dir := os.Getenv("BENCH_OPERATOR_PROFILE")
	if dir == "" {
		return func() {}
	}
	_ = os.MkdirAll(dir, 0o755)
	get := func(path, file string) error {
		resp, err := http.Get("http://" + operatorPprof + path)
		if err != nil {
			fmt.Fprintln(os.Stderr, "profiling the operator:", err)
			return err
		}
		defer resp.Body.Close()
		raw, err := io.ReadAll(resp.Body)
		if err == nil && resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("%s", resp.Status)
		}
		if err == nil {
			err = os.WriteFile(file, raw, 0o644)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "profiling the operator:", err)
		}
		return err
	}
	_ = get("/debug/pprof/allocs", nextProfile(dir, phase, "allocs"))
	stopCPU := inChunks(ctx, func(context.Context) error {
		return get("/debug/pprof/profile?seconds=2", nextProfile(dir, phase, "cpu"))
	})
	return func() {
		stopCPU()
		_ = get("/debug/pprof/allocs", nextProfile(dir, phase, "allocs"))
	}
}

// checkPlacement counts the VMs placed and the nodes whose VMs ask for more vCPUs than the
// node has.
func checkPlacement(ctx context.Context, c client.Client, o options) (placed, overbooked int, err error) {
	var list impv1.ImpVMList
	if err := c.List(ctx, &list); err != nil {
		return 0, 0, err
	}
	used := map[string]int64{}
	for _, vm := range list.Items {
		if vm.Status.NodeName == "" || vm.Status.Resources == nil {
			continue
		}
		placed++
		used[vm.Status.NodeName] += int64(vm.Status.Resources.VCPUs)
	}
	for _, v := range used {
		if v > int64(o.nodeVCPUs) {
			overbooked++
		}
	}
	return placed, overbooked, nil
}
