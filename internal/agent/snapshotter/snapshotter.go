// Package snapshotter is the agent's snapshot subsystem: the ImpVMSnapshots of its node taken,
// pushed and removed, the snapshots restores start from found (pulled from a registry when
// another node took them) and checked, the restored guests given their identity, the node's
// cache of snapshots' memory, and the sweep of files no snapshot owns.
package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/guestchan"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
	"github.com/syscode-labs/imp/internal/agent/monitor"
	"github.com/syscode-labs/imp/internal/agent/pullnet"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmmdriver"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvmsnapshots,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmsnapshots/status,verbs=get;patch

var (
	snapshotPauseSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "imp_agent_snapshot_pause_seconds", Help: "Time a running VM was paused to take its snapshot.",
		Buckets: prometheus.ExponentialBuckets(0.01, 2, 12)})
	snapshotFailures = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "imp_agent_snapshot_failures_total", Help: "Snapshots that could not be taken (their VMs ran on)."})
)

func init() { metrics.Registry.MustRegister(snapshotPauseSeconds, snapshotFailures) }

// Snapshotter is the node's snapshots: it takes the ImpVMSnapshots the operator gave this node
// and removes their files when they are deleted (it only ever writes a snapshot's status),
// pushes them to their registries, finds and pulls the snapshot a restore starts from, gives a
// restored guest its identity, and sweeps the files of snapshots that are no more. It holds the
// node's store and the cache of snapshots' memory that restores share.
type Snapshotter struct {
	Client    client.Client
	APIReader client.Reader // uncached: what the API server says now
	Recorder  events.EventRecorder
	NodeName  string
	// SecretNamespace is IMP's namespace, where each snapshot's key Secret is.
	SecretNamespace string
	// PullTimeout bounds a push or a pull.
	PullTimeout time.Duration
	// MaxImageBytes bounds an image's files, and so a pulled snapshot's base disk.
	MaxImageBytes int64
	// Kernel and Initramfs boot the guests, and a snapshot records their hashes.
	Kernel, Initramfs string
	// InsecureRegistries may be reached over plain HTTP.
	InsecureRegistries []string
	Store              *snapshot.Store
	// Images is the node's base disks: a snapshot keeps the one its VM runs on, and is reached
	// with their registry options.
	Images   *disk.BaseStore
	Drivers  Drivers
	Runs     Runs
	Memories *guestmem.Cache
	// Wake has a VM's start looked at again: the snapshot it waits for was pulled (or not).
	Wake func(*impv1.ImpVM)

	hashes snapshot.Hashes // of the guest kernel and initramfs
	pulls  snapshotPulls
	taking sync.Map // VM UID → a snapshot of it is being taken: a suspension waits
}

// Drivers are the node's VMM drivers, as the snapshots use them.
type Drivers interface {
	For(kind string) vmmdriver.Driver
	ChooseVMM(vm *impv1.ImpVM) (impv1.VMMKind, error)
	Capabilities() []impv1.VMMCapability
	VMDir(uid types.UID) string
	Continue(ctx context.Context, uid types.UID, rec *vmm.Record) error
}

// Runs freeze a running VM's workload (monitor.Registry).
type Runs interface {
	Freeze(key types.NamespacedName, uid types.UID) (thaw func(), err error)
}

// SetupWithManager has mgr run the snapshots of the node, four at once: a push to a slow
// registry holds one worker, not every snapshot of the node.
func (s *Snapshotter) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).For(&impv1.ImpVMSnapshot{}).Named("imp-agent-snapshots").
		WithOptions(controller.Options{MaxConcurrentReconciles: 4}).Complete(s)
}

// Busy says whether a snapshot of the VM is being taken: a suspension waits for it (QEMU saves
// one state at a time).
func (s *Snapshotter) Busy(uid types.UID) bool {
	_, busy := s.taking.Load(uid)
	return busy
}

