// Command agent benchmarks the node agent with real guests under QEMU: placement → VMM exec
// (warm image) P50, create → guest ready P50, and the agent's RSS with 0 and N VMs. The agent
// runs as a process (bin/imp-agent); the operator runs in-process.
//
//	go run ./test/bench/agent -n 10      (make bench-agent)
//
// With -tracing-runs R it measures what tracing costs the start path instead: R runs with
// tracing off and R with it on (every start traced, to a collector on 127.0.0.1), alternated,
// and prints the start's figures of each side and their ratio (make bench-tracing).
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/controller/impvm"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/runsecret"
	"github.com/syscode-labs/imp/internal/testcluster"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testotlp"
	"github.com/syscode-labs/imp/internal/testregistry"
	"github.com/syscode-labs/imp/internal/tracing"
)

func main() {
	n := flag.Int("n", 10, "VMs")
	agentBin := flag.String("agent", "bin/imp-agent", "imp-agent binary")
	heapProfile := flag.String("heap-profile", "", "write the agent's heap profile, taken with all the VMs running, to this file")
	cpuProfile := flag.String("cpu-profile", "", "write the agent's CPU profile over 10 s with all the VMs running and idle to this file")
	reportDelay := flag.Duration("report-delay", time.Second, "the agent's --starting-report-delay: Running is written that long after the VMM's exec unless the guest is ready first (negative: at once)")
	tracingRuns := flag.Int("tracing-runs", 0, "instead: this many runs with tracing off and as many with it on (off, on, on, off, ...), and what tracing costs a start")
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.Level(zapcore.ErrorLevel)))
	// testguest and testregistry take a testing.TB: run the benchmark inside one.
	res := testing.Benchmark(func(b *testing.B) {
		// An error is printed here: b.Fatal outside a test's frames panics and loses it.
		fail := func(err error) {
			fmt.Fprintln(os.Stderr, "bench-agent:", err)
			os.Exit(1)
		}
		if *tracingRuns > 0 {
			if err := compareTracing(b, *tracingRuns, *n, *agentBin, *reportDelay); err != nil {
				fail(err)
			}
			return
		}
		if _, err := run(b, *n, *agentBin, *reportDelay, profiles{heap: *heapProfile, cpu: *cpuProfile}, nil); err != nil {
			fail(err)
		}
	})
	if res.N == 0 {
		os.Exit(1)
	}
}

// profiles are the files the agent's profiles are written to ("": not taken).
type profiles struct{ heap, cpu string }

// figures are what a run measured of the starts of one VM at a time and of n at once.
type figures struct {
	execMean, execMeanN   time.Duration // in the agent, run seen → VMM exec, mean per VM
	readyP50, readyP50N   time.Duration // create → guest ready, P50
	placedP50, placedP50N time.Duration // placement → Running seen, P50
}

// run runs the benchmark; with rx, every start is traced to it (the agent's and the
// operator's spans), else none.
func run(b *testing.B, n int, agentBin string, reportDelay time.Duration, prof profiles, rx *testotlp.Receiver) (*figures, error) {
	fig := &figures{}
	return fig, runInto(b, n, agentBin, reportDelay, prof, rx, fig)
}

