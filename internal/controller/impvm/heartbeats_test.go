package impvm

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestHeartbeatSilence(t *testing.T) {
	t0 := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	beat := func(d time.Duration) *metav1.Time { b := metav1.NewTime(t0.Add(d)); return &b }
	type obs struct {
		beat *metav1.Time
		at   time.Duration // operator clock, from t0
		want time.Duration
	}
	for _, tt := range []struct {
		name string
		obs  []obs
	}{
		{"unchanged heartbeat: silent since first seen", []obs{{beat(0), 0, 0}, {beat(0), 30 * time.Second, 30 * time.Second}, {beat(0), 3 * time.Minute, 3 * time.Minute}}},
		{"a new heartbeat resets", []obs{{beat(0), 0, 0}, {beat(0), time.Minute, time.Minute}, {beat(time.Minute), 61 * time.Second, 0}, {beat(time.Minute), 2 * time.Minute, 59 * time.Second}}},
		{"first seen after a restart: since the heartbeat's own time", []obs{{beat(0), 5 * time.Minute, 5 * time.Minute}, {beat(0), 6 * time.Minute, 6 * time.Minute}}},
		{"an agent clock ahead of ours: from first sight", []obs{{beat(time.Hour), 0, 0}, {beat(time.Hour), time.Minute, time.Minute}}},
		{"a skewed agent clock never matters once seen", []obs{{beat(-time.Hour), 0, time.Hour}, {beat(-time.Hour + time.Second), time.Second, 0}, {beat(-time.Hour + time.Second), 2 * time.Second, time.Second}}},
		{"no heartbeat at all", []obs{{nil, 0, 0}, {nil, time.Minute, time.Minute}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var h heartbeats
			for i, o := range tt.obs {
				if got := h.silentFor("n", o.beat, t0.Add(o.at)); got != o.want {
					t.Errorf("observation %d: silent for %v, want %v", i, got, o.want)
				}
			}
		})
	}
}
