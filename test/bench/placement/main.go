// Command placement benchmarks the operator's placement: it starts a control plane, registers M
// nodes with agent reports, runs bin/imp-operator as a process, creates N VMs at once and prints
// create→Scheduled latency (P50, P99), VMs placed per second, API writes per VM and the
// operator's memory.
//
//	go run ./test/bench/placement -n 1000 -m 100      (make bench-placement N=1000 M=100)
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/testcluster"
)

func main() {
	n := flag.Int("n", 1000, "VMs to place")
	m := flag.Int("m", 100, "nodes")
	workers := flag.Int("workers", 32, "concurrent creators")
	concurrency := flag.Int("vm-concurrency", 4, "the operator's --vm-concurrency")
	operatorBin := flag.String("operator", "bin/imp-operator", "imp-operator binary")
	flag.Parse()
	if err := run(*n, *m, *workers, *concurrency, *operatorBin); err != nil {
		fmt.Fprintln(os.Stderr, "bench-placement:", err)
		os.Exit(1)
	}
}

func run(n, m, workers, concurrency int, operatorBin string) error {
	ctx := context.Background()
	cl, err := testcluster.Start()
	if err != nil {
		return err
	}
	defer cl.Stop()
	c := cl.Client

	for i := 0; i < m; i++ {
		if err := addNode(ctx, c, fmt.Sprintf("bench-node-%03d", i)); err != nil {
			return err
		}
	}
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench"}}); err != nil {
		return err
	}

	// The operator, as a process.
	dir, err := os.MkdirTemp("", "bench-placement")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	user, err := cl.Env.AddUser(envtest.User{Name: "imp-operator", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return err
	}
	kc, err := user.KubeConfig()
	if err != nil {
		return err
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, kc, 0o600); err != nil {
		return err
	}
	metricsAddr, err := freeAddr()
	if err != nil {
		return err
	}
	op := exec.Command(operatorBin, "--kubeconfig", kubeconfig, "--leader-elect=false",
		"--metrics-bind-address", metricsAddr, "--health-probe-bind-address", "127.0.0.1:0",
		"--vm-concurrency", strconv.Itoa(concurrency), "--log-level", "error")
	op.Stderr = os.Stderr
	if err := op.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", operatorBin, err)
	}
	defer func() { _ = op.Process.Kill(); _ = op.Wait() }()
	writesBefore, err := waitMetrics(metricsAddr)
	if err != nil {
		return err
	}

	// Watch for Scheduled=True.
	var mu sync.Mutex
	created := make(map[string]time.Time, n)
	scheduled := make(map[string]time.Time, n)
	informers, err := cache.New(cl.Config, cache.Options{Scheme: cl.Scheme, DefaultNamespaces: map[string]cache.Config{"bench": {}}})
	if err != nil {
		return err
	}
	informerCtx, stopInformers := context.WithCancel(ctx)
	defer stopInformers()
	inf, err := informers.GetInformer(informerCtx, &impv1.ImpVM{})
	if err != nil {
		return err
	}
	allScheduled := make(chan struct{})
	observe := func(obj any) {
		vm, ok := obj.(*impv1.ImpVM)
		if !ok || !meta.IsStatusConditionTrue(vm.Status.Conditions, impv1.ScheduledCondition) {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if _, seen := scheduled[vm.Name]; !seen {
			scheduled[vm.Name] = time.Now()
			if len(scheduled) == n {
				close(allScheduled)
			}
		}
	}
	if _, err := inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    observe,
		UpdateFunc: func(_, obj any) { observe(obj) },
	}); err != nil {
		return err
	}
	go func() { _ = informers.Start(informerCtx) }()
	if !informers.WaitForCacheSync(informerCtx) {
		return fmt.Errorf("syncing the VM informer")
	}

	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				name := fmt.Sprintf("vm-%05d", i)
				t0 := time.Now()
				if err := c.Create(ctx, benchVM(name)); err != nil {
					errs <- err
					return
				}
				mu.Lock()
				created[name] = t0
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return fmt.Errorf("creating VMs: %w", err)
	}
	createdAll := time.Since(start)
	deadline := time.After(10 * time.Minute)
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
wait:
	for {
		select {
		case <-allScheduled:
			break wait
		case <-tick.C:
			var vms impv1.ImpVMList
			placed := 0
			if err := c.List(ctx, &vms, client.InNamespace("bench")); err == nil {
				for _, vm := range vms.Items {
					if vm.Status.NodeName != "" {
						placed++
					}
				}
			}
			mu.Lock()
			seen := len(scheduled)
			mu.Unlock()
			fmt.Fprintf(os.Stderr, "  ... %v: %d placed in the API, %d seen by the watch\n", time.Since(start).Round(time.Second), placed, seen)
		case <-deadline:
			return fmt.Errorf("only %d of %d VMs scheduled after 10 minutes", len(scheduled), n)
		}
	}
	elapsed := time.Since(start)
	rss, hwm := memory(op.Process.Pid)
	time.Sleep(2 * time.Second) // let Events in flight be written before counting writes
	writesAfter, err := scrapeWrites(metricsAddr)
	if err != nil {
		return err
	}

	mu.Lock()
	lat := make([]time.Duration, 0, n)
	for name, t := range scheduled {
		lat = append(lat, t.Sub(created[name]))
	}
	mu.Unlock()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) time.Duration { return lat[min(len(lat)-1, int(p*float64(len(lat))))] }

	fmt.Printf("placement benchmark: N=%d VMs, M=%d nodes, %d creators, operator --vm-concurrency=%d\n", n, m, workers, concurrency)
	fmt.Printf("  create→Scheduled latency  P50 %v  P99 %v  max %v\n", pct(.50).Round(time.Millisecond), pct(.99).Round(time.Millisecond), lat[len(lat)-1].Round(time.Millisecond))
	fmt.Printf("  throughput                %.0f VMs/s placed (all %d created in %v, all placed after %v)\n", float64(n)/elapsed.Seconds(), n, createdAll.Round(time.Millisecond), elapsed.Round(time.Millisecond))
	total := 0.0
	var parts []string
	for _, k := range sortedKeys(writesAfter) {
		d := writesAfter[k] - writesBefore[k]
		total += d
		parts = append(parts, fmt.Sprintf("%s %.2f", k, d/float64(n)))
	}
	fmt.Printf("  operator API writes/VM    %.2f (%s; Events included)\n", total/float64(n), strings.Join(parts, ", "))
	fmt.Printf("  operator memory           RSS %d MiB, peak %d MiB\n", rss>>10, hwm>>10)
	return nil
}

