package agent_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// TestBenchServices (make bench-services; IMP_BENCH=services) measures, with a real guest under
// QEMU/TCG behind a Service: how long after the VM becomes Ready its endpoint is ready (its
// readiness probe failed and passed again, rounds times: P50, P99; target ≤ 1 s), and HTTP
// requests (each a new connection) through the VM's endpoint address from a pod against the
// same guest reached directly from its network's namespace (requests/s, P50; target ≥ 0.8×).
func TestBenchServices(t *testing.T) {
	if os.Getenv("IMP_BENCH") != "services" {
		t.Skip("a benchmark: make bench-services")
	}
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	sw := newSvcWorld(t, c, map[string]string{ns: "web"})
	ready := func() (vm, ep bool) {
		v := sw.world(ns).get("web")
		eps := sw.endpoints(ns)
		return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition), len(eps) == 1 && strings.HasSuffix(eps[0], " true")
	}
	g := NewWithT(t)
	g.Eventually(func() bool { _, ep := ready(); return ep }).WithTimeout(12*time.Minute).Should(BeTrue(), "the endpoint ready")
	addr := strings.Fields(sw.endpoints(ns)[0])[0]

	const rounds = 15
	var lags []time.Duration
	for i := 0; i < rounds; i++ {
		sw.exec(t, ns, "web", "tool-touch", "/dev/imp-unready")
		g.Eventually(func() bool { vm, ep := ready(); return !vm && !ep }).WithTimeout(time.Minute).Should(BeTrue(), "the endpoint not ready")
		sw.exec(t, ns, "web", "tool-rm", "/dev/imp-unready")
		var vmAt time.Time
		deadline := time.Now().Add(time.Minute)
		for time.Now().Before(deadline) {
			vm, ep := ready()
			now := time.Now()
			if vm && vmAt.IsZero() {
				vmAt = now
			}
			if ep {
				if vmAt.IsZero() {
					vmAt = now
				}
				lags = append(lags, now.Sub(vmAt))
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	slices.Sort(lags)
	pct := func(d []time.Duration, p int) time.Duration { return d[min(len(d)-1, len(d)*p/100)] }
	fmt.Printf("VM Ready → endpoint ready (%d rounds, polled every 5 ms): P50 %v, P99 %v (target ≤ 1 s)\n",
		len(lags), pct(lags, 50).Round(time.Millisecond), pct(lags, 99).Round(time.Millisecond))

	spaces, _ := filepath.Glob(filepath.Join(sw.pins, "impn*"))
	if len(spaces) != 1 {
		t.Fatalf("network namespaces %v", spaces)
	}
	ip := sw.world(ns).get("web").Status.IP
	load := func(netns, target string) (float64, time.Duration) {
		var took []time.Duration
		began := time.Now()
		for time.Since(began) < 5*time.Second {
			t0 := time.Now()
			if got := get(netns, target); got != "hello from web" {
				t.Fatalf("%s from %s: %q", target, netns, got)
			}
			took = append(took, time.Since(t0))
		}
		rate := float64(len(took)) / time.Since(began).Seconds()
		slices.Sort(took)
		return rate, pct(took, 50)
	}
	viaRate, viaP50 := load(sw.pod, addr)
	directRate, directP50 := load(spaces[0], ip+":8080")
	fmt.Printf("HTTP/1.0 GET, a new connection each, 5 s: through the endpoint %s from a pod %.0f req/s (P50 %v); "+
		"direct to %s:8080 from its network's namespace %.0f req/s (P50 %v): %.2f× (target ≥ 0.8×)\n",
		addr, viaRate, viaP50.Round(10*time.Microsecond), ip, directRate, directP50.Round(10*time.Microsecond), viaRate/directRate)
}
