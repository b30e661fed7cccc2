package steps

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// startStepSeconds times a VM's start on its node, from the reconcile that first sees its run
// to the VMM's execve, step by step.
var startStepSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
	Name: "imp_agent_vm_start_step_seconds",
	Help: "Time of each step of a VM's start on its node. The image fetch, off the workers: secrets (its run Secret), " +
		"image_resolve (a tag's digest), base_disk (pulled and built, or found), image_config. The start plan's steps that " +
		"acted: provenance, state_dir, image (the wait for the fetch in the pass that took it), config_disk, writable_disk, " +
		"identity, intent, network (tap and rules), exec (the VMM started, in its cgroups, and recorded); and total (from " +
		"the run first seen to its VMM recorded).",
	Buckets: startStepBuckets,
}, []string{"step"})

// startStepBuckets bound the start's steps: from a millisecond to a slow pull's ten minutes, with
// bounds at the start path's goals (a writable disk in 10 ms, a start in 50 ms, ten at once in
// 150 ms), so that a histogram's quantile can be compared to them without interpolation.
var startStepBuckets = []float64{.001, .0025, .005, .01, .025, .05, .075, .1, .15, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

func init() { metrics.Registry.MustRegister(startStepSeconds) }

// ObserveStart records that the start step took took (a plan's Observe).
func ObserveStart(step string, took time.Duration) {
	startStepSeconds.WithLabelValues(step).Observe(took.Seconds())
}

// Timer returns a function that observes, as the start step it names, the time since its
// previous call or, the first time, since Timer.
func Timer() func(step string) {
	last := time.Now()
	return func(step string) {
		now := time.Now()
		startStepSeconds.WithLabelValues(step).Observe(now.Sub(last).Seconds())
		last = now
	}
}