// Reconcile takes, or removes, one snapshot of this node.
func (s *Snapshotter) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	snap := &impv1.ImpVMSnapshot{}
	if err := s.Client.Get(ctx, req.NamespacedName, snap); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if snap.Status.NodeName != s.NodeName {
		return ctrl.Result{}, nil
	}
	if !snap.DeletionTimestamp.IsZero() {
		if snap.Status.FilesRemoved {
			return ctrl.Result{}, nil
		}
		if err := s.remove(snap.UID); err != nil {
			return ctrl.Result{}, fmt.Errorf("removing the files of ImpVMSnapshot %s: %w", snap.Name, err)
		}
		return ctrl.Result{}, s.patch(ctx, snap, func(st *impv1.ImpVMSnapshotStatus) { st.FilesRemoved = true })
	}
	// What to do is decided on what the API server says now: the cache may not have this
	// agent's last report yet, and a snapshot is taken once.
	if err := s.APIReader.Get(ctx, req.NamespacedName, snap); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if snap.Status.NodeName != s.NodeName || !snap.DeletionTimestamp.IsZero() {
		return ctrl.Result{Requeue: true}, nil
	}
	switch snap.Status.Phase {
	case impv1.SnapshotReady:
		if snap.Spec.Registry != nil && snap.Status.Digest == "" {
			return ctrl.Result{}, s.push(ctx, snap)
		}
		return ctrl.Result{}, nil
	case impv1.SnapshotFailed:
		return ctrl.Result{}, nil
	case impv1.SnapshotTaking:
		// An agent stopped while taking it: its VM may be left paused. It runs on first.
		if err := s.unpause(ctx, snap); err != nil {
			return ctrl.Result{}, err
		}
		if man, err := s.Store.Read(snap.UID); err == nil {
			return ctrl.Result{}, s.ready(ctx, snap, nil, man) // taken, not yet reported
		}
	}
	return ctrl.Result{}, s.take(ctx, snap)
}

// take snapshots the VM: a running one paused for the time it takes, a suspended one from its
// saved state. A snapshot that cannot be taken fails with its reason; the VM runs on.
func (s *Snapshotter) take(ctx context.Context, snap *impv1.ImpVMSnapshot) error {
	vm, m, running, why := s.source(ctx, snap)
	if why != "" {
		return s.fail(ctx, snap, nil, impv1.ReasonSnapshotVMNotRunning, errors.New(why))
	}
	if slices.ContainsFunc(vm.Spec.Volumes, func(v impv1.Volume) bool { return v.Disk() }) {
		return s.fail(ctx, snap, nil, impv1.ReasonSnapshotVMHasDisks,
			fmt.Errorf("ImpVM %s has disk volumes (emptyDisk), which a snapshot does not hold: its copies would run on another disk than their memory knows", vm.Name))
	}
	if vm.Spec.Boot == impv1.BootOS {
		return s.fail(ctx, snap, nil, impv1.ReasonSnapshotVMBootsAnOS,
			fmt.Errorf("ImpVM %s boots an OS (spec.boot OS): its snapshots are not built yet (the guest cannot freeze it for one, nor a copy take a new identity; docs/os.md)", vm.Name))
	}
	// One snapshot of a VM at a time, and no suspension meanwhile (QEMU saves one state at a
	// time; two freezes of one workload would thaw it under each other): from here until its
	// VM runs on.
	if _, busy := s.taking.LoadOrStore(vm.HostUID(), struct{}{}); busy {
		return fmt.Errorf("another snapshot of VM %s is being taken", vm.Name) // tried again
	}
	release := sync.OnceFunc(func() { s.taking.Delete(vm.HostUID()) })
	defer release()
	// Taking, with the optimistic lock: of two passes on one version, one takes it.
	orig := snap.DeepCopy()
	snap.Status.Phase, snap.Status.Reason, snap.Status.Message = impv1.SnapshotTaking, "", "saving the VM's memory, devices and disk"
	if err := s.Client.Status().Patch(ctx, snap, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("reporting ImpVMSnapshot %s taking: %w", snap.Name, err)
	}
	host, err := s.host(m.VMM)
	if err != nil {
		return s.fail(ctx, snap, vm, impv1.ReasonSnapshotTakeFailed, err)
	}
	tmp, err := s.Store.Begin(snap.UID)
	if err != nil {
		return s.fail(ctx, snap, vm, impv1.ReasonSnapshotTakeFailed, err)
	}
	// Thawed as soon as the VM runs on, not once its memory is copied out (seconds, for a
	// large guest, while its probes would wait on it), and in any case.
	thaw := sync.OnceFunc(s.freeze(vm, running))
	taken := time.Now()
	pause, err := s.Drivers.For(string(m.VMM)).Snapshot(ctx, vm, s.Drivers.VMDir(vm.HostUID()), m, running, tmp, thaw)
	thaw()
	release()
	if err != nil {
		_ = s.remove(snap.UID)
		return s.fail(ctx, snap, vm, impv1.ReasonSnapshotTakeFailed, err)
	}
	image, err := s.imageByDigest(vm.Workload().Image, m.Digest)
	if err == nil {
		err = s.keepBase(vm, m, tmp)
	}
	if err != nil {
		_ = s.remove(snap.UID)
		return s.fail(ctx, snap, vm, impv1.ReasonSnapshotTakeFailed, err)
	}
	res := vm.Status.Resources
	man := &snapshot.Manifest{Namespace: snap.Namespace, Name: snap.Name, UID: snap.UID, VMUID: vm.UID, Host: host,
		Image: image, VCPUs: res.VCPUs, MemoryMiB: res.Memory.Value() >> 20, DiskBytes: res.DiskSize.Value(),
		Network: vm.Spec.NetworkRef != nil, Session: m.Session, Token: m.Token, Taken: taken, Pause: pause}
	if err := s.Store.Commit(tmp, man); err != nil {
		_ = s.remove(snap.UID)
		return s.fail(ctx, snap, vm, impv1.ReasonSnapshotTakeFailed, err)
	}
	if running {
		snapshotPauseSeconds.Observe(pause.Seconds())
	}
	return s.ready(ctx, snap, vm, man)
}

