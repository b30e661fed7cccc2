package impvm

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Metrics; docs/metrics.md documents them.
var (
	placementLatency = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "imp_vm_placement_duration_seconds",
		Help:    "Time from an ImpVM's creation to its placement on a node.",
		Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
	})
	createToRunning = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "imp_vm_create_to_running_seconds",
		Help:    "Time from an ImpVM's creation to its first Running phase.",
		Buckets: []float64{.25, .5, 1, 2, 5, 10, 20, 30, 60, 120, 300},
	})
	placementFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imp_vm_placement_failures_total",
		Help: "Placement attempts that did not place an ImpVM, by reason (the Scheduled condition's reason).",
	}, []string{"reason"})
	claimToRunning = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "imp_warmpool_claim_running_seconds",
		Help:    "Time from a claim's creation to its first Running phase (its guest ready as the claim), by start.",
		Buckets: []float64{.025, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60},
	}, []string{"start"})
	vmsDesc       = prometheus.NewDesc("imp_vms", "ImpVMs by phase and node (empty node: not placed).", []string{"phase", "node"}, nil)
	suspendedDesc = prometheus.NewDesc("imp_vms_suspended", "ImpVMs suspended (or being suspended), by reason (PressureLifecycle, User) and node.", []string{"reason", "node"}, nil)
)

// vmCollector counts VMs by phase and node from the operator's cache at scrape time.
type vmCollector struct{ reader client.Reader }

func (c vmCollector) Describe(ch chan<- *prometheus.Desc) { ch <- vmsDesc; ch <- suspendedDesc }

func (c vmCollector) Collect(ch chan<- prometheus.Metric) {
	var list impv1.ImpVMList
	if err := c.reader.List(context.Background(), &list); err != nil {
		ch <- prometheus.NewInvalidMetric(vmsDesc, err)
		return
	}
	type key struct{ phase, node string }
	counts := map[key]float64{}
	suspended := map[key]float64{} // phase holds the reason
	for _, vm := range list.Items {
		if sp := vm.Status.Suspension; sp != nil {
			suspended[key{sp.Reason, vm.Status.NodeName}]++
		}
		phase := string(vm.Status.Phase)
		if phase == "" {
			phase = string(impv1.VMPending)
		}
		counts[key{phase, vm.Status.NodeName}]++
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(vmsDesc, prometheus.GaugeValue, n, k.phase, k.node)
	}
	for k, n := range suspended {
		ch <- prometheus.MustNewConstMetric(suspendedDesc, prometheus.GaugeValue, n, k.phase, k.node)
	}
}

func init() {
	metrics.Registry.MustRegister(placementLatency, createToRunning, placementFailures, claimToRunning)
}

// Collector returns the package's scrape-time collector, reading objects through reader (the
// manager's cache).
func Collector(reader client.Reader) prometheus.Collector { return vmCollector{reader: reader} }