func benchVM(name string) *impv1.ImpVM {
	return &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: name},
		Spec: impv1.ImpVMSpec{
			Image:     "registry.test/app:1",
			Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("256Mi"))},
		},
	}
}

func addNode(ctx context.Context, c client.Client, name string) error {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{impv1.NodeEnabledLabel: "true"}}}
	if err := c.Create(ctx, node); err != nil {
		return err
	}
	node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastTransitionTime: metav1.Now()}}
	if err := c.Status().Update(ctx, node); err != nil {
		return err
	}
	rep := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if err := c.Create(ctx, rep); err != nil {
		return err
	}
	rep.Status = impv1.ImpNodeStatus{
		Allocatable: &impv1.NodeResources{VCPUs: 64, Memory: resource.MustParse("256Gi")},
		VMMs:        []impv1.VMMCapability{{Kind: impv1.VMMFirecracker, Acceleration: "kvm"}},
		Conditions:  []metav1.Condition{{Type: impv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: impv1.ReasonAgentReady, LastTransitionTime: metav1.Now()}},
	}
	return c.Status().Update(ctx, rep)
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

func waitMetrics(addr string) (map[string]float64, error) {
	deadline := time.Now().Add(60 * time.Second)
	for {
		w, err := scrapeWrites(addr)
		if err == nil {
			return w, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("operator metrics at %s: %w", addr, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// scrapeWrites sums the operator's rest_client_requests_total by method, writes only.
func scrapeWrites(addr string) (map[string]float64, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "rest_client_requests_total{") {
			continue
		}
		i := strings.Index(line, `method="`)
		if i < 0 {
			continue
		}
		method := line[i+8:]
		method = method[:strings.IndexByte(method, '"')]
		if method == "GET" {
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err == nil {
			out[method] += v
		}
	}
	return out, sc.Err()
}

// memory returns the process's resident and peak resident memory in KiB.
func memory(pid int) (rss, hwm int64) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
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

func sortedKeys(m map[string]float64) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
