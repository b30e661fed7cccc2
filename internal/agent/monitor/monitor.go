// Package monitor follows the runs of a node's VMs: for each run, its guest channel (a
// guestchan.Session: only what the guest says with its run's token counts), its VMM process,
// its console input and session channel, and what it learns is reported as status.runtime, with
// retries. A Registry holds the node's monitors, one per VM, under its own lock; the agent asks
// it to follow a run, to stop following, to have a guest stop or freeze its workload, and it
// serves exec and the console to the access server.
package monitor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/guestchan"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/guestinit/probe"
	"github.com/syscode-labs/imp/internal/guestsession"
)

// monitor follows one run of a VM: the guest channel's messages and the VMM process, reported
// as status.runtime. Its lifetime is the agent's, never a request's.
type monitor struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu    sync.Mutex
	conn  net.Conn
	token string

	// key and session: the VM, and its session channel (nil for a run without one).
	key types.NamespacedName
	// instance and run: the run followed.
	instance int64
	run      int32
	session  *guestsession.Client
	// console is the serial console's input.
	console *console
	// stopping: the run is being stopped (its guest asked to); a boot timeout no longer ends it.
	stopping bool
	// greeted: the guest said its hello with the token on this connection; freezes: it offered
	// to freeze its workload. holding: a snapshot holds the workload frozen (a connection made
	// meanwhile does not thaw it); frozen, when not nil, is closed when the guest says it froze
	// it.
	greeted atomic.Bool
	freezes atomic.Bool
	// guest is the guest's last figures (a Stats event), nil until it says any; pid and dir
	// are its VMM's and its state directory, for the node's side of its figures.
	guest     atomic.Pointer[GuestStats]
	pid       int
	startTime uint64
	started   time.Time
	dir       string
	holding   bool
	frozen    chan struct{}
}

// requestStop asks the guest to stop its workload; it says whether the request went out (the
// channel may not be connected yet).
func (m *monitor) requestStop() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.stopping = true
	return m.request("stop")
}

// request writes op to the guest channel, if connected; the caller holds m.mu.
func (m *monitor) request(op string) bool {
	if m.conn == nil {
		return false
	}
	line, _ := json.Marshal(guestinit.Request{Op: op, Token: m.token})
	_ = m.conn.SetWriteDeadline(time.Now().Add(time.Second)) // a guest that reads nothing stalls no one
	_, err := m.conn.Write(append(line, '\n'))
	_ = m.conn.SetWriteDeadline(time.Time{})
	return err == nil
}

var workloadFreezeSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
	Name: "imp_agent_workload_freeze_seconds", Help: "Time from asking a guest to freeze its workload (for a snapshot or a suspension) to its saying it did.",
	Buckets: prometheus.ExponentialBuckets(0.001, 2, 12)})

func init() { metrics.Registry.MustRegister(workloadFreezeSeconds) }

// freezeTimeout bounds how long a snapshot or a suspension waits for the guest to freeze its
// workload (imp-init gives up after a second itself).
const freezeTimeout = 2 * time.Second

// errCannotFreeze: the guest did not offer to freeze its workload (an imp-init before it, or a
// kernel without a cgroup for it), or said no hello yet.
var errCannotFreeze = errors.New("the guest does not offer to freeze its workload (an imp-init older than the freeze, or no cgroup for it)")

// freeze asks the guest to freeze its workload, for a snapshot of it, and waits up to timeout
// for it to say it did. The workload stays frozen, over reconnections, until thaw, which the
// caller owes whatever freeze returned; the next run's monitor thaws it too (a suspension's
// resume, an agent's restart).
func (m *monitor) freeze(timeout time.Duration) error {
	// A monitor that just connected (an agent's restart) may not have the hello yet.
	for deadline := time.Now().Add(timeout / 2); !m.greeted.Load() && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	m.mu.Lock()
	if !m.freezes.Load() {
		m.mu.Unlock()
		return errCannotFreeze
	}
	done := make(chan struct{})
	m.holding, m.frozen = true, done
	asked := time.Now()
	sent := m.request("freeze")
	m.mu.Unlock()
	if !sent {
		return errors.New("the guest channel is not connected")
	}
	select {
	case <-done:
		workloadFreezeSeconds.Observe(time.Since(asked).Seconds())
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("the guest did not say it froze its workload within %v", timeout)
	}
}