// ready reports a snapshot taken (its files in the store, described by man) Ready, with an
// Event on its VM when it has it, and pushes it when it has a registry.
func (s *Snapshotter) ready(ctx context.Context, snap *impv1.ImpVMSnapshot, vm *impv1.ImpVM, man *snapshot.Manifest) error {
	size, err := s.Store.Size(snap.UID)
	if err != nil {
		return err
	}
	t := metav1.NewTime(man.Taken)
	if err := s.patch(ctx, snap, func(st *impv1.ImpVMSnapshotStatus) {
		st.Phase, st.Reason = impv1.SnapshotReady, ""
		st.Message = fmt.Sprintf("taken of VM %s on node %s", snap.Spec.VMName, s.NodeName)
		st.TakenAt, st.PauseMilliseconds, st.Size = &t, man.Pause.Milliseconds(), resource.NewQuantity(size, resource.BinarySI)
		st.Source = &impv1.SnapshotSource{VMUID: man.VMUID, Image: man.Image, VMM: man.Host.VMM, VMMVersion: man.Host.VMMVersion,
			VCPUs: man.VCPUs, Memory: *resource.NewQuantity(man.MemoryMiB<<20, resource.BinarySI),
			DiskSize: *resource.NewQuantity(man.DiskBytes, resource.BinarySI), Network: man.Network}
		apimeta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: impv1.SnapshotReadyCondition, Status: metav1.ConditionTrue,
			Reason: string(impv1.SnapshotReady), Message: st.Message, ObservedGeneration: snap.Generation})
	}); err != nil {
		return err
	}
	if vm != nil {
		s.Recorder.Eventf(vm, snap, corev1.EventTypeNormal, "Snapshotted", "Snapshot", "ImpVMSnapshot %s taken (%s; the VM was paused %v)",
			snap.Name, resource.NewQuantity(size, resource.BinarySI), man.Pause.Round(time.Millisecond))
	}
	if snap.Spec.Registry != nil {
		return s.push(ctx, snap)
	}
	return nil
}

// ReasonNotFrozen is the Event of a snapshot or a suspension whose workload the guest did not
// freeze.
const ReasonNotFrozen = "WorkloadNotFrozen"

// freeze has a running VM's guest freeze its workload for the snapshot (a suspended VM's was
// frozen when it was suspended) and returns what thaws it. A copy's guest thaws it only once it
// is the copy (guestinit), so no copy runs a step of the workload with the source's identity
// and random state. A workload that could not be frozen is told in an Event.
func (s *Snapshotter) freeze(vm *impv1.ImpVM, running bool) (thaw func()) {
	if !running {
		return func() {}
	}
	thaw, err := s.Runs.Freeze(types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}, vm.HostUID())
	if err != nil && !errors.Is(err, monitor.ErrNotRunning) {
		s.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, ReasonNotFrozen, "Snapshot",
			"The snapshot is taken with the workload running (%v): its copies run it as this VM, with what it drew, until each takes on its identity", err)
	}
	return thaw
}

// source is the snapshot's VM on this node, its meta and whether it runs (else it is
// suspended), or why there is none to take.
func (s *Snapshotter) source(ctx context.Context, snap *impv1.ImpVMSnapshot) (*impv1.ImpVM, *vmrun.Meta, bool, string) {
	vm := &impv1.ImpVM{}
	if err := s.APIReader.Get(ctx, types.NamespacedName{Namespace: snap.Namespace, Name: snap.Spec.VMName}, vm); err != nil {
		return nil, nil, false, fmt.Sprintf("ImpVM %s: %v", snap.Spec.VMName, err)
	}
	rt, st := vm.Status.Runtime, vm.Status
	if st.NodeName != s.NodeName || rt == nil || st.Resources == nil || !vm.DeletionTimestamp.IsZero() {
		return nil, nil, false, fmt.Sprintf("ImpVM %s does not run on node %s", vm.Name, s.NodeName)
	}
	dir := s.Drivers.VMDir(vm.HostUID())
	m, err := vmrun.ReadMeta(dir)
	if err != nil || m.UID != vm.UID || m.Instance != st.Instance || m.Run != st.RestartCount {
		return nil, nil, false, fmt.Sprintf("ImpVM %s has no current run on node %s", vm.Name, s.NodeName)
	}
	rec, _ := vmm.ReadRecord(dir)
	switch {
	case rt.State == impv1.RuntimeRunning && rec != nil && rec.Alive() && rt.GuestReady:
		return vm, m, true, ""
	case rt.State == impv1.RuntimeSuspended && s.Drivers.For(string(m.VMM)).Saved(vm, dir, m):
		return vm, m, false, ""
	}
	return nil, nil, false, fmt.Sprintf("ImpVM %s is neither running with its guest ready nor suspended (%s)", vm.Name, rt.State)
}

