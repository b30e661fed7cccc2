package idle

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// node is the agent's cache of one VM, the VM's tap counters, and what the meter reported.
type node struct {
	client.Reader
	mu       sync.Mutex
	vm       *impv1.ImpVM
	in, out  uint64
	reported []impv1.RuntimeStatus
}

func (n *node) List(_ context.Context, l client.ObjectList, _ ...client.ListOption) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	l.(*impv1.ImpVMList).Items = []impv1.ImpVM{*n.vm.DeepCopy()}
	return nil
}

func (n *node) Traffic(context.Context, *impv1.ImpVM) (uint64, uint64, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.in, n.out, nil
}

func (n *node) Mark(_ context.Context, _ *impv1.ImpVM, set func(rt *impv1.RuntimeStatus)) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	set(n.vm.Status.Runtime)
	n.reported = append(n.reported, *n.vm.Status.Runtime.DeepCopy())
	return nil
}

// TestTheMetersRule: a VM is reported idle once nothing counted as activity happened for its
// suspendAfter — a frame delivered to it, an exec/console/port-forward session open, and with
// outbound a frame it sent; a connection left open and silent is not activity (no frame); it
// is reported active again at the next activity.
func TestTheMetersRule(t *testing.T) {
	vm := &impv1.ImpVM{}
	vm.Name, vm.UID = "vm", "uid-1"
	vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	vm.Spec.Idle = &impv1.IdlePolicy{SuspendAfter: metav1.Duration{Duration: time.Minute}}
	vm.Status.Instance = 1
	vm.Status.Runtime = &impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeRunning}
	n := &node{vm: vm}
	clk := clocktesting.NewFakeClock(time.Unix(1e9, 0))
	sessions := &Sessions{}
	m := &Meter{Client: n, Traffic: n, Sessions: sessions, Reports: n, Clock: clk, seen: map[types.UID]*activity{}}
	tick := func(d time.Duration) { clk.Step(d); m.pass(context.Background()) }
	idle := func() bool { return n.vm.Status.Runtime.IdleSince != nil }

	tick(0) // first seen: active now
	tick(59 * time.Second)
	if idle() {
		t.Fatal("reported idle before its suspendAfter")
	}
	n.in++ // a frame for it
	tick(59 * time.Second)
	tick(2 * time.Second)
	if idle() {
		t.Fatal("reported idle a minute after the first, with a frame for it since")
	}
	tick(59 * time.Second) // a silent minute (an open connection sends nothing)
	if !idle() {
		t.Fatal("not reported idle after a silent minute")
	}
	if got, want := n.vm.Status.Runtime.IdleSince.Time, time.Unix(1e9, 0).Add(118*time.Second); !got.Equal(want) {
		t.Errorf("idle since %v; want %v, when the frame was counted", got, want)
	}
	reports := len(n.reported)
	tick(time.Minute)
	if len(n.reported) != reports {
		t.Error("reported idle again: once is enough")
	}
	n.in++ // activity: reported active again
	tick(time.Second)
	if idle() {
		t.Fatal("still idle after a frame for it")
	}

	// Its own frames count only with outbound.
	for _, outbound := range []bool{false, true} {
		n.mu.Lock()
		n.vm.Spec.Idle.Outbound = outbound
		n.mu.Unlock()
		for range 61 {
			n.out++
			tick(time.Second)
		}
		if idle() == outbound {
			t.Errorf("outbound %v: a VM sending every second was reported idle: %v", outbound, idle())
		}
		n.in++
		tick(time.Second) // active again
	}

	// An open exec session keeps it awake; a log read does not count.
	duringLog := -1
	h := sessions.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/vms/ns/vm/uid-1/exec" {
			for range 61 {
				tick(time.Second)
			}
		} else {
			duringLog = sessions.Open("uid-1")
		}
	}))
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/vms/ns/vm/uid-1/exec", nil))
	if idle() {
		t.Error("reported idle while an exec session was open")
	}
	if sessions.Open("uid-1") != 0 {
		t.Error("the session is still counted after it ended")
	}
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/vms/ns/vm/uid-1/log", nil))
	if duringLog != 0 {
		t.Errorf("a log read counted as %d sessions", duringLog)
	}
}
