package handover

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/google/go-containerregistry/pkg/name"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// TestARunIsHandedOverOnce: the record of a handover is created once; the claim that made it
// finds it again, any other claim is refused.
func TestARunIsHandedOverOnce(t *testing.T) {
	dir := t.TempDir()
	if Pending(dir) {
		t.Fatal("pending before any record")
	}
	if err := record(dir, "claim-1"); err != nil {
		t.Fatal(err)
	}
	if err := record(dir, "claim-1"); err != nil {
		t.Errorf("the same claim again: %v", err)
	}
	if err := record(dir, "claim-2"); err == nil || !strings.Contains(err.Error(), "handed to another VM") {
		t.Errorf("another claim: %v", err)
	}
	if !Pending(dir) {
		t.Error("not pending after the record")
	}
	// A link planted in the place of the record is not followed.
	other := t.TempDir()
	target := filepath.Join(t.TempDir(), "elsewhere")
	if err := os.Symlink(target, filepath.Join(other, RecordFile)); err != nil {
		t.Fatal(err)
	}
	if err := record(other, "claim-1"); err == nil {
		t.Error("a record through a symlink")
	}
	if _, err := os.Stat(target); err == nil {
		t.Error("the symlink's target was written")
	}
}

// reader answers Gets with the VMs it holds (by name), NotFound otherwise.
type reader struct {
	client.Reader
	vms map[string]*impv1.ImpVM
}

func (r reader) Get(_ context.Context, key client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	vm, ok := r.vms[key.Namespace+"/"+key.Name]
	if !ok {
		return apierrors.NewNotFound(schema.GroupResource{Group: "imp.dev", Resource: "impvms"}, key.Name)
	}
	vm.DeepCopyInto(obj.(*impv1.ImpVM))
	return nil
}

type followers struct{ stopped []types.UID }

func (f *followers) Stop(uid types.UID) { f.stopped = append(f.stopped, uid) }

// TestOnlyTheBoundMemberIsTaken: the member step takes only a live run of the member the claim
// was bound to, in the claim's namespace, whose guest took on the member's identity, and whose
// ImpVM the pool controls on this node; anything else fails the handover (the claim is
// restored) without recording it or letting go of the run's monitor.
func TestOnlyTheBoundMemberIsTaken(t *testing.T) {
	self, err := vmm.StartTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	live := &vmm.Record{Pid: os.Getpid(), StartTime: self}
	dead := &vmm.Record{Pid: os.Getpid(), StartTime: self + 1}
	poolRef := metav1.OwnerReference{APIVersion: impv1.GroupVersion.String(), Kind: "ImpWarmPool", Name: "p", UID: "pool", Controller: ptr.To(true)}
	member := func(change func(*impv1.ImpVM)) *impv1.ImpVM {
		m := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: "p-abcde", UID: "m-uid",
			Labels: map[string]string{impv1.WarmPoolLabel: "p"}, OwnerReferences: []metav1.OwnerReference{poolRef}},
			Status: impv1.ImpVMStatus{NodeName: "n1"}}
		if change != nil {
			change(m)
		}
		return m
	}
	claim := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: "c", UID: "c-uid"},
		Spec:   impv1.ImpVMSpec{WarmPoolRef: &impv1.WarmPoolReference{Name: "p"}},
		Status: impv1.ImpVMStatus{Start: impv1.StartWarm, Warm: &impv1.WarmStatus{Pool: "p", Member: "p-abcde", MemberUID: "m-uid"}}}
	meta := func(change func(*vmrun.Meta)) *vmrun.Meta {
		m := &vmrun.Meta{Namespace: "team", Name: "p-abcde", UID: "m-uid", Token: "t", Digest: "sha256:aa",
			Restore: &vmrun.Restored{Snapshot: "s", Done: true}}
		if change != nil {
			change(m)
		}
		return m
	}
	for _, tc := range []struct {
		name   string
		old    *vmrun.Meta
		rec    *vmm.Record
		member *impv1.ImpVM
		want   string
	}{
		{"no run kept", nil, live, member(nil), "keeps no run"},
		{"another VM's run", meta(func(m *vmrun.Meta) { m.UID = "other" }), live, member(nil), "not of member"},
		{"another namespace's run", meta(func(m *vmrun.Meta) { m.Namespace = "other" }), live, member(nil), "not of member"},
		{"a run handed over already", meta(func(m *vmrun.Meta) { m.Host = "x" }), live, member(nil), "not of member"},
		{"a guest that never became the member", meta(func(m *vmrun.Meta) { m.Restore.Done = false }), live, member(nil), "never took on"},
		{"a VMM gone", meta(nil), dead, member(nil), "does not run"},
		{"a member deleted", meta(nil), live, nil, "does not exist"},
		{"a member of another UID", meta(nil), live, member(func(m *impv1.ImpVM) { m.UID = "new" }), "no member of"},
		{"a VM the pool does not control", meta(nil), live, member(func(m *impv1.ImpVM) { m.OwnerReferences = nil }), "no member of"},
		{"a member of another node", meta(nil), live, member(func(m *impv1.ImpVM) { m.Status.NodeName = "n2" }), "no member of"},
		{"the bound member", meta(nil), live, member(nil), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			vms := map[string]*impv1.ImpVM{}
			if tc.member != nil {
				vms["team/p-abcde"] = tc.member
			}
			f := &followers{}
			s := Member{Cache: reader{vms: map[string]*impv1.ImpVM{}}, API: reader{vms: vms}, Node: "n1", Runs: f}
			r := &vmrun.Run{VM: claim, Dir: dir, Old: tc.old, Record: tc.rec}
			err := s.Do(context.Background(), r)
			var failed *plan.Failed
			switch {
			case tc.want == "" && err != nil:
				t.Fatal(err)
			case tc.want == "":
				if !Pending(dir) || len(f.stopped) != 1 || f.stopped[0] != "m-uid" || r.Pinned != "sha256:aa" {
					t.Errorf("taken: pending %v, monitors stopped %v, pinned %q", Pending(dir), f.stopped, r.Pinned)
				}
			case !errors.As(err, &failed) || failed.Reason != impv1.ReasonWarmHandoverFailed || !strings.Contains(err.Error(), tc.want):
				t.Errorf("err %v; want a WarmHandoverFailed saying %q", err, tc.want)
			case Pending(dir) || len(f.stopped) > 0:
				t.Errorf("refused, yet recorded (%v) or its monitor stopped (%v)", Pending(dir), f.stopped)
			}
		})
	}
}