// unpause runs on the VM of a snapshot whose taking an agent did not see through.
func (s *Snapshotter) unpause(ctx context.Context, snap *impv1.ImpVMSnapshot) error {
	vm := &impv1.ImpVM{}
	if err := s.APIReader.Get(ctx, types.NamespacedName{Namespace: snap.Namespace, Name: snap.Spec.VMName}, vm); err != nil {
		return client.IgnoreNotFound(err)
	}
	if _, busy := s.taking.Load(vm.HostUID()); busy {
		return nil // another snapshot of it is being taken, and runs it on itself
	}
	dir := s.Drivers.VMDir(vm.HostUID())
	rec, err := vmm.ReadRecord(dir)
	if err != nil || !rec.Alive() {
		return nil
	}
	if err := s.Drivers.Continue(ctx, vm.HostUID(), rec); err != nil {
		return fmt.Errorf("running on VM %s after a snapshot left unfinished: %w", vm.Name, err)
	}
	return nil
}

func (s *Snapshotter) fail(ctx context.Context, snap *impv1.ImpVMSnapshot, vm *impv1.ImpVM, reason string, err error) error {
	snapshotFailures.Inc()
	msg := guestchan.Sanitize(err.Error())
	if vm != nil {
		s.Recorder.Eventf(vm, snap, corev1.EventTypeWarning, reason, "Snapshot", "ImpVMSnapshot %s failed; the VM runs on: %s", snap.Name, msg)
	}
	return s.patch(ctx, snap, func(st *impv1.ImpVMSnapshotStatus) {
		st.Phase, st.Reason, st.Message = impv1.SnapshotFailed, reason, msg
		apimeta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: impv1.SnapshotReadyCondition, Status: metav1.ConditionFalse,
			Reason: reason, Message: msg, ObservedGeneration: snap.Generation})
	})
}

// patch changes the snapshot's status with change, as a merge patch.
func (s *Snapshotter) patch(ctx context.Context, snap *impv1.ImpVMSnapshot, change func(*impv1.ImpVMSnapshotStatus)) error {
	orig := snap.DeepCopy()
	change(&snap.Status)
	if err := s.Client.Status().Patch(ctx, snap, client.MergeFrom(orig)); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("reporting ImpVMSnapshot %s: %w", snap.Name, err)
	}
	return nil
}

// RunBase is the base disk the VM's current run runs on: the snapshot's it was restored from
// (never the node's disk of the image in its place: its memory knows the snapshot's blocks), or
// the node's disk of its image.
func (s *Snapshotter) RunBase(vm *impv1.ImpVM, dir string, m *vmrun.Meta) (string, error) {
	if m.Restore != nil {
		return filepath.Join(dir, vmrun.RestoredBase), nil
	}
	ref, err := s.digestRef(vm.Workload().Image, m.Digest)
	if err != nil {
		return "", err
	}
	return s.Images.Path(ref), nil
}

// keepBase puts the base disk the VM runs on in the snapshot being taken in tmp, read-only.
func (s *Snapshotter) keepBase(vm *impv1.ImpVM, m *vmrun.Meta, tmp string) error {
	base, err := s.RunBase(vm, s.Drivers.VMDir(vm.HostUID()), m)
	if err != nil {
		return err
	}
	if err := snapshot.LinkDisk(base, filepath.Join(tmp, snapshot.BaseFile)); err != nil {
		return fmt.Errorf("keeping the base disk: %w", err)
	}
	return nil
}

// imageByDigest is image's repository at digest.
func (s *Snapshotter) imageByDigest(image, digest string) (string, error) {
	ref, err := s.digestRef(image, digest)
	if err != nil {
		return "", err
	}
	return ref.String(), nil
}

// digestRef is image's repository at digest.
func (s *Snapshotter) digestRef(image, digest string) (name.Digest, error) {
	ref, err := name.ParseReference(image, pullnet.NameOptions(image, s.InsecureRegistries)...)
	if err != nil {
		return name.Digest{}, err
	}
	return ref.Context().Digest(digest), nil
}
