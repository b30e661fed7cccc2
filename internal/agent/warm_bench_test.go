package agent_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	dto "github.com/prometheus/client_model/go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// TestBenchWarmClaims is the real-guest half of `make bench-warmpool`, skipped otherwise
// (IMP_BENCH=warmclaims): an ImpWarmPool of real guests (QEMU/TCG, paused while idle) on an
// ImpNetwork, the operator and the agent in this process. It measures claim created → exec
// possible in the claim's guest (an exec through its session channel, tried every 5 ms: as the
// API server's exec reaches the agent once the VM names its node): one
// claim at a time (the pool refilled between), and ten at once against a pool of ten; and the
// agent's handover plan itself (imp_agent_vm_start_step_seconds{step="handover"}). It prints
// the figures and asserts none.
func TestBenchWarmClaims(t *testing.T) {
	if os.Getenv("IMP_BENCH") != "warmclaims" {
		t.Skip("a benchmark: make bench-warmpool")
	}
	w := newWorld(t, func(o *agent.Options) { o.VCPUOvercommit = 16 })
	c, ns, ctx := w.c, w.ns, context.Background()
	g := NewWithT(t)
	g.Expect(c.Client.Create(ctx, &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.88.0.0/24"}})).To(Succeed())
	spec := w.vm("", "counter").Spec
	spec.NodeSelector = nil
	spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	g.Expect(c.Client.Create(ctx, &impv1.ImpVMTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "tpl"}, Spec: impv1.ImpVMTemplateSpec{VM: spec}})).To(Succeed())
	pool := &impv1.ImpWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "p"}, Spec: impv1.ImpWarmPoolSpec{
		TemplateRef: impv1.TemplateReference{Name: "tpl"}, Replicas: ptr.To[int32](1),
		NodeSelector: map[string]string{"imp.test/node": w.node}, NetworkRef: &impv1.NetworkReference{Name: "net"}}}
	g.Expect(c.Client.Create(ctx, pool)).To(Succeed())
	idle := func(n int32) {
		g.Eventually(func() int32 {
			p := &impv1.ImpWarmPool{}
			_ = c.Client.Get(ctx, client.ObjectKeyFromObject(pool), p)
			return p.Status.Idle
		}).WithTimeout(5*time.Minute).WithPolling(100*time.Millisecond).Should(BeNumerically(">=", n), func() string {
			var list impv1.ImpVMList
			_ = c.Client.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{impv1.WarmPoolLabel: "p"})
			var b strings.Builder
			b.WriteString(agentStacks("warmbench")) // where the agent's work stands
			for _, m := range list.Items {
				fmt.Fprintf(&b, "\n%s %s node %q run %+v", m.Name, m.Status.Phase, m.Status.NodeName, m.Status.Runtime)
			}
			return b.String()
		})
	}
	claim := func(name string) time.Duration {
		began := time.Now()
		g.Expect(c.Client.Create(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMSpec{
			WarmPoolRef: &impv1.WarmPoolReference{Name: "p"}, NetworkRef: &impv1.NetworkReference{Name: "net"}}})).To(Succeed())
		for {
			if _, err := w.tryExec(name, "tool-true"); err == nil {
				took := time.Since(began)
				if v := w.get(name); v.Status.Start != impv1.StartWarm {
					t.Logf("%s was not served warm: %s", name, v.Status.Start)
				}
				return took
			}
			if time.Since(began) > 5*time.Minute {
				t.Fatalf("%s: no exec after 5 minutes: %+v", name, w.get(name).Status)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	idle(1)
	var one []time.Duration
	for i := range 5 {
		idle(1)
		one = append(one, claim(fmt.Sprintf("one-%d", i)))
	}
	handedOne := handoverSeconds(t)
	p := &impv1.ImpWarmPool{}
	g.Expect(c.Client.Get(ctx, client.ObjectKeyFromObject(pool), p)).To(Succeed())
	p.Spec.Replicas = ptr.To[int32](10)
	g.Expect(c.Client.Update(ctx, p)).To(Succeed())
	idle(10)
	time.Sleep(2 * time.Second) // the last members paused
	var mu sync.Mutex
	var ten []time.Duration
	var wg sync.WaitGroup
	for i := range 10 {
		wg.Go(func() {
			d := claim(fmt.Sprintf("ten-%d", i))
			mu.Lock()
			ten = append(ten, d)
			mu.Unlock()
		})
	}
	wg.Wait()
	handed := handoverSeconds(t)
	// Ten claims of ten members at once never share one: each its own guest (host name,
	// address, channel token, random draws), served warm.
	warm, hosts, tokens, draws, addrs := 0, map[string]bool{}, map[string]bool{}, map[string]bool{}, map[string]bool{}
	for i := range 10 {
		name := fmt.Sprintf("ten-%d", i)
		v := w.get(name)
		if v.Status.Start == impv1.StartWarm {
			warm++
		}
		if out, err := w.tryExec(name, "tool-read", "/proc/sys/kernel/hostname"); err == nil && out == name {
			hosts[out] = true
		}
		if out, err := w.tryExec(name, "tool-head", "/dev/urandom", "16"); err == nil {
			draws[out] = true
		}
		if m, err := vmrun.ReadMeta(filepath.Join(w.stateDir, "vms", string(v.HostUID()))); err == nil && m.UID == v.UID {
			tokens[m.Token] = true
		}
		addrs[v.Status.IP] = true
	}
	fmt.Printf("ten claims at once: %d served warm; distinct: %d host names (each its own), %d addresses, %d channel tokens, %d /dev/urandom draws\n",
		warm, len(hosts), len(addrs), len(tokens), len(draws))
	fmt.Printf("warm claim → exec (real guests, QEMU/TCG, paused members, on a network): one at a time P50 %v P99 %v (%d); ten at once P50 %v P99 %v\n",
		pct(one, 50), pct(one, 99), len(one), pct(ten, 50), pct(ten, 99))
	fmt.Printf("warm handover plan on the node: %d handovers, mean %.1f ms (one at a time %.1f ms)\n", handed.count, handed.mean()*1000, handedOne.mean()*1000)
}

type seconds struct {
	count uint64
	sum   float64
}

func (s seconds) mean() float64 {
	if s.count == 0 {
		return 0
	}
	return s.sum / float64(s.count)
}

// handoverSeconds is the agent's histogram of its handover plans, so far.
func handoverSeconds(t *testing.T) seconds {
	mfs, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "imp_agent_vm_start_step_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if stepLabel(m) == "handover" {
				return seconds{count: m.GetHistogram().GetSampleCount(), sum: m.GetHistogram().GetSampleSum()}
			}
		}
	}
	return seconds{}
}

func stepLabel(m *dto.Metric) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == "step" {
			return l.GetValue()
		}
	}
	return ""
}

// pct is the p-th percentile of ds (nearest rank).
func pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := (p*len(s) + 99) / 100
	return s[max(i-1, 0)].Round(time.Millisecond)
}