// thaw lets the workload run again.
func (m *monitor) thaw() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.holding, m.frozen = false, nil
	m.request("thaw")
}

// guestFroze takes the guest's word that its workload is frozen, if a freeze waits for it.
func (m *monitor) guestFroze() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.frozen != nil {
		close(m.frozen)
		m.frozen = nil
	}
}

// reportedReady is the readiness verdict vm's status holds for the run of meta, if any.
func reportedReady(vm *impv1.ImpVM, meta *vmrun.Meta) *bool {
	if reportedBooted(vm, meta) {
		return vm.Status.Runtime.Ready
	}
	return nil
}

// reportBackoff spaces the attempts of a run's report: under a minute in all. A report lost to
// an API server that did not answer (a guest's ready, its end) is written by nothing else.
var reportBackoff = wait.Backoff{Duration: 100 * time.Millisecond, Factor: 2, Cap: 5 * time.Second, Steps: 16}

// retryReport tries report until it succeeds, fails for good (a refusal: the write is not the
// agent's to make, as of a VM placed elsewhere), or b's steps are spent; it returns the last
// error.
func retryReport(ctx context.Context, b wait.Backoff, report func(context.Context) error) error {
	var last error
	err := wait.ExponentialBackoffWithContext(ctx, b, func(ctx context.Context) (bool, error) {
		last = report(ctx)
		return last == nil || refused(last), nil
	})
	if last != nil {
		return last
	}
	return err
}

// refused: the API server answered, and no: trying again gets the same answer.
func refused(err error) bool {
	return apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) || apierrors.IsInvalid(err) || apierrors.IsBadRequest(err) || apierrors.IsNotFound(err)
}

// reportedBooted says whether vm's status has the run of meta's guest ready.
func reportedBooted(vm *impv1.ImpVM, meta *vmrun.Meta) bool {
	rt := vm.Status.Runtime
	return rt != nil && rt.Instance == meta.Instance && rt.Run == meta.Run && rt.GuestReady
}

// watch is what a monitor follows of a run: how to reach its guest channel, whether its VMM
// lives, and what to do with what it learns.
type watch struct {
	dial func() (net.Conn, error)
	// conn, when not nil, is a connection to the guest channel to follow before dialing.
	conn  net.Conn
	alive func() bool
	// exited, when not nil, is the VMM's end as the kernel tells it (vmm.Record.Exited).
	exited  func(context.Context) <-chan struct{}
	report  func(context.Context, impv1.RuntimeStatus)
	capLogs func() error
	ended   func()
	tail    func() string
	// unhealthy records a startup or liveness probe's failure (an Event).
	unhealthy func(guestchan.Event)
	// ready is the run's readiness verdict as last reported, when it is followed again.
	ready *bool
	// booted: the run's guest was reported ready before (it is followed again).
	booted bool
	// bootTimeout bounds how long a guest not yet ready may take to say so (0: no bound);
	// kill ends a VMM whose guest does not.
	bootTimeout time.Duration
	kill        func()
	// bootSpan records the run's guest boot, from its VMM's start to ready, and its phases as
	// the guest says them (spans).
	bootSpan func(ready time.Time, boot *guestinit.Boot)
	// memory is the VM's memory in bytes (0: unknown): a guest saying it has more is not
	// believed.
	memory uint64
}

// GuestStats are a guest's own figures as it last said them, and when.
type GuestStats struct {
	guestinit.Stats
	At time.Time
}

// aliveBackstop is how often a run whose VMM's end the kernel tells (watch.exited) is also
// checked by its record, should that tell nothing.
const aliveBackstop = 5 * time.Second

// probeReportInterval bounds how often a run's readiness reaches the API server, whatever
// its guest reports.
const probeReportInterval = 500 * time.Millisecond

