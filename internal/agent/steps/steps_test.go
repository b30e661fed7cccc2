package steps

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/preflight"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
)

func newRun(t *testing.T) *vmrun.Run {
	t.Helper()
	vm := &impv1.ImpVM{}
	vm.Namespace, vm.Name, vm.UID = "team", "web", "uid-1"
	vm.Spec.Image = "registry.test/app@sha256:" + sixtyFour
	vm.Status.Instance, vm.Status.RestartCount = 3, 1
	vm.Status.Resources = &impv1.ResolvedResources{VCPUs: 1, Memory: resource.MustParse("128Mi"), DiskSize: resource.MustParse("64Mi")}
	return &vmrun.Run{VM: vm, Dir: filepath.Join(t.TempDir(), "vm")}
}

const sixtyFour = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// do runs one step as its plan's runner would: measure, then act.
func do(t *testing.T, s Step, r *vmrun.Run) (bool, error) {
	t.Helper()
	should, err := s.ShouldDo(context.Background(), r)
	if err != nil || !should {
		return should, err
	}
	return true, s.Do(context.Background(), r)
}

func reasonOf(err error) string {
	var f *plan.Failed
	if errors.As(err, &f) {
		return f.Reason
	}
	return ""
}

func TestStateDir(t *testing.T) {
	r := newRun(t)
	if did, err := do(t, StateDir{}, r); !did || err != nil {
		t.Fatalf("first: %v, %v", did, err)
	}
	if fi, err := os.Stat(r.Dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("the state directory: %v, %v", fi, err)
	}
	if did, _ := do(t, StateDir{}, r); did {
		t.Error("done again with the directory there")
	}
	// An old suspension's state: a boot voids it.
	if err := os.WriteFile(r.Path(qemu.StateFile), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if did, err := do(t, StateDir{}, r); !did || err != nil {
		t.Fatalf("with a saved state: %v, %v", did, err)
	}
	if _, err := os.Stat(r.Path(qemu.StateFile)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the saved state stays: %v", err)
	}
}

type fakeDisks struct{ made []string }

func (d *fakeDisks) Ensure(path string, size int64) error {
	d.made = append(d.made, path)
	return os.WriteFile(path, make([]byte, 0), 0o600)
}

func TestWritableDisk(t *testing.T) {
	r := newRun(t)
	_ = os.MkdirAll(r.Dir, 0o700)
	d := &fakeDisks{}
	s := WritableDisk{Disks: d}
	if did, err := do(t, s, r); !did || err != nil || len(d.made) != 1 || d.made[0] != r.Path(vmrun.WritableDisk) {
		t.Fatalf("%v, %v, made %v", did, err, d.made)
	}
	if did, _ := do(t, s, r); did || len(d.made) != 1 {
		t.Error("a second disk was made: the VM keeps its own")
	}
	r2 := newRun(t)
	r2.VM.Status.Resources = nil
	if _, err := do(t, s, r2); err == nil {
		t.Error("a VM without resources got a disk")
	}
}

type fakeFetches struct {
	began, fetching bool
	img             *vmrun.Image
	err             error
	waited          time.Duration
	dropped         []types.UID
}

func (f *fakeFetches) Begin(*impv1.ImpVM, name.Reference) bool { return f.began }
func (f *fakeFetches) Take(_ *impv1.ImpVM, wait time.Duration) (*vmrun.Image, error) {
	f.waited = wait
	return f.img, f.err
}
func (f *fakeFetches) Fetching(*impv1.ImpVM) bool { return f.fetching }
func (f *fakeFetches) Drop(uid types.UID)         { f.dropped = append(f.dropped, uid) }

type fakeReports struct{ reported []impv1.RuntimeStatus }

func (f *fakeReports) ReportLater(_ context.Context, _ *impv1.ImpVM, rt impv1.RuntimeStatus) error {
	f.reported = append(f.reported, rt)
	return nil
}

func TestImage(t *testing.T) {
	none := func(string) []name.Option { return nil }
	released := 0
	img := &vmrun.Image{BaseDisk: "/base", Release: func() { released++ }}
	for _, tc := range []struct {
		name   string
		image  string
		f      *fakeFetches
		wait   time.Duration
		reason string
		isWait bool
	}{
		{"begun and done", "", &fakeFetches{began: true, img: img}, 100 * time.Millisecond, "", false},
		{"under way", "", &fakeFetches{err: plan.ErrWait}, 0, "", true},
		{"failed", "", &fakeFetches{err: plan.Fail("ImagePullFailed", errors.New("401"))}, 0, "ImagePullFailed", false},
		{"invalid", "Not A Reference!", &fakeFetches{}, 0, "InvalidImage", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRun(t)
			if tc.image != "" {
				r.VM.Spec.Image = tc.image
			}
			rep := &fakeReports{}
			s := Image{Fetches: tc.f, Reports: rep, NameOptions: none, FetchWait: 100 * time.Millisecond}
			_, err := do(t, s, r)
			switch {
			case tc.isWait:
				if !errors.Is(err, plan.ErrWait) || r.Image != nil {
					t.Errorf("%v, %v", err, r.Image)
				}
			case tc.reason != "":
				if reasonOf(err) != tc.reason {
					t.Errorf("err %v; want reason %s", err, tc.reason)
				}
			default:
				if err != nil || r.Image != img || tc.f.waited != tc.wait {
					t.Errorf("%v, %v, waited %v", err, r.Image, tc.f.waited)
				}
				if len(rep.reported) != 1 || rep.reported[0].State != impv1.RuntimeStarting || rep.reported[0].Run != 1 {
					t.Errorf("reports %+v", rep.reported)
				}
				r.Done()
				if released != 1 {
					t.Errorf("the base disk's lease released %d times", released)
				}
				if did, _ := do(t, s, r); did {
					t.Error("fetched again with the image there")
				}
			}
		})
	}
}

