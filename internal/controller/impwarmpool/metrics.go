package impwarmpool

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Metrics; docs/metrics.md documents them.
var (
	refill = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "imp_warmpool_refill_seconds",
		Help:    "Time from a warm pool member's creation to its first being idle (running, guest ready): how long the pool takes to refill.",
		Buckets: []float64{.1, .25, .5, 1, 2, 5, 10, 30, 60, 120, 300},
	})
	poolDesc = prometheus.NewDesc("imp_warmpool_members", "Members of each warm pool: desired (spec.replicas), members (not handed out), idle, claimed (being handed over).",
		[]string{"namespace", "pool", "state"}, nil)
)

func init() { metrics.Registry.MustRegister(refill) }

// poolCollector reports the pools' status from the operator's cache at scrape time.
type poolCollector struct{ reader client.Reader }

func (c poolCollector) Describe(ch chan<- *prometheus.Desc) { ch <- poolDesc }

func (c poolCollector) Collect(ch chan<- prometheus.Metric) {
	var list impv1.ImpWarmPoolList
	if err := c.reader.List(context.Background(), &list); err != nil {
		ch <- prometheus.NewInvalidMetric(poolDesc, err)
		return
	}
	for _, p := range list.Items {
		for state, n := range map[string]int32{"desired": ptr.Deref(p.Spec.Replicas, 1), "members": p.Status.Replicas, "idle": p.Status.Idle, "claimed": p.Status.Claimed} {
			ch <- prometheus.MustNewConstMetric(poolDesc, prometheus.GaugeValue, float64(n), p.Namespace, p.Name, state)
		}
	}
}

// Collector returns the package's scrape-time collector, reading pools through reader (the
// manager's cache).
func Collector(reader client.Reader) prometheus.Collector { return poolCollector{reader: reader} }

// refills observes each member's refill time once, the first time its pool sees it idle.
type refills struct {
	mu   sync.Mutex
	seen map[types.NamespacedName]map[types.UID]bool // pool → members seen idle
}

// observe records the members of pool idle now, and forgets those gone.
func (r *refills) observe(pool types.NamespacedName, members []*member, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.seen == nil {
		r.seen = map[types.NamespacedName]map[types.UID]bool{}
	}
	was := r.seen[pool]
	next := make(map[types.UID]bool, len(members))
	for _, m := range members {
		seen := was[m.vm.UID]
		if m.idle && !seen && !m.created.IsZero() {
			refill.Observe(now.Sub(m.created).Seconds())
			seen = true
		}
		if seen {
			next[m.vm.UID] = true
		}
	}
	if len(next) == 0 {
		delete(r.seen, pool)
	} else {
		r.seen[pool] = next
	}
}