// TestLocksSerialiseOneDirectory: a directory's lock is had once at a time; another
// directory's is not held up by it; a lock let go is had again.
func TestLocksSerialiseOneDirectory(t *testing.T) {
	var l Locks
	unlockA, ok := l.TryLock("a")
	if !ok {
		t.Fatal("a free lock refused")
	}
	if _, ok := l.TryLock("a"); ok {
		t.Error("one directory's lock had twice")
	}
	unlockB, ok := l.TryLock("b")
	if !ok {
		t.Error("another directory's lock held up")
	}
	unlockA()
	unlockB()
	if _, ok := l.TryLock("a"); !ok {
		t.Error("a lock let go is not had again")
	}
	if len(l.held) != 1 {
		t.Errorf("locks held: %v", l.held)
	}
}

type reports struct{ reported []impv1.RuntimeStatus }

func (r *reports) Report(_ context.Context, _ *impv1.ImpVM, rt impv1.RuntimeStatus) error {
	r.reported = append(r.reported, rt)
	return nil
}

func (r *reports) ReportLater(context.Context, *impv1.ImpVM, impv1.RuntimeStatus) error { return nil }

type noRuns struct{}

func (noRuns) Ensure(*impv1.ImpVM, string, *vmrun.Meta, *vmm.Record, net.Conn) {}

type failingFetches struct{}

func (failingFetches) Begin(*impv1.ImpVM, name.Reference) bool { return true }
func (failingFetches) Take(*impv1.ImpVM, time.Duration) (*vmrun.Image, error) {
	return nil, plan.Fail("ImagePullFailed", errors.New("refused"))
}

// TestAFailedHandoverStopsOnlyWhatItTook: a handover that fails after it took the member's run
// stops the member's VMM and reports the claim WarmHandoverFailed; one whose member step
// refused the run (another namespace's, here) reports the same and stops nothing: that run is
// not the claim's to stop.
func TestAFailedHandoverStopsOnlyWhatItTook(t *testing.T) {
	self, err := vmm.StartTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	live := &vmm.Record{Kind: "qemu", Pid: os.Getpid(), StartTime: self}
	poolRef := metav1.OwnerReference{APIVersion: impv1.GroupVersion.String(), Kind: "ImpWarmPool", Name: "p", UID: "pool", Controller: ptr.To(true)}
	member := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: "p-abcde", UID: "m-uid",
		Labels: map[string]string{impv1.WarmPoolLabel: "p"}, OwnerReferences: []metav1.OwnerReference{poolRef}},
		Status: impv1.ImpVMStatus{NodeName: "n1"}}
	claim := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: "c", UID: "c-uid"},
		Spec: impv1.ImpVMSpec{WarmPoolRef: &impv1.WarmPoolReference{Name: "p"}},
		Status: impv1.ImpVMStatus{Start: impv1.StartWarm, Warm: &impv1.WarmStatus{Pool: "p", Member: "p-abcde", MemberUID: "m-uid"},
			Template: &impv1.TemplateStatus{Image: "127.0.0.1:5000/hello:v1"}}}
	for _, tc := range []struct {
		name      string
		namespace string
		stopped   int
	}{
		{"taken, then failed", "team", 1},
		{"refused", "other", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var quit []types.UID
			rep := &reports{}
			h := &Handovers{Reports: rep, Runs: noRuns{}, Recorder: events.NewFakeRecorder(10),
				Quit: func(_ context.Context, _ string, uid types.UID) error { quit = append(quit, uid); return nil },
				Steps: Steps{
					Member: Member{Cache: reader{}, API: reader{vms: map[string]*impv1.ImpVM{"team/p-abcde": member}}, Node: "n1", Runs: &followers{}},
					Image:  steps.Image{Fetches: failingFetches{}, Reports: rep, NameOptions: func(string) []name.Option { return nil }},
				}}
			old := &vmrun.Meta{Namespace: tc.namespace, Name: "p-abcde", UID: "m-uid", VMM: "qemu", Restore: &vmrun.Restored{Done: true}}
			if err := h.Hand(context.Background(), claim, t.TempDir(), old, live); err != nil {
				t.Fatal(err)
			}
			if len(quit) != tc.stopped {
				t.Errorf("VMMs stopped: %v; want %d", quit, tc.stopped)
			}
			if len(rep.reported) != 1 || rep.reported[0].Reason != impv1.ReasonWarmHandoverFailed || rep.reported[0].State != impv1.RuntimeExited {
				t.Errorf("reported %+v", rep.reported)
			}
		})
	}
}