func TestProvenance(t *testing.T) {
	r := newRun(t)
	kernel := filepath.Join(t.TempDir(), "vmlinuz")
	if err := os.WriteFile(kernel, []byte("kernel"), 0o600); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte("kernel"))
	wrong := preflight.Pin{Name: "kernel", Path: kernel, SHA256: strings.Repeat("0", 64)}
	f := &fakeFetches{fetching: true}
	s := Provenance{Pins: []preflight.Pin{wrong}, Fetches: f}
	if did, _ := do(t, s, r); did {
		t.Error("checked while the run's fetch is under way")
	}
	f.fetching = false
	if _, err := do(t, s, r); reasonOf(err) != "PinMismatch" || len(f.dropped) != 1 || !strings.HasPrefix(err.Error(), "pinned kernel: ") {
		t.Errorf("err %v, dropped %v", err, f.dropped)
	}
	right := preflight.Pin{Name: "kernel", Path: kernel, SHA256: hex.EncodeToString(sum[:])}
	if did, err := do(t, Provenance{Pins: []preflight.Pin{right}, Fetches: f}, r); !did || err != nil {
		t.Errorf("a matching pin: %v, %v", did, err)
	}
	if did, _ := do(t, Provenance{Fetches: f}, r); did {
		t.Error("checked on a node with no pins")
	}
}

func TestConfigDisk(t *testing.T) {
	r := newRun(t)
	_ = os.MkdirAll(r.Dir, 0o700)
	r.Image = &vmrun.Image{Config: &v1.Config{Entrypoint: []string{"/serve"}}}
	if did, err := do(t, ConfigDisk{}, r); !did || err != nil {
		t.Fatalf("%v, %v", did, err)
	}
	if fi, err := os.Stat(r.Path(vmrun.ConfigDisk)); err != nil || fi.Size() == 0 {
		t.Errorf("the config disk: %v, %v", fi, err)
	}
	// The run keeps what it wrote, for a restore's reidentify to send the guest.
	f, err := os.Open(r.Path(vmrun.ConfigDisk))
	if err != nil {
		t.Fatal(err)
	}
	onDisk, err := guestinit.DecodeConfigDisk(f)
	f.Close()
	if err != nil || r.Config == nil || !reflect.DeepEqual(*r.Config, onDisk) {
		t.Errorf("the run's config %+v, the disk's %+v (%v)", r.Config, onDisk, err)
	}
	r.Image.Config = &v1.Config{}
	if _, err := do(t, ConfigDisk{}, r); err == nil {
		t.Error("a workload with nothing to run was written")
	}
}

type fakeIDs struct {
	kind impv1.VMMKind
	err  error
}

