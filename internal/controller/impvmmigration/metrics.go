package impvmmigration

import (
	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Metrics; docs/metrics.md documents them. Each migration is counted once, when the operator
// writes its end (Succeeded or Failed).
var (
	ended = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "imp_vm_migrations_total",
		Help: "ImpVMMigrations ended, by result (Succeeded, Failed) and reason (the Ready condition's).",
	}, []string{"result", "reason"})
	duration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "imp_vm_migration_duration_seconds",
		Help:    "An ImpVMMigration's start (the VM became the migration's) to its end, by result.",
		Buckets: []float64{.25, .5, 1, 2, 5, 10, 30, 60, 120, 300, 600},
	}, []string{"result"})
	pausedFor = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "imp_vm_migration_downtime_seconds",
		Help:    "How long a migrated VM's guest was paused (the source's figure), for each migration that succeeded.",
		Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
	})
	moved = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "imp_vm_migration_sent_bytes_total",
		Help: "Bytes of memory and device state the sources of migrations that succeeded sent.",
	})
)

func init() { metrics.Registry.MustRegister(ended, duration, pausedFor, moved) }

// observeEnd counts a migration whose end was just written.
func observeEnd(st *impv1.ImpVMMigrationStatus) {
	result := string(st.Phase)
	ended.WithLabelValues(result, st.Reason).Inc()
	if st.StartedAt != nil && st.CompletedAt != nil {
		duration.WithLabelValues(result).Observe(st.CompletedAt.Sub(st.StartedAt.Time).Seconds())
	}
	if st.Phase != impv1.MigrationSucceeded {
		return
	}
	if st.Downtime != nil {
		pausedFor.Observe(st.Downtime.Seconds())
	}
	moved.Add(float64(max(st.BytesMoved, 0)))
}