func runInto(b *testing.B, n int, agentBin string, reportDelay time.Duration, prof profiles, rx *testotlp.Receiver, fig *figures) error {
	ctx := context.Background()
	cl, err := testcluster.Start()
	if err != nil {
		return err
	}
	defer cl.Stop()
	c := cl.Client
	tmp := b.TempDir()
	kernel, initrd := testguest.Artifacts(b, tmp)
	// The registry behind a proxy that counts the requests the agent makes.
	var regRequests atomic.Int64
	backend, _ := url.Parse("http://" + testregistry.Start(b, "", ""))
	rp := httputil.NewSingleHostReverseProxy(backend)
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { regRequests.Add(1); rp.ServeHTTP(w, r) }))
	defer proxy.Close()
	host := strings.TrimPrefix(proxy.URL, "http://")
	pinned := testguest.Image(b, host, "hello").String()

	const nodeName = "bench-node"
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName, Labels: map[string]string{impv1.NodeEnabledLabel: "true"}}}
	if err := c.Create(ctx, node); err != nil {
		return err
	}
	node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastTransitionTime: metav1.Now()}}
	if err := c.Status().Update(ctx, node); err != nil {
		return err
	}
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench"}}); err != nil {
		return err
	}
	// IMP's namespace, as the chart's: run Secrets and heartbeat Leases.
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: runsecret.DefaultNamespace}}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	// SkipNameValidation: -tracing-runs makes an operator in this process once per run.
	mgr, err := ctrl.NewManager(cl.Config, ctrl.Options{Scheme: cl.Scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		Cache: operator.CacheOptions(operator.Options{}), Controller: config.Controller{SkipNameValidation: ptr.To(true)}})
	if err != nil {
		return err
	}
	opCtx, stopOp := context.WithCancel(ctx)
	defer stopOp()
	vmOpts := impvm.DefaultOptions()
	traceArgs := []string{}
	if rx != nil {
		tp, shutdown, err := tracing.Provider(ctx, tracing.Config{Endpoint: rx.GRPC, Insecure: true, SampleRatio: 1}, "imp-operator")
		if err != nil {
			return err
		}
		defer tracing.Flush(shutdown)
		vmOpts.Traces = tp
		traceArgs = []string{"--tracing-endpoint", rx.GRPC, "--tracing-insecure", "--tracing-sample-ratio", "1"}
	}
	if err := operator.Setup(opCtx, mgr, operator.Options{VM: vmOpts, Concurrency: 4}); err != nil {
		return err
	}
	go func() { _ = mgr.Start(opCtx) }()

	user, err := cl.Env.AddUser(envtest.User{Name: "imp-agent", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return err
	}
	kc, _ := user.KubeConfig()
	kubeconfig := filepath.Join(tmp, "kubeconfig")
	if err := os.WriteFile(kubeconfig, kc, 0o600); err != nil {
		return err
	}
	stateDir := filepath.Join(tmp, "state")
	ml, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	metricsAddr := ml.Addr().String()
	ml.Close()
	pprofAddr := "0"
	if prof.heap != "" || prof.cpu != "" {
		pl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return err
		}
		pprofAddr = pl.Addr().String()
		pl.Close()
	}
	agent := exec.Command(agentBin, "--metrics-bind-address", metricsAddr, "--metrics-insecure", "--local-registry", "127.0.0.1", "--kubeconfig", kubeconfig, "--node-name", nodeName, "--state-dir", stateDir, "--netns-dir", filepath.Join(tmp, "netns"),
		"--kernel", kernel, "--initramfs", initrd, "--reserve-vcpus", "0", "--vcpu-overcommit", "8",
		"--health-probe-bind-address", "0", "--log-level", "error", "--starting-report-delay", reportDelay.String(), "--pprof-bind-address", pprofAddr)
	agent.Args = append(agent.Args, traceArgs...)
	agent.Stderr = os.Stderr
	if err := agent.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", agentBin, err)
	}
	defer func() { _ = agent.Process.Kill(); _ = agent.Wait() }()
	defer killVMMs(stateDir)

	// Observe placement, VMM exec (runtime Running reported) and guest readiness.
	var mu sync.Mutex
	type times struct{ created, placed, exec, ready time.Time }
	seen := map[string]*times{}
	informers, err := cache.New(cl.Config, cache.Options{Scheme: cl.Scheme, DefaultNamespaces: map[string]cache.Config{"bench": {}}})
	if err != nil {
		return err
	}
	inf, err := informers.GetInformer(ctx, &impv1.ImpVM{})
	if err != nil {
		return err
	}
	observe := func(obj any) {
		vm, ok := obj.(*impv1.ImpVM)
		if !ok {
			return
		}
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		t := seen[vm.Name]
		if t == nil {
			return
		}
		if vm.Status.NodeName != "" && t.placed.IsZero() {
			t.placed = now
		}
		if rt := vm.Status.Runtime; rt != nil && rt.State == impv1.RuntimeRunning {
			if t.exec.IsZero() {
				t.exec = now
			}
			if rt.GuestReady && t.ready.IsZero() {
				t.ready = now
			}
		}
	}
	_, _ = inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{AddFunc: observe, UpdateFunc: func(_, o any) { observe(o) }})
	go func() { _ = informers.Start(opCtx) }()
	informers.WaitForCacheSync(ctx)

	time.Sleep(3 * time.Second) // the agent settles: its node report is written
	rss0 := rss(agent.Process.Pid)
	cpu0 := idleCPU(agent.Process.Pid, 10*time.Second)
	create := func(name string) error {
		mu.Lock()
		seen[name] = &times{created: time.Now()}
		mu.Unlock()
		image := pinned
		if name == "warm" {
			image = host + "/hello:v1"
		}
		return c.Create(ctx, &impv1.ImpVM{
			ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: name},
			Spec: impv1.ImpVMSpec{Image: image, Args: []string{"serve"},
				Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))},
				DiskSize:  ptr.To(resource.MustParse("64Mi"))},
		})
	}
	waitReady := func(names ...string) error {
		deadline := time.Now().Add(10 * time.Minute)
		for time.Now().Before(deadline) {
			mu.Lock()
			done := 0
			for _, nm := range names {
				if !seen[nm].ready.IsZero() {
					done++
				}
			}
			mu.Unlock()
			if done == len(names) {
				return nil
			}
			time.Sleep(100 * time.Millisecond)
		}
		return fmt.Errorf("VMs not ready after 10 minutes")
	}
	// Warm the image: one VM first.
	if err := create("warm"); err != nil {
		return err
	}
	if err := waitReady("warm"); err != nil {
		return err
	}
	p50 := func(ds []time.Duration) time.Duration {
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		return ds[len(ds)/2]
	}
	// phase reports the VMs of one phase: as the API saw them, as the agent timed its steps,
	// and the registry requests they cost.
	written := fmt.Sprintf("%v after the exec unless the guest is ready first (-report-delay)", reportDelay)
	if reportDelay < 0 {
		written = "at once"
	}
	phase := func(title string, names []string, before steps, requests int64) {
		after, err := scrapeSteps(metricsAddr)
		if err != nil {
			fmt.Println("  (no metrics:", err, ")")
			return
		}
		var exec, ready []time.Duration
		mu.Lock()
		for _, nm := range names {
			t := seen[nm]
			exec = append(exec, t.exec.Sub(t.placed))
			ready = append(ready, t.ready.Sub(t.created))
		}
		mu.Unlock()
		fmt.Printf("  %s\n", title)
		fmt.Printf("    placement → Running seen  P50 %v  max %v  (through the API: the agent's report, written %s, included)\n",
			p50(exec).Round(time.Millisecond), exec[len(exec)-1].Round(time.Millisecond), written)
		fmt.Printf("    create → guest ready      P50 %v  max %v\n", p50(ready).Round(time.Millisecond), ready[len(ready)-1].Round(time.Millisecond))
		lo, hi := after.median("total", before)
		fmt.Printf("    in the agent, run seen → VMM exec  P50 in (%v, %v] (the histogram's bucket)\n", lo, hi)
		fmt.Printf("    steps, mean per VM:")
		for _, st := range []string{"secrets", "image_resolve", "base_disk", "image_config", "state_dir", "image", "config_disk", "writable_disk", "identity", "intent", "network", "exec", "total"} {
			fmt.Printf(" %s %v", st, after.mean(st, before).Round(10*time.Microsecond))
		}
		fmt.Printf("\n    registry requests          %.1f per VM (image pinned by digest, base disk on the node)\n", float64(regRequests.Load()-requests)/float64(len(names)))
		if len(names) == 5 && strings.HasPrefix(names[0], "one-") {
			fig.execMean, fig.readyP50, fig.placedP50 = after.mean("total", before), p50(ready), p50(exec)
		} else {
			fig.execMeanN, fig.readyP50N, fig.placedP50N = after.mean("total", before), p50(ready), p50(exec)
		}
	}
	fmt.Printf("agent benchmark: VMs of 128Mi on one node (QEMU, %s), image warm\n", accelOf())

	// One VM at a time.
	before, _ := scrapeSteps(metricsAddr)
	requests := regRequests.Load()
	var single []string
	for i := 0; i < 5; i++ {
		nm := fmt.Sprintf("one-%d", i)
		single = append(single, nm)
		if err := create(nm); err != nil {
			return err
		}
		if err := waitReady(nm); err != nil {
			return err
		}
	}
	phase("1 VM at a time (5 VMs)", single, before, requests)

	// n at once.
	before, _ = scrapeSteps(metricsAddr)
	requests = regRequests.Load()
	var names []string
	for i := 0; i < n; i++ {
		names = append(names, fmt.Sprintf("vm-%02d", i))
		if err := create(names[i]); err != nil {
			return err
		}
	}
	if err := waitReady(names...); err != nil {
		return err
	}
	rssN := rss(agent.Process.Pid)
	var cpuN string
	if prof.cpu != "" {
		// The profile over the same window as the figure.
		done := make(chan error, 1)
		go func() { done <- fetch("http://"+pprofAddr+"/debug/pprof/profile?seconds=10", prof.cpu) }()
		cpuN = idleCPU(agent.Process.Pid, 10*time.Second)
		if err := <-done; err != nil {
			return fmt.Errorf("the agent's CPU profile: %w", err)
		}
	} else {
		cpuN = idleCPU(agent.Process.Pid, 10*time.Second)
	}
	if prof.heap != "" {
		if err := fetch("http://"+pprofAddr+"/debug/pprof/heap", prof.heap); err != nil {
			return fmt.Errorf("the agent's heap profile: %w", err)
		}
	}
	phase(fmt.Sprintf("%d VMs created at once", n), names, before, requests)
	fmt.Printf("  agent RSS %v with 0 VMs, %v with %d VMs\n", rss0, rssN, n+len(single)+1)
	fmt.Printf("  agent CPU idle %v with 0 VMs, %v with %d VMs running (over 10 s each)\n", cpu0, cpuN, n+len(single)+1)
	fmt.Printf("  agent Go runtime with %d VMs: %s\n", n+len(single)+1, goRuntime(metricsAddr))
	return nil
}