func (f fakeIDs) ChooseVMM(*impv1.ImpVM) (impv1.VMMKind, error) { return f.kind, f.err }
func (f fakeIDs) Record(dir string, m *vmrun.Meta) error {
	m.JailUID = 300007
	return vmrun.WriteMeta(dir, m)
}

func TestIdentity(t *testing.T) {
	r := newRun(t)
	_ = os.MkdirAll(r.Dir, 0o700)
	d, _ := name.NewDigest("registry.test/app@sha256:" + sixtyFour)
	r.Image = &vmrun.Image{Digest: d}
	if _, err := do(t, Identity{IDs: fakeIDs{err: errors.New("no VMM")}}, r); reasonOf(err) != "VMMUnavailable" {
		t.Errorf("err %v", err)
	}
	r.Old = &vmrun.Meta{Token: "kept"}
	if did, err := do(t, Identity{IDs: fakeIDs{kind: impv1.VMMQEMU}}, r); !did || err != nil {
		t.Fatal(err)
	}
	m, err := vmrun.ReadMeta(r.Dir)
	if err == nil && m.Started.Equal(r.Meta.Started) {
		m.Started = r.Meta.Started // the monotonic clock's reading is not kept
	}
	if err != nil || !reflect.DeepEqual(m, r.Meta) || m.Token != "kept" || m.JailUID != 300007 || m.Digest != "sha256:"+sixtyFour || m.Instance != 3 || m.Run != 1 || !m.Session {
		t.Errorf("meta %+v, %v", m, err)
	}
	r2 := newRun(t)
	_ = os.MkdirAll(r2.Dir, 0o700)
	r2.Image = r.Image
	_, _ = do(t, Identity{IDs: fakeIDs{kind: impv1.VMMQEMU}}, r2)
	if r2.Meta.Token == "" || r2.Meta.Token == "kept" {
		t.Errorf("a new VM's token %q", r2.Meta.Token)
	}
}

type fakeAttacher struct{ err error }

func (f fakeAttacher) Attach(context.Context, *impv1.ImpVM) (hostnet.Attachment, *guestinit.Net, error) {
	return hostnet.Attachment{}, &guestinit.Net{MTU: 1450}, f.err
}

func TestNetwork(t *testing.T) {
	r := newRun(t)
	if did, _ := do(t, Network{Attacher: fakeAttacher{}}, r); did {
		t.Error("attached a VM on no network")
	}
	r.VM.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	if did, err := do(t, Network{Attacher: fakeAttacher{}}, r); !did || err != nil || r.Net == nil {
		t.Errorf("%v, %v, %v", did, err, r.Net)
	}
	if _, err := do(t, Network{Attacher: fakeAttacher{err: errors.New("no bridge")}}, r); reasonOf(err) != "NetworkFailed" {
		t.Errorf("err %v", err)
	}
}

type fakeLauncher struct {
	rec        *vmm.Record
	err        error
	resumedErr error
}

func (f fakeLauncher) Launch(context.Context, *vmrun.Run) (*vmm.Record, error) { return f.rec, f.err }
func (f fakeLauncher) Resumed(context.Context, *vmrun.Run, *vmm.Record) error  { return f.resumedErr }

func TestIntentExecResumed(t *testing.T) {
	r := newRun(t)
	_ = os.MkdirAll(r.Dir, 0o700)
	if _, err := do(t, Intent{}, r); err != nil || !vmm.HasIntent(r.Dir) {
		t.Fatalf("intent: %v", err)
	}
	if _, err := do(t, Exec{Launcher: fakeLauncher{err: errors.New("exec failed")}}, r); err == nil || !vmm.HasIntent(r.Dir) || r.Record != nil {
		t.Errorf("a failed exec: %v; the intent must stay for the next start to find", err)
	}
	rec := &vmm.Record{Pid: 42}
	if _, err := do(t, Exec{Launcher: fakeLauncher{rec: rec}}, r); err != nil || vmm.HasIntent(r.Dir) || r.Record != rec {
		t.Errorf("exec: %v, intent %v, record %v", err, vmm.HasIntent(r.Dir), r.Record)
	}
	if did, _ := do(t, Resumed{Resumer: fakeLauncher{}}, r); did {
		t.Error("a boot was resumed")
	}
	r.Resume = true
	if _, err := do(t, Resumed{Resumer: fakeLauncher{resumedErr: errors.New("migration failed")}}, r); err == nil {
		t.Error("a failed resume passed")
	}
}