// follow reports the run's state until its VMM is gone (or ctx ends): Running once the guest
// says ready, then how it ended. Everything the guest sends goes through a guestchan.Session;
// the console and the VMM's logs are capped on a ticker of their own, whatever the channel does.
func (m *monitor) follow(ctx context.Context, w watch, meta *vmrun.Meta, log logr.Logger) {
	base := meta.Status()
	started := metav1.NewTime(meta.Started)
	base.StartedAt = &started
	ctx, stop := context.WithCancel(ctx)
	defer stop()

	go func() {
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				if err := w.capLogs(); err != nil {
					log.Error(err, "capping the VM's logs")
				}
			}
		}
	}()

	events := make(chan guestchan.Event, 16)
	go func() {
		defer close(events)
		sess := guestchan.NewSession(meta.Token)
		first := w.conn
		defer func() {
			if first != nil {
				first.Close()
			}
		}()
		for ctx.Err() == nil && w.alive() {
			conn, err := first, error(nil)
			first = nil
			if conn == nil {
				conn, err = w.dial()
			}
			if err != nil {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			// Asked for the history: a guest may not have seen this connection come (one
			// that followed another at once, as after a restore's). A restore's connection
			// may have it coming already.
			if a, ok := conn.(*guestchan.Answered); !ok || !a.Replayed {
				replay, _ := json.Marshal(guestinit.Request{Op: "replay", Token: meta.Token})
				_, _ = conn.Write(append(replay, '\n'))
			}
			m.greeted.Store(false) // until this connection's hello
			m.mu.Lock()
			m.conn = conn
			if !m.holding {
				// A workload a snapshot or a suspension left frozen (its agent stopped before
				// thawing it; the VM resumed) runs again.
				m.request("thaw")
			}
			m.mu.Unlock()
			closed := make(chan struct{})
			go func() {
				select {
				case <-ctx.Done():
				case <-closed:
				}
				conn.Close()
			}()
			_ = guestchan.ReadLines(conn, func(line []byte) {
				before := sess.Ignored
				ev := sess.Feed(line)
				m.greeted.Store(sess.Trusted())
				m.freezes.Store(sess.Freezes)
				if ev.Kind == guestchan.Frozen {
					m.guestFroze() // here, not behind the reports the loop below may be retrying
					return
				}
				if ev.Kind != guestchan.None {
					select {
					case events <- ev:
					case <-ctx.Done(): // nobody reads them any more
					}
				}
				// Logged at the 1st, 2nd, 4th, 8th… so a flood costs a few lines.
				if n := sess.Ignored; n > before && n&(n-1) == 0 {
					log.Info("ignoring the guest channel's messages", "why", sess.Why, "ignored", n)
				}
			})
			close(closed)
			m.mu.Lock()
			m.conn = nil
			m.mu.Unlock()
			time.Sleep(100 * time.Millisecond) // the guest closed its end; it may open it again
		}
	}()

	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	var end *guestchan.Event
	var killed *guestchan.Event // a startup or liveness probe failed: the guest kills the workload
	// running is the run's report once the guest is ready; readiness verdicts change its
	// ready and are reported at most every probeReportInterval, the latest winning.
	var running *impv1.RuntimeStatus
	var pending <-chan time.Time
	var lastReport time.Time
	// Reports are tried on the monitor's context: a stop of the monitor (a halt, a suspension,
	// a teardown, the next run), whose caller writes what follows itself, ends one being
	// tried, rather than waiting out its retries while the API server does not answer.
	reportRunning := func() {
		pending, lastReport = nil, time.Now()
		w.report(ctx, *running)
	}
	// A guest that is not ready within the boot timeout will not be: its kernel or imp-init
	// hangs (a stalled boot prints nothing and reports nothing). Its VMM is ended, and the run
	// with it, for the VM's runStrategy to decide about the next.
	var bootDeadline <-chan time.Time
	var bootTimedOut bool
	if !w.booted && w.bootTimeout > 0 {
		t := time.NewTimer(w.bootTimeout)
		defer t.Stop()
		bootDeadline = t.C
	}
	// finish reports how the run ended, once its VMM has.
	finish := func() {
		// The guest's last words may still be in the channel: read it to its end.
		drain := time.After(2 * time.Second)
	drained:
		for events != nil {
			select {
			case ev, ok := <-events:
				if !ok {
					break drained
				}
				switch {
				case ev.Kind == guestchan.Exit || ev.Kind == guestchan.Error:
					end = &ev
				case ev.Kind == guestchan.Probe && !ev.OK && ev.Probe != probe.Readiness:
					killed = &ev
					w.unhealthy(ev)
				}
			case <-drain:
				break drained
			}
		}
		w.ended()
		rt := base
		now := metav1.Now()
		rt.State, rt.FinishedAt = impv1.RuntimeExited, &now
		switch {
		case killed != nil:
			rt.Reason, rt.Message = impv1.ReasonLivenessProbeFailed, fmt.Sprintf("the %s probe failed: %s", killed.Probe, killed.Message)
			if end != nil && end.Kind == guestchan.Exit {
				code := end.Code
				rt.ExitCode = &code
			}
		case end != nil && end.Kind == guestchan.Exit:
			code := end.Code
			rt.ExitCode, rt.Reason, rt.Message = &code, "WorkloadExited", "the workload exited"
		case end != nil:
			rt.Reason, rt.Message = "GuestError", end.Message
		case bootTimedOut:
			rt.Reason = impv1.ReasonBootTimeout
			rt.Message = fmt.Sprintf("the guest was not ready %v after its VMM started (its console: kubectl imp logs); the VMM was ended", w.bootTimeout)
		default:
			rt.Reason, rt.Message = "VMMExited", "the VMM exited without the guest reporting an exit"
			if tail := w.tail(); tail != "" {
				rt.Message += ": " + guestchan.Sanitize(tail) // the VMM's log holds what its guest made it say
			}
		}
		w.report(ctx, rt)
	}
	// The VMM's end, from the kernel where it can say: then the ticker only backs it up, and
	// a VM that runs costs its monitor no read of /proc four times a second.
	var exited <-chan struct{}
	if w.exited != nil {
		exited = w.exited(ctx)
	}
	if exited != nil {
		tick.Reset(aliveBackstop)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-bootDeadline:
			bootDeadline = nil
			m.mu.Lock()
			stopping := m.stopping
			m.mu.Unlock()
			if running != nil || stopping {
				continue // ready, or its stop ends it
			}
			bootTimedOut = true
			log.Info("the guest did not become ready in time; ending its VMM", "bootTimeout", w.bootTimeout)
			w.kill()
		case <-pending:
			reportRunning()
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			switch ev.Kind {
			case guestchan.Ready:
				bootDeadline = nil
				rt := base
				boot := time.Since(meta.Started).Milliseconds()
				if !w.booted && running == nil && w.bootSpan != nil {
					w.bootSpan(time.Now(), ev.Boot)
				}
				rt.State, rt.GuestReady, rt.BootMilliseconds, rt.Message = impv1.RuntimeRunning, true, &boot, "the guest is ready"
				switch {
				case meta.Readiness && w.ready != nil && *w.ready:
					// Followed again (an agent restart): the run's verdict as last reported
					// stands until the guest's replay of it, so its endpoints do not flap.
					rt.Ready, rt.Message = ptr.To(true), "the readiness probe passes"
				case meta.Readiness:
					rt.Ready, rt.Message = ptr.To(false), "the guest is ready; its readiness probe has not passed yet"
				}
				running = &rt
				reportRunning()
			case guestchan.Stats:
				// At most one a second counts, and only what the VM's memory can hold: the
				// guest's word, for its own VM's series only.
				if last := m.guest.Load(); (last != nil && time.Since(last.At) < time.Second) ||
					(w.memory > 0 && ev.Stats.MemoryTotal > w.memory) {
					continue
				}
				m.guest.Store(&GuestStats{Stats: ev.Stats, At: time.Now()})
			case guestchan.Probe:
				switch {
				case running == nil:
				case ev.Probe == probe.Readiness && meta.Readiness:
					if running.Ready != nil && *running.Ready == ev.OK {
						continue
					}
					running.Ready, running.Message = ptr.To(ev.OK), "the readiness probe passes"
					if !ev.OK {
						running.Message = "the readiness probe fails: " + ev.Message
					}
					if wait := probeReportInterval - time.Since(lastReport); wait > 0 {
						if pending == nil {
							pending = time.After(wait)
						}
						continue
					}
					reportRunning()
				case !ev.OK && ev.Probe != probe.Readiness:
					killed = &ev
					w.unhealthy(ev)
				}
			case guestchan.Exit, guestchan.Error:
				end = &ev
			}
		case <-exited:
			finish()
			return
		case <-tick.C:
			if w.alive() {
				continue
			}
			finish()
			return
		}
	}
}