// steps is the agent's imp_agent_vm_start_step_seconds: per step its sum, count and buckets.
type steps map[string]*stepHist

type stepHist struct {
	sum, count float64
	buckets    map[float64]float64 // le → cumulative count
}

// scrapeSteps reads the agent's start-step histogram from its metrics endpoint.
func scrapeSteps(addr string) (steps, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := steps{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		l := sc.Text()
		rest, ok := strings.CutPrefix(l, "imp_agent_vm_start_step_seconds_")
		if !ok {
			continue
		}
		i, j := strings.Index(rest, `step="`), strings.LastIndex(rest, " ")
		if i < 0 || j < 0 {
			continue
		}
		st := rest[i+6:]
		st = st[:strings.Index(st, `"`)]
		v, _ := strconv.ParseFloat(rest[j+1:], 64)
		h := out[st]
		if h == nil {
			h = &stepHist{buckets: map[float64]float64{}}
			out[st] = h
		}
		switch {
		case strings.HasPrefix(rest, "sum"):
			h.sum = v
		case strings.HasPrefix(rest, "count"):
			h.count = v
		case strings.HasPrefix(rest, "bucket"):
			k := strings.Index(rest, `le="`)
			le, _ := strconv.ParseFloat(strings.SplitN(rest[k+4:], `"`, 2)[0], 64)
			h.buckets[le] = v
		}
	}
	return out, sc.Err()
}

