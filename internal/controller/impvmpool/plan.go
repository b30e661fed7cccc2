package impvmpool

import (
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/util/intstr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// member is what the planner needs of one of a pool's VMs.
type member struct {
	name  string
	index int
	rev   string
	// created orders members for scale-in (newest first).
	created time.Time
	// deleting: being deleted; it counts for nothing, but holds its name (index).
	deleting bool
	// placed: the VM has a node.
	placed bool
	// ready: its Ready condition is True, since readySince.
	ready      bool
	readySince time.Time
	// finished: Failed or Succeeded, which a member (runStrategy Always) is only when it cannot
	// run again: it is replaced.
	finished bool
	// foreign: not a member, but a VM holding a member's name (one the pool does not control,
	// or whose labels left the selector): the pool leaves it alone and skips its index.
	foreign bool
}

// plan is what one reconcile does: delete members, then create members of rev at indices.
type plan struct {
	delete []string
	create []int
	// requeue: when a member becomes available (minReadySeconds), if nothing else wakes the pool.
	requeue time.Duration
}

// bounds are a pool's update parameters, resolved against its replicas.
type bounds struct {
	replicas, maxSurge, maxUnavailable int
	minReady                           time.Duration
	onDelete                           bool
	// inPlace: members have claims of their own (volumeClaimTemplates), so a member is
	// replaced at its own index, once the one it replaces is gone: a member being deleted
	// still holds its place, and there is no surge.
	inPlace bool
}

// boundsOf resolves a pool's strategy: a percentage of replicas, surge rounded up and
// unavailability down, as a Deployment's are; both 0 would stall, so unavailability is then 1.
func boundsOf(p *impv1.ImpVMPool) bounds {
	b := bounds{replicas: int(replicasOf(p)), minReady: time.Duration(p.Spec.MinReadySeconds) * time.Second,
		onDelete: p.Spec.UpdateStrategy.Type == impv1.PoolOnDelete}
	surge, unavailable := intstr.FromString("25%"), intstr.FromString("25%")
	if ru := p.Spec.UpdateStrategy.RollingUpdate; ru != nil {
		if ru.MaxSurge != nil {
			surge = *ru.MaxSurge
		}
		if ru.MaxUnavailable != nil {
			unavailable = *ru.MaxUnavailable
		}
	}
	// The schema admits only counts and percentages: an error cannot happen, and 0 is safe.
	s, _ := intstr.GetScaledValueFromIntOrPercent(&surge, b.replicas, true)
	u, _ := intstr.GetScaledValueFromIntOrPercent(&unavailable, b.replicas, false)
	if b.inPlace = len(p.Spec.VolumeClaimTemplates) > 0; b.inPlace {
		s = 0
	}
	if s == 0 && u == 0 {
		u = 1
	}
	b.maxSurge, b.maxUnavailable = s, u
	return b
}

func replicasOf(p *impv1.ImpVMPool) int32 {
	if p.Spec.Replicas == nil {
		return 1
	}
	return *p.Spec.Replicas
}

// available: Ready for minReady at now; else, when it will be (0: not Ready at all).
func (m *member) available(now time.Time, minReady time.Duration) (bool, time.Duration) {
	if !m.ready {
		return false, 0
	}
	left := m.readySince.Add(minReady).Sub(now)
	return left <= 0, left
}

// planFor decides what a pool does next, from its members as they are (a consistent list):
//   - finished members are deleted (and replaced);
//   - without members of an older revision (or with OnDelete), the pool is scaled to replicas:
//     new members are of rev, surplus members go in scale-in order (byScaleIn);
//   - otherwise a rolling update: members of rev are created while the pool holds fewer than
//     replicas+maxSurge, and old members are deleted while at least replicas-maxUnavailable
//     stay available — unavailable old members first, as a Deployment's controller does.
//
// New members take the lowest indices no member holds, so a create repeated after a crash, or
// from a list that lagged, fails AlreadyExists instead of making one too many.
func planFor(b bounds, rev string, members []member, now time.Time) plan {
	var p plan
	var active, current, old []*member
	taken := map[int]bool{}
	holding := 0 // members being deleted that still hold their place (inPlace)
	for i := range members {
		m := &members[i]
		taken[m.index] = true
		switch {
		case m.deleting && b.inPlace && !m.foreign:
			holding++
		case m.deleting, m.foreign:
		case m.finished:
			p.delete = append(p.delete, m.name)
			if b.inPlace {
				holding++
			}
		default:
			active = append(active, m)
			if m.rev == rev {
				current = append(current, m)
			} else {
				old = append(old, m)
			}
		}
	}
	avail := func(ms []*member) (n int) {
		for _, m := range ms {
			ok, left := m.available(now, b.minReady)
			if ok {
				n++
			} else if left > 0 && (p.requeue == 0 || left < p.requeue) {
				p.requeue = left
			}
		}
		return n
	}
	create := func(n int) {
		for i := 0; n > 0; i++ {
			if !taken[i] {
				taken[i] = true
				p.create = append(p.create, i)
				n--
			}
		}
	}
	// remove deletes n of ms in scale-in order and returns the others.
	remove := func(ms []*member, n int) []*member {
		ms = slices.Clone(ms)
		slices.SortStableFunc(ms, func(a, c *member) int {
			if b.inPlace {
				return c.index - a.index // the highest index first, so members keep indices 0…replicas-1
			}
			return byScaleIn(a, c, rev, now, b.minReady)
		})
		n = min(n, len(ms))
		for _, m := range ms[:n] {
			p.delete = append(p.delete, m.name)
		}
		return ms[n:]
	}

	if len(old) == 0 || b.onDelete {
		avail(active)
		switch n := len(active); {
		case n+holding < b.replicas:
			create(b.replicas - n - holding)
		case n > b.replicas:
			remove(active, n-b.replicas)
		}
		return p
	}

	// A rolling update.
	if n := len(current); n > b.replicas {
		current = remove(current, n-b.replicas) // scaled in during the update
		active = append(slices.Clone(old), current...)
	}
	if n := min(b.replicas+b.maxSurge-len(active)-holding, b.replicas-len(current)); n > 0 {
		create(n)
	}
	newUnavailable := len(current) - avail(current)
	oldAvailable := avail(old)
	minAvailable := b.replicas - b.maxUnavailable
	room := len(active) - minAvailable - newUnavailable
	if room <= 0 {
		return p
	}
	// Old members that are not available first: deleting them costs no availability.
	var unhealthy, healthy []*member
	for _, m := range old {
		if ok, _ := m.available(now, b.minReady); ok {
			healthy = append(healthy, m)
		} else {
			unhealthy = append(unhealthy, m)
		}
	}
	k := min(room, len(unhealthy))
	remove(unhealthy, k)
	// Then available ones, while replicas-maxUnavailable stay available.
	available := oldAvailable + (len(current) - newUnavailable)
	if n := min(available-minAvailable, len(healthy)); n > 0 {
		remove(healthy, n)
	}
	return p
}

// byScaleIn orders members for removal (docs/pools.md): first those not placed on a node, then
// those not Ready, then those Ready for less than minReadySeconds, then those of an older
// revision; among equals the newest first (creation time, then the highest index).
func byScaleIn(a, c *member, rev string, now time.Time, minReady time.Duration) int {
	rank := func(m *member) int {
		ok, _ := m.available(now, minReady)
		switch {
		case !m.placed:
			return 0
		case !m.ready:
			return 1
		case !ok:
			return 2
		case m.rev != rev:
			return 3
		}
		return 4
	}
	if ra, rc := rank(a), rank(c); ra != rc {
		return ra - rc
	}
	if !a.created.Equal(c.created) {
		return c.created.Compare(a.created)
	}
	return c.index - a.index
}
