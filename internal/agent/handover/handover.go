// Package handover hands a warm pool's running member to the claim it was bound to, on the
// member's node (docs/warmpools.md): the claim's run is the member's running guest, kept under
// the member's UID (ImpVM.HostUID), given the claim's identity and configuration as a restored
// copy is given its own. It is a plan of its own (Steps, run by Handovers.Hand).
package handover

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/guestchan"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/tracing"
)

// RecordFile, in the member's state directory, holds the UID of the claim its run was handed
// to. It is created once (O_EXCL): a run is handed over once, to one claim.
const RecordFile = "handover"

// Pending says whether the run kept in dir is being, or was, handed to a claim: its member
// leaves it alone from then on.
func Pending(dir string) bool {
	_, err := os.Lstat(filepath.Join(dir, RecordFile))
	return err == nil
}

// Claimant is the UID of the claim the run kept in dir was handed to, if it was (or is being).
func Claimant(dir string) (types.UID, bool) {
	b, err := os.ReadFile(filepath.Join(dir, RecordFile))
	if err != nil {
		return "", false
	}
	return types.UID(b), true
}

// Owner is the UID of the VM whose run dir keeps: from the moment a handover is recorded, the
// claim's (its plan may still be under way, the record still the member's); else the VM its
// record (m) names; "" when there is neither.
func Owner(dir string, m *vmrun.Meta) types.UID {
	if c, ok := Claimant(dir); ok {
		return c
	}
	if m != nil {
		return m.UID
	}
	return ""
}

// record records in dir that its run goes to claim; an error when it went to another.
func record(dir string, claim types.UID) error {
	path := filepath.Join(dir, RecordFile)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if errors.Is(err, fs.ErrExist) {
		b, rerr := os.ReadFile(path)
		if rerr != nil {
			return rerr
		}
		if string(b) == string(claim) {
			return nil // this claim's, recorded by an earlier pass
		}
		return fmt.Errorf("the member's run was handed to another VM (%q)", guestchan.Sanitize(string(b)))
	} else if err != nil {
		return err
	}
	_, werr := f.WriteString(string(claim))
	return errors.Join(werr, f.Sync(), f.Close())
}

// Followers follow a run's guest (package monitor).
type Followers interface {
	// Stop stops following the run kept under uid, and returns once its monitor is gone.
	Stop(uid types.UID)
}

// Member is the handover's first step: the state directory the claim's HostUID names holds a
// live run of the member the claim was bound to (its meta of the claim's namespace and the
// member's name and UID, its guest given the member's identity, its VMM running), and the
// member's ImpVM, read from the API server, has that UID, the pool as its controller and this
// node. The directory then records the claim (O_EXCL), and the member's monitor lets go of the
// guest.
type Member struct {
	// Cache is the node's VMs as the agent's watch has them; API the API server.
	Cache, API client.Reader
	Node       string
	Runs       Followers
}

func (Member) Name() string { return "member" }

func (Member) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) { return r.Meta == nil, nil }

func (s Member) Do(ctx context.Context, r *vmrun.Run) error {
	vm, old := r.VM, r.Old
	w := vm.Status.Warm
	switch {
	case w == nil:
		return plan.Fail(impv1.ReasonWarmHandoverFailed, errors.New("the VM names no member it was handed"))
	case old == nil:
		return plan.Fail(impv1.ReasonWarmHandoverFailed, fmt.Errorf("node %s keeps no run of member %s", s.Node, w.Member))
	case old.UID != types.UID(w.MemberUID) || old.Namespace != vm.Namespace || old.Name != w.Member || old.Host != "":
		return plan.Fail(impv1.ReasonWarmHandoverFailed, fmt.Errorf("the run kept under %s on node %s is of %s/%s (%s), not of member %s (%s)",
			w.MemberUID, s.Node, old.Namespace, old.Name, old.UID, w.Member, w.MemberUID))
	case old.Restore == nil || !old.Restore.Done:
		return plan.Fail(impv1.ReasonWarmHandoverFailed, fmt.Errorf("the guest of member %s never took on the member's own identity", w.Member))
	case r.Record == nil || !r.Record.Alive():
		return plan.Fail(impv1.ReasonWarmHandoverFailed, fmt.Errorf("the VMM of member %s does not run", w.Member))
	}
	member, key := &impv1.ImpVM{}, types.NamespacedName{Namespace: vm.Namespace, Name: w.Member}
	err := s.Cache.Get(ctx, key, member) // the node's VMs: the member is one
	if apierrors.IsNotFound(err) {
		err = s.API.Get(ctx, key, member) // or not yet seen: the API server says
	}
	if apierrors.IsNotFound(err) {
		return plan.Fail(impv1.ReasonWarmHandoverFailed, fmt.Errorf("member %s does not exist", w.Member))
	} else if err != nil {
		return plan.Retry(err)
	}
	if member.UID != old.UID || impv1.WarmPoolOf(member) != w.Pool || member.Status.NodeName != s.Node || !member.DeletionTimestamp.IsZero() {
		return plan.Fail(impv1.ReasonWarmHandoverFailed, fmt.Errorf("%s is no member of ImpWarmPool %s on node %s with UID %s, or is being deleted", w.Member, w.Pool, s.Node, w.MemberUID))
	}
	if err := record(r.Dir, vm.UID); err != nil {
		return plan.Fail(impv1.ReasonWarmHandoverFailed, err)
	}
	s.Runs.Stop(old.HostUID())
	r.Pinned = old.Digest
	return nil
}