type fakeTeardown struct {
	forgot, detached, jails []types.UID
	detachErr               error
}

func (f *fakeTeardown) Forget(uid types.UID) { f.forgot = append(f.forgot, uid) }
func (f *fakeTeardown) Detach(uid types.UID) error {
	f.detached = append(f.detached, uid)
	return f.detachErr
}
func (f *fakeTeardown) RemoveJail(uid types.UID) error {
	f.jails = append(f.jails, uid)
	return nil
}

// TestTeardown: the teardown plan's steps remove what there is, and run again on nothing;
// a process carrying the VM's marker is killed even without a record (a crash left it).
func TestTeardown(t *testing.T) {
	const uid = "0d0d0d0d-1111-2222-3333-444455556666"
	dir := filepath.Join(t.TempDir(), uid)
	_ = os.MkdirAll(dir, 0o700)
	_ = os.WriteFile(filepath.Join(dir, vmrun.WritableDisk), nil, 0o600)
	stray := exec.Command("/bin/sh", "-c", "sleep 60", "vmm", "-name", uid)
	if err := stray.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = stray.Wait(); close(exited) }()
	t.Cleanup(func() { _ = stray.Process.Kill() })
	f := &fakeTeardown{}
	var cgroups []types.UID
	td := &vmrun.Teardown{UID: uid, Dir: dir, Name: "team/web"}
	p := plan.Plan[*vmrun.Teardown]{Name: "teardown", Reason: "TeardownFailed", Steps: []TeardownStep{
		KillVMMs{}, Forget{Memory: f}, Cgroups{Remove: func(u types.UID) { cgroups = append(cgroups, u) }},
		Detach{Detacher: f}, Jail{Jails: f}, RemoveState{}}}
	if err := p.Run(context.Background(), td); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
		t.Error("the unrecorded VMM runs on")
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) || len(f.forgot) != 1 || len(f.detached) != 1 || len(f.jails) != 1 || len(cgroups) != 1 {
		t.Errorf("state %v, forgot %v, detached %v, jails %v, cgroups %v", err, f.forgot, f.detached, f.jails, cgroups)
	}
	if err := p.Run(context.Background(), td); err != nil {
		t.Errorf("again, on nothing: %v", err)
	}
	f.detachErr = errors.New("netlink: busy")
	if err := p.Run(context.Background(), td); reasonOf(err) != "TeardownFailed" {
		t.Errorf("a failed detach: %v", err)
	}
	if did, _ := (Cgroups{}).ShouldDo(context.Background(), td); did {
		t.Error("cgroups removed where the agent makes none")
	}
}

type fakeStoppers struct {
	asked, quits int
	canAsk       bool
}

func (f *fakeStoppers) RequestStop(types.UID) bool { f.asked++; return f.canAsk }
func (f *fakeStoppers) Quit(context.Context, string, types.UID) error {
	f.quits++
	return errors.New("no QMP")
}

// TestStop: the stop plan asks once, waits out the grace period in short waits (no worker
// held), then has the VMM quit and kills it when it does not; a VMM that is gone needs nothing.
func TestStop(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }() // reaped, so that it is gone once killed
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	start, err := vmm.StartTime(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeStoppers{}
	vm := newRun(t).VM
	s := &vmrun.Stop{VM: vm, Record: &vmm.Record{Pid: cmd.Process.Pid, StartTime: start}, Deadline: time.Now().Add(300 * time.Millisecond)}
	p := plan.Plan[*vmrun.Stop]{Name: "stop", Steps: []StopStep{Ask{Stoppers: f}, Grace{}, Quit{Stoppers: f}, Kill{}}}
	err = p.Run(context.Background(), s)
	if w := plan.WaitTime(err); !errors.Is(err, plan.ErrWait) || w <= 0 || w > 500*time.Millisecond || f.asked != 1 || s.Asked {
		t.Fatalf("in the grace period: %v (wait %v), asked %d", err, w, f.asked)
	}
	f.canAsk = true
	_ = p.Run(context.Background(), s)
	if f.asked != 2 || !s.Asked {
		t.Errorf("a guest without a channel is asked again: asked %d", f.asked)
	}
	time.Sleep(time.Until(s.Deadline))
	if err := p.Run(context.Background(), s); err != nil || f.quits != 1 || s.Record.Alive() {
		t.Fatalf("after the grace period: %v, quits %d, alive %v", err, f.quits, s.Record.Alive())
	}
	if err := p.Run(context.Background(), s); err != nil || f.asked != 2 || f.quits != 1 {
		t.Errorf("a gone VMM: %v, asked %d, quits %d", err, f.asked, f.quits)
	}
}

