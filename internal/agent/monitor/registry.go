package monitor

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/guestchan"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmmdriver"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/guestsession"
	"github.com/syscode-labs/imp/internal/tracing"
)

// Drivers give the driver of a VMM kind.
type Drivers interface {
	For(kind string) vmmdriver.Driver
	VMDir(uid types.UID) string
}

// Registry is the node's monitors, one per VM with a run followed.
type Registry struct {
	Drivers  Drivers
	Recorder events.EventRecorder
	// Report writes a run's state but its idle marks (runreport.Reporter.ReportRun); a monitor retries it.
	Report func(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error
	// EndRun removes what only an ended run needed, once its VMM is gone.
	EndRun func(uid types.UID)
	// ConsoleLogBytes caps each file a VM writes on the node.
	ConsoleLogBytes int64
	// BootTimeout bounds a guest's boot (agent.Options.BootTimeout; negative: none).
	BootTimeout time.Duration
	// Tracer, when set, records each run's guest boot as a span of its start (package tracing).
	Tracer trace.Tracer

	// mu guards byVM, for the map's operations alone: each monitor has a lock of its own.
	mu   sync.Mutex
	byVM map[types.UID]*monitor
}

// Stop stops following the VM's run, if it is, and returns once its monitor is gone.
func (r *Registry) Stop(uid types.UID) {
	r.mu.Lock()
	m := r.byVM[uid]
	delete(r.byVM, uid)
	r.mu.Unlock()
	if m != nil {
		m.cancel()
		<-m.done
	}
}

// Ensure starts following the VM's current run unless it is followed already. The monitor of
// an earlier run (which ended by itself: its workload exited) is replaced. conn, when not nil,
// is a connection to the run's guest channel to follow first (the monitor's to close); else
// the monitor connects.
func (r *Registry) Ensure(vm *impv1.ImpVM, dir string, meta *vmrun.Meta, rec *vmm.Record, conn net.Conn) {
	r.mu.Lock()
	if r.byVM == nil {
		r.byVM = map[types.UID]*monitor{}
	}
	if old, ok := r.byVM[vm.HostUID()]; ok {
		if old.instance == meta.Instance && old.run == meta.Run {
			r.mu.Unlock()
			if conn != nil {
				conn.Close()
			}
			return
		}
		r.mu.Unlock()
		r.Stop(vm.HostUID())
		r.mu.Lock()
	}
	defer r.mu.Unlock()
	if _, ok := r.byVM[vm.HostUID()]; ok {
		if conn != nil {
			conn.Close()
		}
		return // another caller started it meanwhile
	}
	ctx, cancel := context.WithCancel(context.Background())
	key := types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}
	m := &monitor{cancel: cancel, done: make(chan struct{}), token: meta.Token, key: key, instance: meta.Instance, run: meta.Run,
		pid: rec.Pid, startTime: rec.StartTime, started: meta.Started, dir: dir}
	r.byVM[vm.HostUID()] = m
	log := ctrl.Log.WithName("monitor").WithValues("vm", key)
	drv := r.Drivers.For(vmmdriver.RecKind(rec))
	if meta.Session {
		m.session = guestsession.NewClient(meta.Token, func(context.Context) (net.Conn, error) { return drv.DialSession(dir) })
	}
	m.console = &console{open: func() (vmmdriver.ConsoleWriter, error) { return drv.OpenConsole(dir) }}
	w := watch{
		dial:   func() (net.Conn, error) { return drv.Dial(dir) },
		conn:   conn,
		alive:  rec.Alive,
		exited: rec.Exited,
		report: func(ctx context.Context, rt impv1.RuntimeStatus) {
			if err := retryReport(ctx, reportBackoff, func(ctx context.Context) error {
				vm := &impv1.ImpVM{}
				vm.Namespace, vm.Name = key.Namespace, key.Name
				return r.Report(ctx, vm, rt)
			}); err != nil {
				log.Error(err, "reporting the VM's state", "state", rt.State)
			}
		},
		capLogs:     func() error { return drv.CapLogs(dir, r.ConsoleLogBytes) },
		ended:       func() { r.EndRun(meta.HostUID()) },
		tail:        func() string { return drv.LogTail(dir) },
		ready:       reportedReady(vm, meta),
		booted:      reportedBooted(vm, meta),
		bootTimeout: r.BootTimeout,
		memory:      memoryOf(vm),
		bootSpan: func(ready time.Time, boot *guestinit.Boot) {
			if r.Tracer == nil || meta.Trace == "" {
				return
			}
			tracing.GuestBoot(tracing.Remote(context.Background(), meta.Trace), r.Tracer, meta.Started, ready, boot,
				attribute.String("k8s.namespace.name", key.Namespace), attribute.String("imp.vm.name", key.Name),
				attribute.String("imp.vm.uid", string(meta.UID)))
		},
		kill: func() {
			vm := &impv1.ImpVM{}
			vm.Namespace, vm.Name, vm.UID = key.Namespace, key.Name, meta.UID
			r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, impv1.ReasonBootTimeout, "Kill",
				"The guest was not ready %v after its VMM started; its VMM is ended (its console: kubectl imp logs)", r.BootTimeout)
			if rec.Alive() {
				_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
			}
		},
		unhealthy: func(ev guestchan.Event) {
			vm := &impv1.ImpVM{}
			vm.Namespace, vm.Name, vm.UID = key.Namespace, key.Name, meta.UID
			r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "Unhealthy", "Kill",
				"The %s probe failed, so the guest kills the workload: %s", ev.Probe, ev.Message)
		},
	}
	go func() {
		defer close(m.done)
		defer m.console.end()
		if m.session != nil {
			defer m.session.Close()
		}
		m.follow(ctx, w, meta, log)
	}()
}