// Foreground gives the member's VMM, restored in the background (a tenth of the CPU weight of
// a VM at work, so that a pool's refill yields to the VMs at work), a VM's default weight: from
// here on it is the claim's. A weight that cannot be set is logged, not a failure.
type Foreground struct {
	// Weigh sets the default CPU weight of the cgroup of the VMM kept under uid; nil on a node
	// whose VMMs have no cgroups of their own.
	Weigh func(uid types.UID) error
}

func (Foreground) Name() string { return "foreground" }

func (s Foreground) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	return s.Weigh != nil && r.Old != nil, nil
}

func (s Foreground) Do(ctx context.Context, r *vmrun.Run) error {
	if err := s.Weigh(r.Old.HostUID()); err != nil {
		log.FromContext(ctx).Error(err, "giving a handed member's VMM a VM's CPU weight")
	}
	return nil
}

// Identities record a run's meta (vmmdriver.Drivers).
type Identities interface {
	// Record gives m the jail uid of the run kept under m.HostUID() and writes m into dir.
	Record(dir string, m *vmrun.Meta) error
}

// Identity records the run as the claim's: the claim's namespace, name, UID, instance and run,
// and a new guest channel token, keeping the member's VMM, jail uid, disks, endpoint address
// and host UID. Until its guest takes on the claim's identity (reidentify), the guest holds the
// member's token (Restore.Token), and a restart of the agent finishes the handover as it
// finishes a restore.
type Identity struct{ IDs Identities }

func (Identity) Name() string { return "identity" }

func (Identity) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) { return r.Meta == nil, nil }

func (s Identity) Do(_ context.Context, r *vmrun.Run) error {
	vm, old := r.VM, r.Old
	token := make([]byte, 16)
	_, _ = rand.Read(token)
	m := &vmrun.Meta{Namespace: vm.Namespace, Name: vm.Name, UID: vm.UID, Host: old.HostUID(), Token: hex.EncodeToString(token),
		Instance: vm.Status.Instance, Run: vm.Status.RestartCount, Started: time.Now(), Digest: old.Digest, VMM: old.VMM,
		Session: old.Session, Readiness: vm.Spec.ReadinessProbe != nil, Endpoint: old.Endpoint,
		Trace:   tracing.Trace(vm),
		Restore: &vmrun.Restored{Snapshot: old.Restore.Snapshot, SnapshotUID: old.Restore.SnapshotUID, Token: old.Token}}
	if err := s.IDs.Record(r.Dir, m); err != nil {
		return err
	}
	r.Meta = m
	return nil
}

// Steps are the handover plan's steps that are not the plan's own.
type Steps struct {
	Member     Member
	Foreground Foreground
	Image      steps.Image
	Volumes    steps.Volumes
	Identity   Identity
	Readdress  steps.Network // its Attacher moves the rules of the tap the VMM holds
	Expose     steps.Expose
	Continue   steps.Continue
	Reidentify steps.Reidentify
}

// Plan is the handover plan of claim vm: member, foreground, image, volumes (a VM with volumes), config_disk,
// identity, network (the rules of the tap the VMM holds) and expose (a VM on a network), continue (an idle member waits paused),
// reidentify. Its failpoints are
// "handover/<step>"; each step that acts is timed in imp_agent_vm_start_step_seconds{step}.
func (s Steps) Plan(vm *impv1.ImpVM) plan.Plan[*vmrun.Run] {
	ss := []steps.Step{s.Member, s.Foreground, s.Image}
	if len(vm.Spec.Volumes) > 0 {
		ss = append(ss, s.Volumes)
	}
	ss = append(ss, steps.ConfigDisk{}, s.Identity)
	if vm.Spec.NetworkRef != nil {
		ss = append(ss, s.Readdress, s.Expose)
	}
	ss = append(ss, s.Continue, s.Reidentify)
	return plan.Plan[*vmrun.Run]{Name: "handover", Reason: impv1.ReasonWarmHandoverFailed, Steps: ss, Observe: steps.ObserveStart}
}