func (s steps) get(st string) *stepHist {
	if h := s[st]; h != nil {
		return h
	}
	return &stepHist{buckets: map[float64]float64{}}
}

// mean is the mean time of step st since before.
func (s steps) mean(st string, before steps) time.Duration {
	a, b := s.get(st), before.get(st)
	if a.count == b.count {
		return 0
	}
	return time.Duration((a.sum - b.sum) / (a.count - b.count) * float64(time.Second))
}

// median returns the bounds of the bucket that holds the median of step st since before.
func (s steps) median(st string, before steps) (lo, hi time.Duration) {
	a, b := s.get(st), before.get(st)
	n := a.count - b.count
	var les []float64
	for le := range a.buckets {
		les = append(les, le)
	}
	sort.Float64s(les)
	prev := 0.0
	for _, le := range les {
		if a.buckets[le]-b.buckets[le] >= n/2 {
			return time.Duration(prev * float64(time.Second)), time.Duration(le * float64(time.Second))
		}
		prev = le
	}
	return 0, 0
}

func accelOf() string {
	out, _ := exec.Command("sh", "-c", "ps -o args= -C qemu-system-x86_64 | grep -o 'accel [a-z]*' | head -1").Output()
	return strings.TrimSpace(string(out))
}

// killVMMs kills the VMMs the agent recorded under stateDir: they outlive the agent by design.
func killVMMs(stateDir string) {
	recs, _ := filepath.Glob(filepath.Join(stateDir, "vms", "*", vmm.RecordFile))
	for _, p := range recs {
		if rec, err := vmm.ReadRecord(filepath.Dir(p)); err == nil && rec.Alive() {
			_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
		}
	}
}

// memory is a process's resident memory in KiB: all of it, anonymous (its heap, stacks) and
// file-backed (the pages of its binary it touched, shared and reclaimable).
type memory struct{ rss, anon, file int64 }

func (m memory) String() string {
	return fmt.Sprintf("%d MiB (anonymous %d, file %d)", m.rss>>10, m.anon>>10, m.file>>10)
}

