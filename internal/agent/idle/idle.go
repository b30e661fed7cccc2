// Package idle is the node's side of idle VMs (spec.idle; docs/suspend.md, "Idle VMs"): the
// Meter says when a VM has been idle for its suspendAfter (status.runtime.idleSince, once), for
// the operator to suspend it with reason Idle; while it is so suspended, StandIns stand in for
// it on its network (package wake) and ask for it to be woken (status.runtime.wakeRequested)
// when something arrives; the resume plan's stand_down and replay steps hand the tap back to
// its VMM and what was held to its guest.
//
// Activity is: a frame its network delivers to the VM for its MAC (the tap's in- chain counts
// them; broadcasts are not), an exec, console or port-forward session through the API while it
// is open (Sessions), and with spec.idle.outbound a frame the VM sends past its anti-spoofing
// rules. The guest channel, probes (run in the guest) and the agent's own
// traffic with the VM are not.
package idle

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Reports writes a run's idle marks (runreport.Reporter.Mark): only the fields set changes, on
// the version of the VM read (a stale read conflicts and writes nothing).
type Reports interface {
	Mark(ctx context.Context, vm *impv1.ImpVM, set func(rt *impv1.RuntimeStatus)) error
}

// Sessions counts the API sessions (exec, console, port-forward, log) open to each VM, which
// keep it from being idle.
type Sessions struct {
	mu   sync.Mutex
	open map[types.UID]int
}

// Wrap counts the sessions h serves — exec, console, port-forward; not a log read — by the VM
// UID of their path (/vms/<ns>/<name>/<uid>/<op>).
func (s *Sessions) Wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		parts := strings.Split(strings.TrimPrefix(r.URL.Path, "/"), "/")
		if len(parts) < 5 || parts[0] != "vms" || parts[4] == "log" { // a log read keeps nothing awake
			h.ServeHTTP(w, r)
			return
		}
		uid := types.UID(parts[3])
		s.mu.Lock()
		if s.open == nil {
			s.open = map[types.UID]int{}
		}
		s.open[uid]++
		s.mu.Unlock()
		defer func() {
			s.mu.Lock()
			if s.open[uid]--; s.open[uid] <= 0 {
				delete(s.open, uid)
			}
			s.mu.Unlock()
		}()
		h.ServeHTTP(w, r)
	})
}

// Open is how many sessions to the VM kept under uid are open.
func (s *Sessions) Open(uid types.UID) int {
	if s == nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.open[uid]
}

// Traffic is what a VM's tap carried (nodenet.Networks).
type Traffic interface {
	// Traffic is the frames delivered to vm (for its MAC) and sent by it, counted on its tap.
	Traffic(ctx context.Context, vm *impv1.ImpVM) (in, out uint64, err error)
}

// Meter watches the activity of the node's running VMs that have an idle policy, and reports
// each one idle once it has had none for its suspendAfter.
type Meter struct {
	Client   client.Reader // the agent's cache: the node's VMs
	Traffic  Traffic
	Sessions *Sessions
	Reports  Reports
	Clock    clock.PassiveClock
	// Interval is how often the counters are read (default 2s): a VM is reported idle at most
	// this late, and activity shorter than it between two reads is still seen (counters).
	Interval time.Duration
	Log      logr.Logger

	seen map[types.UID]*activity
}

type activity struct {
	run      string
	in, out  uint64
	last     time.Time
	reported bool
}

// Start reads the counters every Interval until ctx ends.
func (m *Meter) Start(ctx context.Context) error {
	if m.Interval <= 0 {
		m.Interval = 2 * time.Second
	}
	if m.Clock == nil {
		m.Clock = clock.RealClock{}
	}
	m.seen = map[types.UID]*activity{}
	t := time.NewTicker(m.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			m.pass(ctx)
		}
	}
}

// NeedLeaderElection: every agent meters its own node's VMs.
func (m *Meter) NeedLeaderElection() bool { return false }

func (m *Meter) pass(ctx context.Context) {
	var vms impv1.ImpVMList
	if err := m.Client.List(ctx, &vms); err != nil {
		m.Log.Error(err, "listing the node's VMs for their activity")
		return
	}
	now := m.Clock.Now()
	keep := map[types.UID]bool{}
	for i := range vms.Items {
		vm := &vms.Items[i]
		st, rt := &vm.Status, vm.Status.Runtime
		if vm.Spec.Idle == nil || rt == nil || rt.Instance != st.Instance || rt.Run != st.RestartCount || rt.State != impv1.RuntimeRunning ||
			st.Suspension != nil || impv1.WarmPoolOf(vm) != "" || !vm.DeletionTimestamp.IsZero() {
			continue
		}
		uid := vm.HostUID()
		keep[uid] = true
		var in, out uint64
		if vm.Spec.NetworkRef != nil {
			var err error
			if in, out, err = m.Traffic.Traffic(ctx, vm); err != nil {
				m.Log.V(1).Info("reading a VM's traffic", "vm", client.ObjectKeyFromObject(vm), "error", err.Error())
				continue
			}
		}
		run := fmt.Sprintf("%d.%d", st.Instance, st.RestartCount)
		a := m.seen[uid]
		if a == nil || a.run != run {
			// First seen (this run, or since the agent started): active now.
			m.seen[uid] = &activity{run: run, in: in, out: out, last: now}
			continue
		}
		active := in != a.in || (vm.Spec.Idle.Outbound && out != a.out) || m.Sessions.Open(uid) > 0
		a.in, a.out = in, out
		switch {
		case active:
			a.last = now
			if a.reported || rt.IdleSince != nil {
				if err := m.Reports.Mark(ctx, vm, func(rt *impv1.RuntimeStatus) { rt.IdleSince = nil }); err != nil {
					m.logMark(err, "reporting a VM active again", vm)
					continue
				}
				a.reported = false
			}
		case !a.reported && rt.IdleSince == nil && now.Sub(a.last) >= vm.Spec.Idle.SuspendAfter.Duration:
			since := metav1.NewTime(a.last)
			if err := m.Reports.Mark(ctx, vm, func(rt *impv1.RuntimeStatus) { rt.IdleSince = &since }); err != nil {
				m.logMark(err, "reporting a VM idle", vm)
				continue
			}
			a.reported = true
		}
	}
	for uid := range m.seen {
		if !keep[uid] {
			delete(m.seen, uid)
		}
	}
}

// logMark logs a mark not written: a conflict (the cache behind the API server) quietly, as the
// next pass writes it from the newer copy.
func (m *Meter) logMark(err error, msg string, vm *impv1.ImpVM) {
	if apierrors.IsConflict(err) {
		m.Log.V(1).Info(msg+": the VM changed, next pass", "vm", client.ObjectKeyFromObject(vm))
		return
	}
	m.Log.Error(err, msg, "vm", client.ObjectKeyFromObject(vm))
}