// Reports write a run's state (runreport.Reporter).
type Reports interface {
	Report(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error
	ReportLater(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error
}

// Runs follow a run's guest (monitor.Registry).
type Runs interface {
	Ensure(vm *impv1.ImpVM, dir string, meta *vmrun.Meta, rec *vmm.Record, conn net.Conn)
}

// Handovers hand members to their claims.
type Handovers struct {
	Steps    Steps
	Reports  Reports
	Runs     Runs
	Recorder events.EventRecorder
	// Quit makes the VMM of kind kept under uid quit.
	Quit func(ctx context.Context, kind string, uid types.UID) error
	// Tracer, when set, records the handover as the claim's start (package tracing): its
	// plan's steps beneath the agent's span of the claim's run.
	Tracer trace.Tracer
}

// Hand hands the member's run kept in dir (its meta old, its VMM rec) to claim vm, and then
// reports it running and follows it as the claim's. A handover that fails stops the member's
// VMM (its guest is never handed out as the member, nor left half the claim's) and reports the
// claim's run ended with ReasonWarmHandoverFailed, so that the operator places it again,
// restored. A run reported ended is left as it is.
func (h *Handovers) Hand(ctx context.Context, vm *impv1.ImpVM, dir string, old *vmrun.Meta, rec *vmm.Record) error {
	st := vm.Status
	if rt := st.Runtime; rt != nil && rt.Instance == st.Instance && rt.Run == st.RestartCount && rt.State != impv1.RuntimeStarting && rt.State != impv1.RuntimeRunning {
		return nil // ended (failed): the operator places it again
	}
	began := time.Now()
	r := &vmrun.Run{VM: vm, Dir: dir, Old: old, Record: rec}
	defer r.Done()
	p := h.Steps.Plan(vm)
	var took []any // each step's time, for the log
	p.Observe = func(step string, d time.Duration) {
		steps.ObserveStart(step, d)
		took = append(took, step, d.Round(100*time.Microsecond).String())
	}
	// The claim's start, as the agent's start records it: a pass that only finds the claim's
	// image still being fetched records nothing.
	span := trace.SpanFromContext(ctx)
	if f, ok := h.Steps.Image.Fetches.(interface{ Fetching(*impv1.ImpVM) bool }); h.Tracer != nil && (!ok || !f.Fetching(vm)) {
		ctx, span = tracing.RunSpan(ctx, h.Tracer, vm, tracing.SpanAgent, trace.WithAttributes(attribute.String("imp.warm.member", st.Warm.Member)))
		defer span.End()
	}
	err := p.Run(ctx, r)
	var failed *plan.Failed
	switch {
	case errors.As(err, &failed):
		span.SetStatus(codes.Error, failed.Reason)
		return h.failed(ctx, vm, dir, old, rec, failed)
	case errors.Is(err, plan.ErrWait):
		span.SetAttributes(attribute.Bool("imp.wait", true))
		return err
	case err != nil:
		span.SetStatus(codes.Error, "Retry")
		return err
	}
	steps.ObserveStart("handover", time.Since(began))
	log.FromContext(ctx).Info("handed a warm pool member over", append([]any{"member", st.Warm.Member, "took", time.Since(began).Round(100 * time.Microsecond).String()}, took...)...)
	t := metav1.NewTime(r.Meta.Started)
	running := r.Meta.Status()
	running.State, running.StartedAt = impv1.RuntimeRunning, &t
	running.Message = fmt.Sprintf("handed member %s of ImpWarmPool %s", st.Warm.Member, st.Warm.Pool)
	if err := h.Reports.ReportLater(ctx, vm, running); err != nil {
		span.SetStatus(codes.Error, "Retry")
		return err
	}
	h.Runs.Ensure(vm, dir, r.Meta, rec, r.TakeChannel())
	return nil
}

func (h *Handovers) failed(ctx context.Context, vm *impv1.ImpVM, dir string, old *vmrun.Meta, rec *vmm.Record, failed *plan.Failed) error {
	// Only a run this claim took is stopped: a run the member step refused (another VM's, or
	// taken by another claim) is left as it is.
	if c, _ := Claimant(dir); c == vm.UID && rec != nil && rec.Alive() && old != nil {
		if err := h.Quit(ctx, string(old.VMM), old.HostUID()); err != nil {
			return fmt.Errorf("stopping the VMM of a member that could not be handed over: %w", err)
		}
	}
	msg := failed.Err.Error()
	if failed.Reason != impv1.ReasonWarmHandoverFailed {
		msg = failed.Reason + ": " + msg
	}
	msg = guestchan.Sanitize(fmt.Sprintf("%s (step %s)", msg, failed.Step))
	h.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, impv1.ReasonWarmHandoverFailed, "Start", "%s", msg)
	now := metav1.Now()
	return h.Reports.Report(ctx, vm, impv1.RuntimeStatus{Instance: vm.Status.Instance, Run: vm.Status.RestartCount, State: impv1.RuntimeExited,
		Reason: impv1.ReasonWarmHandoverFailed, Message: msg, FinishedAt: &now})
}

// Locks serialise the reconciles of the VMs whose runs one state directory keeps: a member's
// and its claim's (controller-runtime serialises the reconciles of one VM, not of two). A
// reconcile that finds the directory held comes back later rather than hold a worker.
type Locks struct {
	mu   sync.Mutex
	held map[types.UID]bool
}

// TryLock locks the directory of uid and returns what unlocks it; false when it is held.
func (l *Locks) TryLock(uid types.UID) (unlock func(), ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held[uid] {
		return nil, false
	}
	if l.held == nil {
		l.held = map[types.UID]bool{}
	}
	l.held[uid] = true
	return func() {
		l.mu.Lock()
		delete(l.held, uid)
		l.mu.Unlock()
	}, true
}