// idleCPU is the CPU time pid spends per second over d, in milliseconds per second.
func idleCPU(pid int, d time.Duration) string {
	before := cpuTicks(pid)
	time.Sleep(d)
	return fmt.Sprintf("%.1f ms/s", float64(cpuTicks(pid)-before)*10/d.Seconds())
}

// cpuTicks is pid's user and system time in clock ticks (100 a second on Linux).
func cpuTicks(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The fields after the command, which may hold spaces, in its parentheses.
	i := strings.LastIndexByte(string(b), ')')
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return u + st
}

func rss(pid int) memory {
	var m memory
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return m
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		for prefix, v := range map[string]*int64{"VmRSS:": &m.rss, "RssAnon:": &m.anon, "RssFile:": &m.file} {
			if s, ok := strings.CutPrefix(sc.Text(), prefix); ok {
				*v, _ = strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(s), " kB"), 10, 64)
			}
		}
	}
	return m
}

// goRuntime describes the agent's goroutines, heap and stacks from its metrics.
func goRuntime(addr string) string {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	var out []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		name, v, ok := strings.Cut(sc.Text(), " ")
		f, err := strconv.ParseFloat(v, 64)
		switch {
		case !ok || err != nil:
		case name == "go_goroutines":
			out = append(out, fmt.Sprintf("%.0f goroutines", f))
		case name == "go_memstats_heap_inuse_bytes", name == "go_memstats_heap_idle_bytes", name == "go_memstats_heap_released_bytes", name == "go_memstats_stack_inuse_bytes":
			out = append(out, fmt.Sprintf("%s %.1f MiB", strings.TrimSuffix(strings.TrimPrefix(name, "go_memstats_"), "_bytes"), f/(1<<20)))
		}
	}
	return strings.Join(out, ", ")
}

// fetch writes what url answers to path.
func fetch(url, path string) error {
	resp, err := http.Get(url) //nolint:gosec // the agent's loopback pprof endpoint
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// compareTracing runs the benchmark runs times with tracing off and as many with it on,
// alternated, and prints what tracing costs the start path: the medians of each side's
// figures, and on/off.
func compareTracing(b *testing.B, runs, n int, agentBin string, reportDelay time.Duration) error {
	rx := testotlp.Start(b)
	var off, on []*figures
	for i := range 2 * runs {
		// Off, on, on, off, ...: a machine that drifts over the runs favours neither.
		var r *testotlp.Receiver
		if i%4 == 1 || i%4 == 2 {
			r = rx
		}
		fmt.Printf("== run %d of %d, tracing %v\n", i+1, 2*runs, r != nil)
		f, err := run(b, n, agentBin, reportDelay, profiles{}, r)
		if err != nil {
			return err
		}
		if r != nil {
			on = append(on, f)
		} else {
			off = append(off, f)
		}
	}
	median := func(fs []*figures, get func(*figures) time.Duration) time.Duration {
		ds := make([]time.Duration, 0, len(fs))
		for _, f := range fs {
			ds = append(ds, get(f))
		}
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		return ds[len(ds)/2]
	}
	fmt.Printf("\ntracing's cost on the start path, medians of %d runs each (every start traced; %d spans received)\n", runs, len(rx.Spans()))
	fmt.Printf("  %-44s %12s %12s %8s\n", "", "off", "on", "on/off")
	for _, row := range []struct {
		name string
		get  func(*figures) time.Duration
	}{
		{"1 VM at a time: run seen → VMM exec, mean", func(f *figures) time.Duration { return f.execMean }},
		{"1 VM at a time: placement → Running seen, P50", func(f *figures) time.Duration { return f.placedP50 }},
		{"1 VM at a time: create → guest ready, P50", func(f *figures) time.Duration { return f.readyP50 }},
		{fmt.Sprintf("%d at once: run seen → VMM exec, mean", n), func(f *figures) time.Duration { return f.execMeanN }},
		{fmt.Sprintf("%d at once: create → guest ready, P50", n), func(f *figures) time.Duration { return f.readyP50N }},
	} {
		a, c := median(off, row.get), median(on, row.get)
		fmt.Printf("  %-44s %12v %12v %7.3f×\n", row.name, a.Round(10*time.Microsecond), c.Round(10*time.Microsecond), float64(c)/float64(max(a, 1)))
	}
	fmt.Println("  target: the start's overhead ≤ 2 % (issue 53)")
	return nil
}
