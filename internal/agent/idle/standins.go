package idle

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/agent/wake"
	"github.com/syscode-labs/imp/internal/guestinit"
)

var wakeSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
	Name:    "imp_agent_vm_wake_duration_seconds",
	Help:    "Time from the first frame held for an idle-suspended VM to what was held sent to its guest, running again.",
	Buckets: prometheus.ExponentialBuckets(0.025, 2, 10)})

// wakeFrames counts the frames that arrived for idle-suspended VMs by their fate: replayed to
// the guest once it ran again, dropped over the stand-in's limits (a flood: docs/security.md),
// refused (the VM could not be woken), or discarded with a VM that went or failed to resume.
var wakeFrames = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "imp_agent_wake_frames_total",
	Help: "Frames that arrived for idle-suspended VMs, by fate: replayed to the woken guest, dropped over the limits of what is held, refused, or discarded with the VM."},
	[]string{"fate"})

func countFrames(fate string, n int) { wakeFrames.WithLabelValues(fate).Add(float64(n)) }

func init() { metrics.Registry.MustRegister(wakeSeconds, wakeFrames) }

// Taps opens a suspended VM's tap (nodenet.Tapping).
type Taps interface {
	Attach(ctx context.Context, vm *impv1.ImpVM) (hostnet.Attachment, *guestinit.Net, error)
}

// StandIns are what stands in for each idle-suspended VM of the node on its network.
type StandIns struct {
	Taps     Taps
	API      client.Reader // what the API server says now (a wake is asked on it, never on a cache)
	Reports  Reports
	Recorder events.EventRecorder
	Limits   wake.Limits
	// Bound is how long what is held waits for the VM to be woken before it is refused.
	Bound time.Duration
	// Retry is how long after a refusal what arrives is held again, and may wake the VM
	// (default 10s).
	Retry time.Duration
	// MemAvailable is the node's memory available for a VM to be woken into (default:
	// /proc/meminfo's MemAvailable): a VM that would not fit is not woken.
	MemAvailable func() (int64, error)
	Log          logr.Logger

	mu      sync.Mutex
	by      map[types.UID]*standing
	replays map[types.UID]replay
}

type standing struct {
	in     *wake.StandIn
	to     wake.Tap
	key    types.NamespacedName
	refuse *time.Timer
	asked  time.Time // when the first frame held asked for a wake
}

type replay struct {
	frames [][]byte
	to     wake.Tap
	asked  time.Time
}

// Suspended is true for a VM suspended because it was idle, its VMM gone, on a network: what
// stands in for it holds what arrives.
func Suspended(vm *impv1.ImpVM) bool {
	sp, rt := vm.Status.Suspension, vm.Status.Runtime
	return sp != nil && sp.Reason == impv1.SuspendReasonIdle && vm.Spec.NetworkRef != nil && rt != nil &&
		rt.Instance == vm.Status.Instance && rt.Run == vm.Status.RestartCount && rt.State == impv1.RuntimeSuspended
}

// Ensure stands in for vm (Suspended) unless something already does.
func (s *StandIns) Ensure(ctx context.Context, vm *impv1.ImpVM) error {
	uid := vm.HostUID()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.by[uid] != nil {
		return nil
	}
	at, _, err := s.Taps.Attach(ctx, vm)
	if err != nil {
		return fmt.Errorf("standing in for idle VM %s: %w", vm.Name, err)
	}
	hdr, err := wake.VnetHdrLen(at.Tap)
	if err != nil {
		at.Tap.Close()
		return fmt.Errorf("standing in for idle VM %s: %w", vm.Name, err)
	}
	key := client.ObjectKeyFromObject(vm)
	st := &standing{to: wake.Tap{NetNS: at.NetNS, Name: hostnet.TapName(string(uid))}, key: key}
	lim := s.Limits
	lim.Counted = countFrames
	st.in = wake.Stand(at.Tap, hdr, at.IP, hostnet.MAC(at.IP), lim, func() { s.wake(uid, key) })
	if s.by == nil {
		s.by, s.replays = map[types.UID]*standing{}, map[types.UID]replay{}
	}
	s.by[uid] = st
	return nil
}

// wake asks for the VM to be woken (its run's report says wakeRequested), and refuses what is
// held if it is not woken within the bound.
func (s *StandIns) wake(uid types.UID, key types.NamespacedName) {
	s.mu.Lock()
	st := s.by[uid]
	if st == nil {
		s.mu.Unlock()
		return
	}
	if st.asked.IsZero() { // the first frame's, not a later one after a refusal's rearm
		st.asked = time.Now()
	}
	st.refuse = time.AfterFunc(s.Bound, func() { s.refuse(uid, fmt.Sprintf("it did not run again within %v", s.Bound)) })
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Read as the API server has it (the cache may lag a resume), marked on that version: a VM
	// changed meanwhile is read again.
	for range 3 {
		vm := &impv1.ImpVM{}
		if err := s.API.Get(ctx, key, vm); err != nil || !Suspended(vm) || vm.HostUID() != uid {
			return
		}
		if why := s.room(vm); why != "" {
			// It would not fit: its state stays for a later resume, and its clients are told now.
			err := s.Reports.Mark(ctx, vm, func(rt *impv1.RuntimeStatus) { rt.Message = "not woken: " + why })
			if apierrors.IsConflict(err) {
				continue
			}
			if err != nil {
				s.Log.Error(err, "reporting an idle VM not woken", "vm", key)
			}
			s.refuse(uid, why)
			return
		}
		now := metav1.Now()
		err := s.Reports.Mark(ctx, vm, func(rt *impv1.RuntimeStatus) { rt.WakeRequested = &now })
		if apierrors.IsConflict(err) {
			continue
		}
		if err != nil {
			s.Log.Error(err, "asking for an idle VM to be woken", "vm", key)
		}
		return
	}
	s.Log.Info("asking for an idle VM to be woken: it kept changing; the next frame asks again", "vm", key)
}

