package impvmpool

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// world simulates a pool's members under planFor: a created member is placed at once and
// Ready one step later; a deleted one is gone one step later.
type world struct {
	members []member
	now     time.Time
	// linger: how many more steps a deleted member stays (being deleted, as a VM whose VMM
	// stops), by name.
	linger  map[string]int
	lingers int
}

func (w *world) step(t *testing.T, b bounds, rev string) plan {
	t.Helper()
	w.now = w.now.Add(time.Second)
	// Last step's deletions finish and creations become Ready.
	kept := w.members[:0]
	for _, m := range w.members {
		if m.deleting {
			if w.linger[m.name] > 0 {
				w.linger[m.name]--
				kept = append(kept, m)
			}
			continue
		}
		if !m.ready {
			m.ready, m.readySince, m.placed = true, w.now, true
		}
		kept = append(kept, m)
	}
	w.members = kept
	p := planFor(b, rev, slices.Clone(w.members), w.now)
	for i := range w.members {
		if slices.Contains(p.delete, w.members[i].name) && !w.members[i].deleting {
			w.members[i].deleting = true
			if w.linger == nil {
				w.linger = map[string]int{}
			}
			w.linger[w.members[i].name] = w.lingers
		}
	}
	for _, idx := range p.create {
		for _, m := range w.members {
			if m.index == idx {
				t.Fatalf("index %d created twice", idx)
			}
		}
		w.members = append(w.members, member{name: fmt.Sprint("m-", idx), index: idx, rev: rev, created: w.now})
	}
	return p
}

func (w *world) count(rev string) (ready, all, ofRev int) {
	for _, m := range w.members {
		if m.deleting {
			continue
		}
		all++
		if m.ready {
			ready++
		}
		if m.rev == rev {
			ofRev++
		}
	}
	return
}

// TestRollingUpdateBounds: a rolling update keeps replicas-maxUnavailable members Ready and at
// most replicas+maxSurge members at every step, and ends with replicas members of the new
// revision, for several bounds.
func TestRollingUpdateBounds(t *testing.T) {
	for _, b := range []bounds{
		{replicas: 5, maxSurge: 0, maxUnavailable: 1},
		{replicas: 5, maxSurge: 2, maxUnavailable: 0},
		{replicas: 5, maxSurge: 1, maxUnavailable: 1},
		{replicas: 3, maxSurge: 0, maxUnavailable: 3},
		{replicas: 1, maxSurge: 1, maxUnavailable: 0},
	} {
		for _, lingers := range []int{0, 2} {
			t.Run(fmt.Sprintf("%+v lingering %d", b, lingers), func(t *testing.T) {
				w := &world{now: time.Unix(1e9, 0), lingers: lingers}
				for w.step(t, b, "a"); ; {
					if r, _, _ := w.count("a"); r == b.replicas {
						break
					}
					w.step(t, b, "a")
				}
				for i := 0; i < 50; i++ {
					w.step(t, b, "b")
					ready, all, ofRev := w.count("b")
					if ready < b.replicas-b.maxUnavailable {
						t.Fatalf("step %d: %d Ready, fewer than %d", i, ready, b.replicas-b.maxUnavailable)
					}
					if all > b.replicas+b.maxSurge {
						t.Fatalf("step %d: %d members, more than %d", i, all, b.replicas+b.maxSurge)
					}
					if ready == b.replicas && all == b.replicas && ofRev == b.replicas {
						return
					}
				}
				t.Fatalf("the update did not finish: %+v", w.members)
			})
		}
	}
}

// TestScaleInOrder: scale-in takes members not placed, then not Ready, then not yet available,
// then of an old revision, then the newest.
func TestScaleInOrder(t *testing.T) {
	now := time.Unix(1e9, 0)
	at := func(s int) time.Time { return now.Add(time.Duration(s) * time.Second) }
	members := []member{
		{name: "old-ready", index: 0, rev: "a", created: at(-100), placed: true, ready: true, readySince: at(-90)},
		{name: "new-ready-1", index: 1, rev: "b", created: at(-50), placed: true, ready: true, readySince: at(-40)},
		{name: "new-ready-2", index: 2, rev: "b", created: at(-40), placed: true, ready: true, readySince: at(-30)},
		{name: "unplaced", index: 3, rev: "b", created: at(-200)},
		{name: "not-ready", index: 4, rev: "b", created: at(-300), placed: true},
		{name: "just-ready", index: 5, rev: "b", created: at(-20), placed: true, ready: true, readySince: at(-1)},
	}
	b := bounds{replicas: 0, onDelete: true, minReady: 10 * time.Second}
	p := planFor(b, "b", members, now)
	want := []string{"unplaced", "not-ready", "just-ready", "old-ready", "new-ready-2", "new-ready-1"}
	if !slices.Equal(p.delete, want) {
		t.Fatalf("scale-in order %v, want %v", p.delete, want)
	}
	for n := range 6 {
		b.replicas = 6 - n
		if got := planFor(b, "b", members, now).delete; !slices.Equal(got, want[:n]) {
			t.Errorf("to %d: %v, want %v", b.replicas, got, want[:n])
		}
	}
	if p.requeue != 9*time.Second {
		t.Errorf("requeue %v, want when just-ready becomes available (9s)", p.requeue)
	}
}

// TestLowestFreeIndices: new members take the lowest indices no member holds, a member being
// deleted included; finished members are deleted and replaced.
func TestLowestFreeIndices(t *testing.T) {
	members := []member{
		{name: "p-0", index: 0, rev: "a", placed: true, ready: true},
		{name: "p-2", index: 2, rev: "a", deleting: true},
		{name: "p-3", index: 3, rev: "a", placed: true, finished: true},
	}
	p := planFor(bounds{replicas: 3, maxUnavailable: 1}, "a", members, time.Unix(1e9, 0))
	if !slices.Equal(p.create, []int{1, 4}) || !slices.Equal(p.delete, []string{"p-3"}) {
		t.Fatalf("create %v delete %v, want create [1 4] delete [p-3]", p.create, p.delete)
	}
}

// TestInPlaceUpdate: with claims of their own (inPlace), members are replaced at their own
// index once the old one is gone: never more VMs than replicas, deleting ones included; the
// update ends with members 0…replicas-1 of the new revision.
func TestInPlaceUpdate(t *testing.T) {
	b := bounds{replicas: 3, maxUnavailable: 1, inPlace: true}
	w := &world{now: time.Unix(1e9, 0), lingers: 2}
	for range 5 {
		w.step(t, b, "a")
	}
	for i := 0; i < 50; i++ {
		w.step(t, b, "b")
		if len(w.members) > b.replicas {
			t.Fatalf("step %d: %d VMs (deleting included), more than %d", i, len(w.members), b.replicas)
		}
		if ready, all, ofRev := w.count("b"); ready == 3 && all == 3 && ofRev == 3 {
			var idx []int
			for _, m := range w.members {
				idx = append(idx, m.index)
			}
			slices.Sort(idx)
			if !slices.Equal(idx, []int{0, 1, 2}) {
				t.Fatalf("indices %v after the update, want [0 1 2]", idx)
			}
			return
		}
	}
	t.Fatalf("the update did not finish: %+v", w.members)
}
