package impvm

import (
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// heartbeats measures how long each node's agent has been silent on the operator's own clock:
// it remembers each node's last heartbeat value and when it first saw that value, so that a
// running operator never compares the agent's clock with its own. Only for a node it has not
// seen before (after an operator restart) does it take the heartbeat's own time, when that is
// in the past. Silence only stops placement and is reported; it never moves a VM by itself.
type heartbeats struct {
	mu   sync.Mutex
	seen map[string]heartbeat
}

type heartbeat struct {
	beat time.Time // the agent's heartbeatTime
	at   time.Time // when the operator first saw it
}

// lastBeat is an agent's latest sign of life: its heartbeat Lease's renewal, or the time of
// its last report (agents before the Lease beat there), whichever is later.
func lastBeat(renewed *metav1.MicroTime, reported *metav1.Time) *metav1.Time {
	if renewed == nil || renewed.IsZero() {
		return reported
	}
	if reported != nil && reported.After(renewed.Time) {
		return reported
	}
	return &metav1.Time{Time: renewed.Time}
}

// silentFor returns how long node's agent has reported beat without a newer one, at now.
func (h *heartbeats) silentFor(node string, beat *metav1.Time, now time.Time) time.Duration {
	var b time.Time
	if beat != nil {
		b = beat.Time
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.seen == nil {
		h.seen = map[string]heartbeat{}
	}
	s, ok := h.seen[node]
	switch {
	case !ok && !b.IsZero() && b.Before(now):
		s = heartbeat{beat: b, at: b}
		h.seen[node] = s
	case !ok || !s.beat.Equal(b):
		h.seen[node] = heartbeat{beat: b, at: now}
		return 0
	}
	return now.Sub(s.at)
}