// room says why the node has no room to wake vm into, or "".
func (s *StandIns) room(vm *impv1.ImpVM) string {
	res := vm.Status.Resources
	if res == nil {
		return ""
	}
	need := res.Memory.Value()
	if res.MemoryOverhead != nil {
		need += res.MemoryOverhead.Value()
	}
	avail, err := s.memAvailable()
	if err != nil || avail >= need {
		return ""
	}
	return fmt.Sprintf("node has %d MiB of memory available, the VM needs %d MiB", avail>>20, need>>20)
}

func (s *StandIns) memAvailable() (int64, error) {
	if s.MemAvailable != nil {
		return s.MemAvailable()
	}
	return MemAvailable()
}

// MemAvailable is /proc/meminfo's MemAvailable, in bytes.
func MemAvailable() (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "MemAvailable:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no MemAvailable in /proc/meminfo")
}

// refuse refuses what the stand-in of uid holds, and what arrives for Retry, when the VM was
// not woken (why); after Retry what arrives may wake it again.
func (s *StandIns) refuse(uid types.UID, why string) {
	s.mu.Lock()
	st := s.by[uid]
	if st != nil && st.refuse != nil {
		st.refuse.Stop()
	}
	s.mu.Unlock()
	if st == nil {
		return
	}
	retry := s.Retry
	if retry <= 0 {
		retry = 10 * time.Second
	}
	// Said before its clients are told: whoever sees the refusal finds why.
	vm := &impv1.ImpVM{}
	if err := s.API.Get(context.Background(), st.key, vm); err == nil {
		s.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "WakeFailed", "Resume",
			"The idle VM was not woken (%s): what arrives for it is refused for %v, then may wake it again; its state stays on node for a resume", why, retry)
	}
	st.in.Refuse()
	time.AfterFunc(retry, st.in.Rearm)
}

// Down stops standing in for the VM kept under uid, if anything does, and keeps what was held
// for Replay once its VMM holds the tap again.
func (s *StandIns) Down(uid types.UID) bool {
	s.mu.Lock()
	st := s.by[uid]
	delete(s.by, uid)
	s.mu.Unlock()
	if st == nil {
		return false
	}
	if st.refuse != nil {
		st.refuse.Stop()
	}
	frames := st.in.Stop()
	s.mu.Lock()
	s.replays[uid] = replay{frames: frames, to: st.to, asked: st.asked}
	s.mu.Unlock()
	return true
}

// Drop stops standing in for the VM kept under uid and forgets what was held: the VM is going,
// starts a new run, stops, or its resume failed.
func (s *StandIns) Drop(uid types.UID) {
	s.Down(uid)
	s.mu.Lock()
	countFrames("discarded", len(s.replays[uid].frames))
	delete(s.replays, uid)
	s.mu.Unlock()
}

// Standing is true while something stands in for the VM kept under uid.
func (s *StandIns) Standing(uid types.UID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.by[uid] != nil
}

// replay sends what was held for the VM kept under uid onto its bridge, once.
func (s *StandIns) replay(uid types.UID) (int, error) {
	s.mu.Lock()
	r, ok := s.replays[uid]
	delete(s.replays, uid)
	s.mu.Unlock()
	if !ok {
		return 0, nil
	}
	err := r.to.Replay(r.frames)
	if err == nil {
		countFrames("replayed", len(r.frames))
	} else {
		countFrames("discarded", len(r.frames))
	}
	if !r.asked.IsZero() {
		wakeSeconds.Observe(time.Since(r.asked).Seconds())
	}
	return len(r.frames), err
}

// StandDown is the resume plan's first step for a VM on a network: what stood in for it lets
// go of its tap, for its VMM to open, and keeps what it held for Replay.
type StandDown struct{ StandIns *StandIns }

func (StandDown) Name() string { return "stand_down" }

func (s StandDown) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return s.StandIns.Standing(r.VM.HostUID()), nil
}

func (s StandDown) Do(_ context.Context, r *vmrun.Run) error {
	s.StandIns.Down(r.VM.HostUID())
	return nil
}

// Replay is the resume plan's last step for a VM on a network: what was held for it while it
// was suspended is sent to its tap, and reaches its guest, which runs again. A failure is
// logged, not the resume's: what was held is lost, and its senders retransmit.
type Replay struct{ StandIns *StandIns }

func (Replay) Name() string { return "replay" }

func (s Replay) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	s.StandIns.mu.Lock()
	defer s.StandIns.mu.Unlock()
	_, ok := s.StandIns.replays[r.VM.HostUID()]
	return ok, nil
}

func (s Replay) Do(_ context.Context, r *vmrun.Run) error {
	if n, err := s.StandIns.replay(r.VM.HostUID()); err != nil {
		s.StandIns.Log.Error(err, "sending what was held for a woken VM", "vm", client.ObjectKeyFromObject(r.VM), "frames", n)
	}
	return nil
}