// TestDrainBeforeAsking: a VM with an endpoint is not asked to stop until its drain ends (its
// endpoint terminating meanwhile), and then is.
func TestDrainBeforeAsking(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	start, err := vmm.StartTime(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeStoppers{canAsk: true}
	now := time.Now()
	s := &vmrun.Stop{VM: newRun(t).VM, Record: &vmm.Record{Pid: cmd.Process.Pid, StartTime: start},
		Deadline: now.Add(time.Minute), DrainUntil: now.Add(200 * time.Millisecond)}
	p := plan.Plan[*vmrun.Stop]{Name: "stop", Steps: []StopStep{Drain{}, Ask{Stoppers: f}, Grace{}}}
	if err := p.Run(context.Background(), s); !errors.Is(err, plan.ErrWait) || f.asked != 0 {
		t.Fatalf("while draining: %v, asked %d", err, f.asked)
	}
	time.Sleep(time.Until(s.DrainUntil))
	if err := p.Run(context.Background(), s); !errors.Is(err, plan.ErrWait) || f.asked != 1 || !s.Asked {
		t.Fatalf("after the drain: %v, asked %d", err, f.asked)
	}
}

// Report is the fake's report at once (the suspend plan's).
func (f *fakeReports) Report(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error {
	return f.ReportLater(ctx, vm, rt)
}

type fakeSavers struct{ proc *os.Process }

func (f fakeSavers) Save(context.Context, *vmrun.Suspend) error { return f.proc.Kill() }

// TestSuspendSteps: the suspend plan's steps measure what is done: a run reported Suspending is
// not reported again, a VMM gone is neither frozen nor saved, and the end is reported whatever
// the VM's status holds (no resources recorded: no panic, the message says less).
func TestSuspendSteps(t *testing.T) {
	ctx := context.Background()
	sleep := exec.Command("sleep", "60")
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = sleep.Wait() }()
	st, err := vmm.StartTime(sleep.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	vm := &impv1.ImpVM{}
	s := &vmrun.Suspend{VM: vm, Record: &vmm.Record{Pid: sleep.Process.Pid, StartTime: st},
		Runtime: impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeSuspending}}
	reports := &fakeReports{}
	if do, _ := (Suspending{Reports: reports}).ShouldDo(ctx, s); do {
		t.Error("a run reported Suspending is reported again")
	}
	if do, _ := (Save{}).ShouldDo(ctx, s); !do {
		t.Fatal("a live VMM is not saved")
	}
	if err := (Save{Savers: fakeSavers{sleep.Process}}).Do(ctx, s); err != nil || s.Took <= 0 || s.Alive() {
		t.Fatalf("save: %v, took %v, alive %v", err, s.Took, s.Alive())
	}
	for _, step := range []SuspendStep{Freeze{}, Save{}} {
		if do, _ := step.ShouldDo(ctx, s); do {
			t.Errorf("%s runs on a VMM that is gone", step.Name())
		}
	}
	if err := (Suspended{Reports: reports}).Do(ctx, s); err != nil {
		t.Fatal(err)
	}
	if len(reports.reported) != 1 || reports.reported[0].State != impv1.RuntimeSuspended || !strings.HasPrefix(reports.reported[0].Message, "state saved in ") {
		t.Errorf("reports %+v", reports.reported)
	}
}

// TestHoldsWorkload: the guest holds its workload for a VM its ImpVMTemplate controls and marked,
// and for a warm pool member restored from a snapshot taken before the workload; a tenant's own
// VM carrying the mark, or a copy or claim of such a template (which starts it), does not.
func TestHoldsWorkload(t *testing.T) {
	img := &v1.Config{Entrypoint: []string{"/app"}}
	tmpl := metav1.OwnerReference{APIVersion: impv1.GroupVersion.String(), Kind: "ImpVMTemplate", Name: "t", UID: "t-uid", Controller: ptr.To(true)}
	pool := metav1.OwnerReference{APIVersion: impv1.GroupVersion.String(), Kind: "ImpWarmPool", Name: "p", UID: "p-uid", Controller: ptr.To(true)}
	for _, c := range []struct {
		name string
		vm   func(*impv1.ImpVM)
		want bool
	}{
		{"plain", func(*impv1.ImpVM) {}, false},
		{"the template's VM", func(vm *impv1.ImpVM) {
			vm.Annotations = map[string]string{impv1.HoldWorkloadAnnotation: "true"}
			vm.Labels = map[string]string{impv1.TemplateLabel: "t"}
			vm.OwnerReferences = []metav1.OwnerReference{tmpl}
		}, true},
		{"a tenant's VM marked", func(vm *impv1.ImpVM) {
			vm.Annotations = map[string]string{impv1.HoldWorkloadAnnotation: "true"}
			vm.Labels = map[string]string{impv1.TemplateLabel: "t"}
		}, false},
		{"a member of a held template", func(vm *impv1.ImpVM) {
			vm.Labels = map[string]string{impv1.WarmPoolLabel: "p"}
			vm.OwnerReferences = []metav1.OwnerReference{pool}
			vm.Spec.TemplateRef = &impv1.TemplateReference{Name: "t"}
			vm.Status.Template = &impv1.TemplateStatus{Name: "t", BeforeWorkload: true}
		}, true},
		{"a member of a running template", func(vm *impv1.ImpVM) {
			vm.Labels = map[string]string{impv1.WarmPoolLabel: "p"}
			vm.OwnerReferences = []metav1.OwnerReference{pool}
			vm.Spec.TemplateRef = &impv1.TemplateReference{Name: "t"}
			vm.Status.Template = &impv1.TemplateStatus{Name: "t"}
		}, false},
		{"a claim of a held template", func(vm *impv1.ImpVM) {
			vm.Spec.WarmPoolRef = &impv1.WarmPoolReference{Name: "p"}
			vm.Status.Template = &impv1.TemplateStatus{Name: "t", BeforeWorkload: true}
		}, false},
	} {
		r := newRun(t)
		c.vm(r.VM)
		cfg, err := workload(r.VM, nil, img)
		if err != nil || cfg.Hold != c.want {
			t.Errorf("%s: hold %v, %v; want %v", c.name, cfg.Hold, err, c.want)
		}
	}
}

// TestOSBoot: a VM that boots an OS is refused under Firecracker (not built), by its record's
// VMM or, before it has one, by the VMM it would get; under QEMU, and a workload's VM, it passes.
func TestOSBoot(t *testing.T) {
	ctx := context.Background()
	osVM := &impv1.ImpVM{Spec: impv1.ImpVMSpec{Boot: impv1.BootOS}}
	choose := func(k impv1.VMMKind) func(*impv1.ImpVM) (impv1.VMMKind, error) {
		return func(*impv1.ImpVM) (impv1.VMMKind, error) { return k, nil }
	}
	if do, _ := (OSBoot{}).ShouldDo(ctx, &vmrun.Run{VM: &impv1.ImpVM{}}); do {
		t.Error("a workload's VM goes through the OS's check")
	}
	for _, tc := range []struct {
		name string
		s    OSBoot
		meta *vmrun.Meta
		ok   bool
	}{
		{"qemu, chosen", OSBoot{ChooseVMM: choose(impv1.VMMQEMU)}, nil, true},
		{"firecracker, chosen", OSBoot{ChooseVMM: choose(impv1.VMMFirecracker)}, nil, false},
		{"firecracker, recorded", OSBoot{ChooseVMM: choose(impv1.VMMQEMU)}, &vmrun.Meta{VMM: impv1.VMMFirecracker}, false},
	} {
		r := &vmrun.Run{VM: osVM, Meta: tc.meta}
		if do, _ := tc.s.ShouldDo(ctx, r); !do {
			t.Fatalf("%s: an OS's VM skips the check", tc.name)
		}
		err := tc.s.Do(ctx, r)
		if (err == nil) != tc.ok || (err != nil && !strings.Contains(err.Error(), "under Firecracker is not built yet")) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}