// ErrNotRunning: the VM has no run this agent follows.
var ErrNotRunning = errors.New("the VM is not running on this node")

// running is the monitor of the run of the VM key with uid, or ErrNotRunning: the UID alone
// never reaches another VM's run.
func (r *Registry) running(key types.NamespacedName, uid types.UID) (*monitor, error) {
	r.mu.Lock()
	m := r.byVM[uid]
	r.mu.Unlock()
	if m == nil || m.key != key {
		return nil, ErrNotRunning
	}
	return m, nil
}

// RequestStop asks the guest of the VM's followed run to stop its workload; it says whether
// the request went out.
func (r *Registry) RequestStop(uid types.UID) bool {
	r.mu.Lock()
	m := r.byVM[uid]
	r.mu.Unlock()
	return m != nil && m.requestStop()
}

// Freeze has the guest of the VM key's followed run freeze its workload, for a snapshot or a
// suspension, and returns what thaws it (owed whatever the error); ErrNotRunning without a
// followed run (the caller's Event says why the workload is not frozen only when it has one).
func (r *Registry) Freeze(key types.NamespacedName, uid types.UID) (thaw func(), err error) {
	m, err := r.running(key, uid)
	if err != nil {
		return func() {}, err
	}
	return m.thaw, m.freeze(freezeTimeout)
}

// Session is the session channel (exec, port-forward) of the running VM key with uid.
func (r *Registry) Session(key types.NamespacedName, uid types.UID) (*guestsession.Client, error) {
	m, err := r.running(key, uid)
	if err != nil {
		return nil, err
	}
	if m.session == nil {
		return nil, errors.New("this run of the VM has no session channel: an agent before exec started it; restart the VM")
	}
	return m.session, nil
}

// ConsoleInput attaches to the serial console's input of the running VM key with uid: what is
// written reaches the guest (the workload, when the ImpVM has stdin). ended is closed when the
// run ends. Close the input to detach.
func (r *Registry) ConsoleInput(key types.NamespacedName, uid types.UID) (io.WriteCloser, <-chan struct{}, error) {
	m, err := r.running(key, uid)
	if err != nil {
		return nil, nil, err
	}
	m.console.attach()
	return &consoleInput{c: m.console}, m.done, nil
}

// ConsoleLog opens the console log of the VM key with uid, running or finished on this node.
func (r *Registry) ConsoleLog(key types.NamespacedName, uid types.UID) (*os.File, error) {
	dir := r.Drivers.VMDir(uid)
	m, err := vmrun.ReadMeta(dir)
	if err != nil || m.Namespace != key.Namespace || m.Name != key.Name {
		return nil, ErrNotRunning
	}
	return r.Drivers.For(string(m.VMM)).ConsoleLog(dir)
}

// memoryOf is the VM's memory as placed, in bytes (0 when its status does not say).
func memoryOf(vm *impv1.ImpVM) uint64 {
	if r := vm.Status.Resources; r != nil && r.Memory.Sign() > 0 {
		return uint64(r.Memory.Value())
	}
	return 0
}

// Followed is a run the node follows, for the VMs' figures (package vmstats).
type Followed struct {
	Key types.NamespacedName
	// UID is the VM's host UID (its state directory's name).
	UID types.UID
	// Pid and StartTime are its VMM's (its record's: a pid reused by another process is not
	// its VMM); Started is when the run started; Dir is its state directory.
	Pid       int
	StartTime uint64
	Started   time.Time
	Dir       string
	// Guest is what its guest last said of itself (nil: nothing yet).
	Guest *GuestStats
}

// Followed lists the runs followed now whose VMM has not ended.
func (r *Registry) Followed() []Followed {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Followed, 0, len(r.byVM))
	for uid, m := range r.byVM {
		select {
		case <-m.done:
			continue // its run ended by itself: kept until replaced, measured no more
		default:
		}
		out = append(out, Followed{Key: m.key, UID: uid, Pid: m.pid, StartTime: m.startTime, Started: m.started, Dir: m.dir, Guest: m.guest.Load()})
	}
	return out
}
