// Package agent is imp-agent's control loop: it makes its node run the ImpVMs placed on it and
// reports what it observes. It watches only VMs whose status.nodeName is its node; for each it
// runs a plan of idempotent steps (state directory, base disk of the image, the VM's writable
// disk, the VMM for the VM's current instance and run) and a monitor that turns the guest
// channel and the VMM process into status.runtime. It never writes spec, never chooses a node
// or an address, and removes a VM's VMM and state only when the API server says the VM is gone
// from its node.
package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/source"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/guestchan"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/kvm"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/preflight"
	"github.com/syscode-labs/imp/internal/agent/pullnet"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/agent/volume"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms/status,verbs=get;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impnodes,verbs=get;list;watch;create;patch
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get
// +kubebuilder:rbac:groups=imp.dev,resources=impnodes/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=authentication.k8s.io,resources=tokenreviews,verbs=create
// +kubebuilder:rbac:groups=authorization.k8s.io,resources=subjectaccessreviews,verbs=create
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Options configure an agent.
type Options struct {
	NodeName string
	// StateDir holds images/ (base disks) and vms/<uid>/ (each VM's state).
	StateDir string
	// Kernel and Initramfs boot every guest.
	Kernel, Initramfs string
	// Accel is the QEMU accelerator: kvm, tcg, or empty to probe.
	Accel string
	// ReserveVCPUs and ReserveMemory are kept for the host; the rest is offered to VMs.
	ReserveVCPUs  int32
	ReserveMemory int64
	// ReserveDisk is kept of the state directory's file system for base images, logs and the
	// node; the rest is offered to VMs' writable disks.
	ReserveDisk int64
	// VCPUOvercommit multiplies the vCPUs offered to VMs (default 1: none).
	VCPUOvercommit float64
	// InsecureRegistries may be reached over plain HTTP (loopback registries always may).
	InsecureRegistries []string
	// LocalRegistries are registries on a loopback or link-local address that images may name
	// ("host:port", or "host" for any port); InsecureRegistries count as named too. Any other
	// on such an address is refused (pullnet).
	LocalRegistries []string
	// MaxImageBytes bounds the files of one image.
	MaxImageBytes int64
	// MaxImageEntries bounds the entries of one image (disk.DefaultMaxEntries when 0).
	MaxImageEntries int64
	// ImageBuilds bound the node's image builds together: at once, bytes in flight (in all
	// and per namespace), and the free space they never write into.
	ImageBuilds disk.BuildLimits
	// RunSecretNamespace is IMP's namespace, where the operator writes each VM's run Secret:
	// the only Secrets this agent reads (runsecret.DefaultNamespace when empty).
	RunSecretNamespace string
	// FinishedDiskRetention is how long a VM that finished (Succeeded or Failed) keeps its
	// disks on the node; 0 keeps them until the VM is deleted.
	FinishedDiskRetention time.Duration
	// PullTimeout bounds resolving and pulling a VM's image from its registry, which the
	// tenant chooses (5 minutes when 0).
	PullTimeout time.Duration
	// ImageResolveTTL keeps what a tag resolved to, per credentials (disk.BaseStore.ResolveTTL).
	ImageResolveTTL time.Duration
	// ConsoleLogBytes caps each file a VM writes on the node: its console and its VMM's logs
	// (default 1 MiB).
	ConsoleLogBytes int64
	// ReportInterval is how often the ImpNode report is refreshed, and written if it changed
	// (and unused base disks are collected).
	ReportInterval time.Duration
	// HeartbeatInterval is how often the agent renews its Lease (default 10 s).
	HeartbeatInterval time.Duration
	// EndpointBlocks: the operator assigns nodes endpoint blocks (its --endpoint-cidr is set),
	// so a VM with ports waits for its node's block before it starts; without it such a VM
	// starts unexposed.
	EndpointBlocks bool
	// EndpointDrain is how long a stop of a VM that serves Services (it has an endpoint
	// address) waits, its endpoint already terminating in every slice, before the guest is asked
	// to stop, so that the cluster's proxies stop sending it connections first; it counts
	// against the grace period.
	EndpointDrain time.Duration
	// BootTimeout bounds how long a run's guest may take, from its VMM's start, to be ready
	// (its workload started); a guest that is not is stuck, and its VMM is ended (reason
	// BootTimeout) for the runStrategy to start it again. A run already reported ready is
	// never ended for it. 0 means DefaultBootTimeout; negative, no bound.
	BootTimeout time.Duration
	// StartingReportDelay is how long the reports that a run is starting, and that its guest
	// boots, wait before they are written: one that a later report overtakes meanwhile (the
	// guest ready, the start failed, the VM deleted) is never written, so a VM that boots
	// within it costs one write. Negative writes each at once; 0 means one second.
	StartingReportDelay time.Duration
	// CgroupRoot is the host's cgroup mount (cgroup.Root) where VMMs get cgroups of their own;
	// empty leaves them in the agent's (development only: they then end with the agent's pod).
	CgroupRoot string
	// NetNS is the network namespace (a path) holding the node's VM networking; empty is the
	// agent's own. Tests simulate several nodes on one machine this way.
	NetNS string
	// NetNSDir is where the networks' namespaces are pinned (hostnet.DefaultNSDir when
	// empty): a directory that outlives the agent, on a tmpfs that a reboot clears.
	NetNSDir string
	// TransitCIDR holds the transit addresses of NAT networks on the node
	// (hostnet.DefaultTransitCIDR when invalid).
	TransitCIDR netip.Prefix
	// DeniedEgress are destinations that NAT egress never reaches, beyond the node itself and
	// link-local addresses: the cluster's pod and service ranges, say.
	DeniedEgress []netip.Prefix
	// OverlayAddress is the node's underlay address for the VXLAN overlay between nodes;
	// invalid leaves the node out of the overlay (its VMs reach only VMs on the same node).
	OverlayAddress netip.Addr
	// VXLANPort is the overlay's UDP port (hostnet.DefaultVXLANPort when 0).
	VXLANPort int
	// MTU of the VMs' interfaces (hostnet.DefaultMTU when 0).
	MTU int
	// Pins are files (kernel, initramfs, firecracker, jailer) and the sha256 each must have; a
	// VM does not start while one differs.
	Pins []preflight.Pin
	// KVMDevice, Firecracker and Jailer are probed for the node's VMM capabilities.
	KVMDevice, Firecracker, Jailer string
	// VMMs, when set, are the VMMs the node offers, best first, instead of what probing finds.
	VMMs []impv1.VMMKind
	// SnapshotMemoryCache is how many bytes of snapshots' memory the node keeps for restores
	// to share (guestmem.Cache), in a cgroup of its own under CgroupRoot, out of what it offers
	// VMs: every restore of a snapshot after its first maps that memory instead of copying it.
	// 0, or no CgroupRoot, keeps none: each restore copies the memory into its own.
	SnapshotMemoryCache int64
	// JailUIDBase is the first of the 65536 uids VMMs run as, one per VM (default 300000).
	JailUIDBase int
}

// Agent runs the VMs of one node.
type Agent struct {
	Client    client.Client
	APIReader client.Reader // uncached: what the API server says now
	Recorder  EventRecorder
	Opts      Options

	images    *disk.BaseStore
	writables *disk.Writables
	volumes   volume.Maker
	vmms      []impv1.VMMCapability // what the node runs, best first
	net       *hostnet.Host
	exposer   *exposer
	networks  *networks
	reportNow chan struct{}
	fetched   chan event.GenericEvent // VMs whose image fetch is done: their start goes on
	fetches   *fetches                // images being fetched for a run: a lock of its own
	snapshots *snapshot.Store         // the node's snapshots (snapshots.go, restore.go)
	hashes    snapshot.Hashes         // of the guest kernel and initramfs, which snapshots record
	pulls     snapshotPulls           // snapshots being pulled for restores (transfer.go)
	taking    sync.Map                // VM UID → a snapshot of it is being taken: a suspension waits
	memories  *guestmem.Cache         // snapshots' memory, shared by their restores (driver.go)

	// The per-VM work under way that the reconcile workers, monitors and deferred reports
	// share. One lock, mu, guards the four maps below and the allocation of jail uids (which
	// reads the VMs' metas: identities.Record); it is held for the map operations alone, never
	// across a call to the API server, a VMM or a monitor (each monitor has its own lock), and
	// no other lock is taken under it. A VM's own reconcile is never concurrent with itself
	// (controller-runtime), so what a map holds for a VM (a stop's deadline, say) is the
	// reconcile's to change without the lock once it has it.
	mu       sync.Mutex
	monitors map[types.UID]*monitor          // a running run's monitor
	stops    map[types.UID]*vmrun.Stop       // stops in progress
	reports  map[types.NamespacedName]uint64 // reports made or begun, by VM: a later one voids a deferred one
	deferred map[types.NamespacedName]deferredReport
}

// DefaultBootTimeout is Options.BootTimeout's default: a guest boots in well under a second
// under KVM, and in seconds to a minute under emulation on a busy node.
const DefaultBootTimeout = 3 * time.Minute

// deferredReport is a report waiting for Options.StartingReportDelay: number seq of its VM's.
type deferredReport struct {
	seq uint64
	rt  impv1.RuntimeStatus
}

// CacheOptions restricts a manager's cache of ImpVMs to those placed on node.
func CacheOptions(node string) cache.Options {
	return cache.Options{ByObject: map[client.Object]cache.ByObject{
		&impv1.ImpVM{}:         {Field: fields.OneTermEqualSelector("status.nodeName", node)},
		&impv1.ImpVMSnapshot{}: {Field: fields.OneTermEqualSelector("status.nodeName", node)},
	}}
}

// SetupWithManager registers the agent with mgr, whose cache must come from CacheOptions.
func (a *Agent) SetupWithManager(mgr ctrl.Manager) error {
	if a.Opts.Accel == "" {
		a.Opts.Accel = qemu.Accel()
	}
	if a.Opts.MaxImageBytes == 0 {
		a.Opts.MaxImageBytes = 16 << 30
	}
	if a.Opts.ConsoleLogBytes == 0 {
		a.Opts.ConsoleLogBytes = 1 << 20
	}
	if a.Opts.ReportInterval == 0 {
		a.Opts.ReportInterval = 30 * time.Second
	}
	if a.Opts.RunSecretNamespace == "" {
		a.Opts.RunSecretNamespace = runsecret.DefaultNamespace
	}
	if a.Opts.HeartbeatInterval == 0 {
		a.Opts.HeartbeatInterval = 10 * time.Second
	}
	if a.Opts.StartingReportDelay == 0 {
		a.Opts.StartingReportDelay = time.Second
	}
	if a.Opts.BootTimeout == 0 {
		a.Opts.BootTimeout = DefaultBootTimeout
	}
	a.reports = map[types.NamespacedName]uint64{}
	a.deferred = map[types.NamespacedName]deferredReport{}
	if a.Opts.KVMDevice == "" {
		a.Opts.KVMDevice = kvm.Device
	}
	a.vmms = a.probeVMMs(context.Background())
	if a.Opts.PullTimeout == 0 {
		a.Opts.PullTimeout = 5 * time.Minute
	}
	a.images = &disk.BaseStore{Dir: filepath.Join(a.Opts.StateDir, "images"), MaxBytes: a.Opts.MaxImageBytes, MaxEntries: a.Opts.MaxImageEntries,
		Limits:        a.Opts.ImageBuilds,
		ResolveTTL:    a.Opts.ImageResolveTTL,
		RemoteOptions: []remote.Option{remote.WithTransport(pullnet.Transport(append(slices.Clone(a.Opts.LocalRegistries), a.Opts.InsecureRegistries...)))}}
	a.writables = &disk.Writables{Dir: filepath.Join(a.Opts.StateDir, "templates")}
	a.volumes = volume.Maker{ChooseVMM: a.chooseVMM}
	a.monitors = map[types.UID]*monitor{}
	a.stops = map[types.UID]*vmrun.Stop{}
	a.fetched = make(chan event.GenericEvent, 1024)
	a.fetches = &fetches{images: a.images, apiReader: a.APIReader, secretNS: a.Opts.RunSecretNamespace, timeout: a.Opts.PullTimeout,
		done: a.fetched, byVM: map[types.UID]*fetch{}}
	a.reportNow = make(chan struct{}, 1)
	a.snapshots = &snapshot.Store{Dir: filepath.Join(a.Opts.StateDir, "snapshots")}
	var cacheErr error
	if a.memories, cacheErr = a.memoryCache(); cacheErr != nil {
		mgr.GetLogger().Error(cacheErr, "restores copy the snapshots' memory: the cache is off")
	}
	for _, d := range []string{"vms", "net", "snapshots"} {
		if err := os.MkdirAll(filepath.Join(a.Opts.StateDir, d), 0o700); err != nil {
			return fmt.Errorf("creating the state directory: %w", err)
		}
	}
	var err error
	a.net, err = hostnet.Open(hostnet.Options{NetNS: a.Opts.NetNS, NSDir: a.Opts.NetNSDir, VTEP: a.Opts.OverlayAddress,
		VXLANPort: a.Opts.VXLANPort, MTU: a.Opts.MTU, TransitCIDR: a.Opts.TransitCIDR, DeniedEgress: a.Opts.DeniedEgress,
		StateDir: filepath.Join(a.Opts.StateDir, "net")})
	if err != nil {
		return err
	}
	a.networks = &networks{a: a}
	a.exposer = newExposer(a)
	if err := (blocks{a}).setup(mgr); err != nil {
		return err
	}
	if err := a.networks.setup(mgr); err != nil {
		return err
	}
	// Four at once: a push to a slow registry holds one worker, not every snapshot of the node.
	if err := ctrl.NewControllerManagedBy(mgr).For(&impv1.ImpVMSnapshot{}).Named("imp-agent-snapshots").
		WithOptions(controller.Options{MaxConcurrentReconciles: 4}).Complete(snapshotter{a}); err != nil {
		return err
	}
	if err := mgr.Add(reporter{a}); err != nil {
		return err
	}
	if err := mgr.Add(&heartbeat{a: a}); err != nil {
		return err
	}
	if err := mgr.Add(sweeper{a}); err != nil {
		return err
	}
	// The spare writable disks being made are finished before the agent stops.
	if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
		<-ctx.Done()
		a.writables.Stop()
		return nil
	})); err != nil {
		return err
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&impv1.ImpVM{}).
		WatchesRawSource(source.Channel(a.fetched, &handler.EnqueueRequestForObject{})).
		Named("imp-agent").
		WithOptions(controller.Options{MaxConcurrentReconciles: 4}).
		Complete(a)
}

// meta is what the agent keeps beside a VM's VMM record (vmrun.Meta).
type meta = vmrun.Meta

func (a *Agent) vmDir(uid types.UID) string {
	return filepath.Join(a.Opts.StateDir, "vms", string(uid))
}

func readMeta(dir string) (*meta, error) { return vmrun.ReadMeta(dir) }

func writeMeta(dir string, m *meta) error { return vmrun.WriteMeta(dir, m) }

// Reconcile makes the node match one VM.
func (a *Agent) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	vm := &impv1.ImpVM{}
	if err := a.Client.Get(ctx, req.NamespacedName, vm); err != nil {
		if !apierrors.IsNotFound(err) {
			return ctrl.Result{}, err
		}
		// Not in the cache of this node's VMs: ask the API server before touching anything.
		if err := a.APIReader.Get(ctx, req.NamespacedName, vm); err != nil && !apierrors.IsNotFound(err) {
			return ctrl.Result{}, err
		} else if err == nil && vm.Status.NodeName == a.Opts.NodeName {
			return ctrl.Result{Requeue: true}, nil // the cache is behind
		}
		a.mu.Lock()
		delete(a.reports, req.NamespacedName)
		delete(a.deferred, req.NamespacedName)
		a.mu.Unlock()
		return ctrl.Result{}, a.removeLeftovers(ctx, req.NamespacedName, vm)
	}
	if !vm.DeletionTimestamp.IsZero() {
		return a.teardown(ctx, vm)
	}
	if vm.Status.Phase == impv1.VMSucceeded || vm.Status.Phase == impv1.VMFailed {
		return a.retire(ctx, vm) // final: no fresh read needed
	}
	dir := a.vmDir(vm.UID)
	m, _ := readMeta(dir)
	rec, _ := vmm.ReadRecord(dir)
	alive := rec != nil && rec.Alive()
	if !alive {
		// About to start, resume or report an end: decide on what the API server says now,
		// not on a cache that may not have seen this agent's last report yet.
		if err := a.APIReader.Get(ctx, req.NamespacedName, vm); err != nil {
			return ctrl.Result{}, client.IgnoreNotFound(err)
		}
		if !vm.DeletionTimestamp.IsZero() {
			return a.teardown(ctx, vm)
		}
		if vm.Status.NodeName != a.Opts.NodeName {
			return ctrl.Result{}, nil // placed elsewhere meanwhile: the watch brings the removal
		}
	}
	st := vm.Status
	if st.Phase == impv1.VMSucceeded || st.Phase == impv1.VMFailed {
		return ctrl.Result{}, nil
	}
	current := m != nil && m.Instance == st.Instance && m.Run == st.RestartCount

	if vm.Spec.RunStrategy == impv1.RunStrategyHalted {
		a.fetches.Drop(vm.UID) // a start under way is not wanted any more
		if alive {
			if again := a.stopVMM(ctx, vm, rec); again > 0 {
				return ctrl.Result{RequeueAfter: again}, nil
			}
		}
		// The VMM is gone: its run's configuration goes before the run is reported stopped,
		// not whenever its monitor sees the exit.
		a.endRun(vm.UID)
		return ctrl.Result{}, a.report(ctx, vm, impv1.RuntimeStatus{Instance: st.Instance, Run: st.RestartCount, State: impv1.RuntimeStopped, Reason: "Halted"})
	}
	if alive && current {
		if rs := m.Restore; rs != nil && !rs.Done {
			// Restored by an agent that stopped before the guest took on its identity.
			if err := a.finishRestore(ctx, vm, dir, m, rec); err != nil || !rs.Done {
				return ctrl.Result{}, err // failed: the run is reported ended, its VMM asked to quit
			}
		}
		if rt := st.Runtime; (rt == nil || rt.Instance != st.Instance || rt.Run != st.RestartCount || rt.State == impv1.RuntimeStarting) && !a.reportedSince(vm) {
			// Started by an agent that stopped before its deferred report: the run is
			// reported now, before anything else is done with it.
			t := metav1.NewTime(m.Started)
			booting := m.Status()
			booting.State, booting.StartedAt, booting.Message = impv1.RuntimeRunning, &t, "the guest is booting"
			if err := a.report(ctx, vm, booting); err != nil {
				return ctrl.Result{}, err
			}
		}
		if st.Suspension != nil && !suspendFailed(st.Runtime) {
			if _, busy := a.taking.Load(vm.UID); busy {
				return ctrl.Result{RequeueAfter: time.Second}, nil // QEMU saves one state at a time
			}
			return ctrl.Result{}, a.suspend(ctx, vm, dir, m, rec)
		}
		a.ensureMonitor(vm, dir, m, rec, nil) // re-attach after an agent restart
		a.mu.Lock()
		delete(a.stops, vm.UID) // a stop given up (the VM runs again): the next one starts afresh
		a.mu.Unlock()
		return ctrl.Result{}, nil
	}
	if rt := st.Runtime; rt != nil && rt.Instance == st.Instance && rt.Run == st.RestartCount {
		switch rt.State {
		case impv1.RuntimeExited, impv1.RuntimeStopped, impv1.RuntimeGone:
			return ctrl.Result{}, nil // this run ended: the operator decides what comes next
		case impv1.RuntimeSuspended:
			if st.Suspension != nil {
				return ctrl.Result{}, nil
			}
			return ctrl.Result{}, a.resume(ctx, vm, dir, m)
		case impv1.RuntimeSuspending:
			// The agent stopped while suspending: finish the report from what it left.
			return ctrl.Result{}, a.finishSuspend(ctx, vm, dir)
		case impv1.RuntimeRunning:
			// Reported running, yet no live VMM of this run: it died while no monitor watched
			// (the agent was down). Say so; the runStrategy decides about a restart.
			ended := *rt
			now := metav1.Now()
			ended.State, ended.FinishedAt, ended.GuestReady = impv1.RuntimeExited, &now, false
			ended.Reason, ended.Message = "VMMExited", "the VMM exited while the agent was not watching"
			a.endRun(vm.UID)
			if tail := a.driver(recKind(rec)).logTail(dir); tail != "" {
				ended.Message += ": " + tail
			}
			return ctrl.Result{}, a.report(ctx, vm, ended)
		}
	}
	if alive { // a VMM of another run or instance: never two at once
		if again := a.stopVMM(ctx, vm, rec); again > 0 {
			return ctrl.Result{RequeueAfter: again}, nil
		}
	}
	if vm.Spec.TemplateRef != nil && vm.RestoreFrom() == "" {
		return ctrl.Result{}, nil // a copy whose template's snapshot is being made: it starts from it
	}
	if !volume.HolderReady(vm) {
		return ctrl.Result{}, nil // its claims are not attached on this node yet: its status will say
	}
	if err := a.start(ctx, vm, dir, m); errors.Is(err, errFetching) {
		return ctrl.Result{RequeueAfter: 250 * time.Millisecond}, nil
	} else if err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{}, nil
}

// retire removes the disks of a VM that finished (Succeeded or Failed) once it has been
// finished for Options.FinishedDiskRetention; its console stays for kubectl imp logs until the
// VM is deleted.
func (a *Agent) retire(ctx context.Context, vm *impv1.ImpVM) (ctrl.Result, error) {
	rt := vm.Status.Runtime
	if a.Opts.FinishedDiskRetention <= 0 || rt == nil || rt.FinishedAt == nil || rt.DisksRemoved {
		return ctrl.Result{}, nil
	}
	if left := a.Opts.FinishedDiskRetention - time.Since(rt.FinishedAt.Time); left > 0 {
		return ctrl.Result{RequeueAfter: left}, nil
	}
	dir := a.vmDir(vm.UID)
	if rec, err := vmm.ReadRecord(dir); err == nil && rec.Alive() {
		return ctrl.Result{}, nil // never under a running VMM
	}
	for _, f := range []string{"rw.ext4", configDisk, vmrun.RestoredBase} {
		if err := os.Remove(filepath.Join(dir, f)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return ctrl.Result{}, fmt.Errorf("removing the disks of finished VM %s: %w", vm.Name, err)
		}
	}
	if err := volume.Remove(dir, vm); err != nil {
		return ctrl.Result{}, fmt.Errorf("removing the disk volumes of finished VM %s: %w", vm.Name, err)
	}
	if err := a.removeJail(vm.UID); err != nil {
		return ctrl.Result{}, err
	}
	// The operator counts the disks against the node and the quota until this says they are
	// gone.
	done := *rt.DeepCopy()
	done.DisksRemoved = true
	return ctrl.Result{}, a.report(ctx, vm, done)
}

// errFetching: the run's image is still being fetched; the start resumes on a later pass.
var errFetching = errors.New("the image is being fetched")

// start runs the boot plan for the VM's current run (plans.go), then reports it and watches
// it. A step's failure ends the run as Exited with the step's reason (StartFailed,
// ImagePullFailed, ...), so the operator's runStrategy and back-off decide about retrying.
func (a *Agent) start(ctx context.Context, vm *impv1.ImpVM, dir string, old *meta) error {
	r := &vmrun.Run{VM: vm, Dir: dir, Old: old}
	defer r.Done()
	err := a.startPlan(vm, restores(vm, old)).Run(ctx, r)
	var failed *plan.Failed
	switch {
	case errors.Is(err, plan.ErrWait):
		return errFetching
	case errors.As(err, &failed):
		return a.startFailed(ctx, vm, failed.Reason, failed.Err)
	case err != nil:
		return err
	}
	startStepSeconds.WithLabelValues("total").Observe(time.Since(r.Image.Began).Seconds())
	t := metav1.NewTime(r.Meta.Started)
	started := r.Meta.Status()
	started.State, started.StartedAt, started.Message = impv1.RuntimeRunning, &t, "the guest is booting"
	if rs := r.Meta.Restore; rs != nil {
		started.Message = "restored from ImpVMSnapshot " + rs.Snapshot
	}
	if err := a.reportLater(ctx, vm, started); err != nil {
		return err
	}
	a.ensureMonitor(vm, dir, r.Meta, r.Record, r.TakeChannel())
	return nil
}

// startFailed ends the run that could not start: an Event, and the run reported Exited.
func (a *Agent) startFailed(ctx context.Context, vm *impv1.ImpVM, reason string, err error) error {
	a.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, reason, "Start", "%v", err)
	now := metav1.Now()
	// A registry's answer, the tenant's to choose, may be in err: printable, one line, bounded.
	failed := impv1.RuntimeStatus{Instance: vm.Status.Instance, Run: vm.Status.RestartCount, State: impv1.RuntimeExited,
		Reason: reason, Message: guestchan.Sanitize(err.Error()), FinishedAt: &now}
	return a.report(ctx, vm, failed)
}

// configDisk is the file, in a VM's state directory, of its current run's configuration disk.
const configDisk = vmrun.ConfigDisk

// endRun removes what only the VM's current run needed: its configuration disk (which holds
// the workload's secret values) and a suspension's saved state (a run that ended is never
// resumed, and placement no longer counts its memory), in the VM's directory and in its jail.
// The VMM is gone.
func (a *Agent) endRun(uid types.UID) {
	var err error
	for _, f := range []string{configDisk, qemu.StateFile} {
		if rerr := os.Remove(filepath.Join(a.vmDir(uid), f)); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
			err = errors.Join(err, rerr)
		}
	}
	if a.Opts.Firecracker != "" {
		err = errors.Join(err, firecracker.RemoveConfig(a.jailRoot(uid)), firecracker.RemoveSnapshot(a.jailRoot(uid)))
	}
	if err != nil {
		ctrl.Log.Error(err, "removing the configuration of an ended run", "vm", uid)
	}
}

// nameOptions lets loopback and configured registries be reached over plain HTTP.
func (a *Agent) nameOptions(image string) []name.Option {
	host, _, _ := strings.Cut(image, "/")
	h, _, _ := strings.Cut(host, ":")
	if h == "localhost" || strings.HasPrefix(h, "127.") || h == "[::1]" {
		return []name.Option{name.Insecure}
	}
	for _, r := range a.Opts.InsecureRegistries {
		if r == host {
			return []name.Option{name.Insecure}
		}
	}
	return nil
}

// reportLater makes report rt of vm after Options.StartingReportDelay, unless another report
// of the VM is made or begun meanwhile; with a negative delay, at once (its error returned).
func (a *Agent) reportLater(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error {
	if a.Opts.StartingReportDelay < 0 {
		return a.report(ctx, vm, rt)
	}
	key := client.ObjectKeyFromObject(vm)
	a.mu.Lock()
	if p, ok := a.deferred[key]; ok && p.seq == a.reports[key] && equality.Semantic.DeepEqual(p.rt, rt) {
		a.mu.Unlock()
		return nil // the same report waits already: a start that passes again (a pull under way) does not push it back
	}
	a.reports[key]++
	seq := a.reports[key]
	a.deferred[key] = deferredReport{seq: seq, rt: rt}
	a.mu.Unlock()
	obj := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: vm.Name}}
	var attempt func(n int)
	attempt = func(n int) {
		a.mu.Lock()
		current := a.reports[key] == seq
		if p, ok := a.deferred[key]; ok && p.seq == seq {
			delete(a.deferred, key)
		}
		a.mu.Unlock()
		if !current {
			return // overtaken
		}
		err := a.report(context.Background(), obj, rt) // makes a new report number of its own
		if err == nil {
			return
		}
		ctrl.Log.WithName("agent").Error(err, "reporting the VM's state", "vm", key, "attempt", n)
		if n >= 5 {
			return
		}
		a.mu.Lock()
		overtaken := a.reports[key] != seq+1 // report took seq+1; another report came after it
		seq++
		a.mu.Unlock()
		if overtaken {
			return
		}
		time.AfterFunc(time.Duration(n)*time.Second, func() { attempt(n + 1) })
	}
	time.AfterFunc(a.Opts.StartingReportDelay, func() { attempt(1) })
	return nil
}

// reportedSince: this agent process has made or deferred a report of vm since it started.
func (a *Agent) reportedSince(vm *impv1.ImpVM) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.reports[client.ObjectKeyFromObject(vm)] > 0
}

// report merge-patches status.runtime, and nothing else, when it differs.
func (a *Agent) report(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error {
	key := client.ObjectKeyFromObject(vm)
	a.mu.Lock()
	a.reports[key]++ // voids a deferred report
	a.mu.Unlock()
	if cur := vm.Status.Runtime; cur != nil && cur.Instance == rt.Instance && cur.Run == rt.Run && cur.State == rt.State &&
		cur.GuestReady == rt.GuestReady && ptr.Equal(cur.Ready, rt.Ready) && cur.Endpoint == rt.Endpoint && cur.Message == rt.Message && cur.DisksRemoved == rt.DisksRemoved {
		return nil
	}
	patch, err := RuntimePatch(rt)
	if err != nil {
		return err
	}
	obj := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: vm.Name}}
	if err := a.Client.Status().Patch(ctx, obj, client.RawPatch(types.MergePatchType, patch)); err != nil {
		if apierrors.IsNotFound(err) {
			return nil // the VM is gone: nothing to report to
		}
		return fmt.Errorf("reporting %s of %s: %w", rt.State, vm.Name, err)
	}
	vm.Status.Runtime = &rt
	return nil
}

// runtimeFields are the JSON names of status.runtime's fields.
var runtimeFields = func() []string {
	var names []string
	t := reflect.TypeFor[impv1.RuntimeStatus]()
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		names = append(names, name)
	}
	return names
}()

// RuntimePatch is the merge patch of an ImpVM's status that reports rt: it names every field
// of status.runtime, null when unset, so that the report replaces the previous one whole (a
// merge patch keeps the fields it does not name), and touches nothing else.
func RuntimePatch(rt impv1.RuntimeStatus) ([]byte, error) {
	fields := map[string]any{}
	raw, err := json.Marshal(rt)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(raw, &fields); err != nil {
		return nil, err
	}
	for _, f := range runtimeFields {
		if _, ok := fields[f]; !ok {
			fields[f] = nil
		}
	}
	return json.Marshal(map[string]any{"status": map[string]any{"runtime": fields}})
}

// stopVMM moves the VM's VMM towards stopped without waiting on it, so no worker waits out a
// tenant's grace period: it runs the stop plan (plans.go) — the guest asked to stop, its grace
// period, the VMM made to quit, then killed — and returns when to come back while the VMM runs,
// 0 once it is gone.
func (a *Agent) stopVMM(ctx context.Context, vm *impv1.ImpVM, rec *vmm.Record) time.Duration {
	grace := 30 * time.Second
	if g := vm.Spec.TerminationGracePeriodSeconds; g != nil {
		grace = time.Duration(*g) * time.Second
	}
	a.mu.Lock()
	st := a.stops[vm.UID]
	if st == nil {
		st = &vmrun.Stop{Deadline: time.Now().Add(grace)}
		if vm.Status.Runtime != nil && vm.Status.Runtime.Endpoint != "" {
			st.DrainUntil = time.Now().Add(min(a.Opts.EndpointDrain, grace))
		}
		a.stops[vm.UID] = st
	}
	a.mu.Unlock()
	st.VM, st.Record = vm, rec // one reconcile of a VM at a time: the stop is this pass's
	if err := a.stopPlan().Run(ctx, st); errors.Is(err, plan.ErrWait) {
		return plan.WaitTime(err)
	} else if err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "stopping the VMM")
		return time.Second
	}
	a.stopped(vm.UID, rec)
	return 0
}

// stopped forgets a stop that ended, with the run's monitor and configuration.
func (a *Agent) stopped(uid types.UID, rec *vmm.Record) {
	a.mu.Lock()
	delete(a.stops, uid)
	a.mu.Unlock()
	a.stopMonitor(uid)
	if !rec.Alive() {
		a.endRun(uid)
	}
}

// teardown removes a deleted VM: its VMM, its state and writable disk; then it reports Gone
// for the operator to release the VM.
func (a *Agent) teardown(ctx context.Context, vm *impv1.ImpVM) (ctrl.Result, error) {
	a.fetches.Drop(vm.UID)
	dir := a.vmDir(vm.UID)
	if rec, err := vmm.ReadRecord(dir); err == nil && rec.Alive() {
		if again := a.stopVMM(ctx, vm, rec); again > 0 {
			return ctrl.Result{RequeueAfter: again}, nil
		}
	}
	return ctrl.Result{}, a.remove(ctx, vm, dir)
}

// remove removes what is left of a deleted VM whose VMM is gone, and reports it Gone.
func (a *Agent) remove(ctx context.Context, vm *impv1.ImpVM, dir string) error {
	t := &vmrun.Teardown{UID: vm.UID, Dir: dir, Name: vm.Namespace + "/" + vm.Name}
	if err := a.teardownPlan().Run(ctx, t); err != nil {
		return err
	}
	return a.report(ctx, vm, impv1.RuntimeStatus{Instance: vm.Status.Instance, Run: vm.Status.RestartCount, State: impv1.RuntimeGone})
}

// removeLeftovers removes the local VM that a request named when the API server says it is
// gone (vm empty) or placed elsewhere.
func (a *Agent) removeLeftovers(ctx context.Context, key types.NamespacedName, vm *impv1.ImpVM) error {
	dirs, _ := filepath.Glob(filepath.Join(a.Opts.StateDir, "vms", "*"))
	for _, dir := range dirs {
		m, err := readMeta(dir)
		if err != nil || m.Namespace != key.Namespace || m.Name != key.Name {
			continue
		}
		if vm.UID == m.UID && vm.Status.NodeName == a.Opts.NodeName {
			continue
		}
		if err := a.removeLocal(ctx, dir, m); err != nil {
			return err
		}
	}
	return nil
}

// sweep checks every VM recorded on this node against the API server and removes those it says
// are gone (by UID) or placed on another node. Watches cannot report a VM that disappeared
// while the agent was down; this does, at start and then periodically.
func (a *Agent) sweep(ctx context.Context) error {
	dirs, _ := filepath.Glob(filepath.Join(a.Opts.StateDir, "vms", "*"))
	for _, dir := range dirs {
		m, err := readMeta(dir)
		if err != nil {
			if err := a.recoverState(ctx, dir, err); err != nil {
				return err
			}
			continue
		}
		vm := &impv1.ImpVM{}
		err = a.APIReader.Get(ctx, types.NamespacedName{Namespace: m.Namespace, Name: m.Name}, vm)
		switch {
		case err != nil && !apierrors.IsNotFound(err):
			return fmt.Errorf("looking up VM %s/%s: %w", m.Namespace, m.Name, err)
		case err == nil && vm.UID == m.UID && vm.Status.NodeName == a.Opts.NodeName:
			continue
		}
		if err := a.removeLocal(ctx, dir, m); err != nil {
			return err
		}
	}
	// Taps of VMs without a state directory, and networks left without taps.
	return a.net.Prune(func(uid string) bool {
		_, err := os.Stat(a.vmDir(types.UID(uid)))
		return err == nil
	})
}

// recoverState deals with a VM directory whose meta cannot be read (a crash while it was first
// written, a damaged disk): the directory is named by the VM's UID, which the API server is
// asked about. A VM of this node with that UID keeps its writable disk and console; its VMM is
// stopped and what described it removed, so that the VM's runStrategy starts it afresh, and an
// Event says so. Anything else is removed whole.
func (a *Agent) recoverState(ctx context.Context, dir string, cause error) error {
	uid := types.UID(filepath.Base(dir))
	var list impv1.ImpVMList
	if err := a.APIReader.List(ctx, &list, client.MatchingFields{"status.nodeName": a.Opts.NodeName}); err != nil {
		return fmt.Errorf("looking up the VM of %s: %w", dir, err)
	}
	var vm *impv1.ImpVM
	for i := range list.Items {
		if list.Items[i].UID == uid {
			vm = &list.Items[i]
		}
	}
	log := ctrl.LoggerFrom(ctx).WithValues("dir", dir, "cause", cause.Error())
	if vm == nil {
		if err := a.teardownPlan().Run(ctx, &vmrun.Teardown{UID: uid, Dir: dir, Name: dir}); err != nil {
			return err
		}
		log.Info("removed the unreadable state of a VM that is not on this node")
		return nil
	}
	if rec, err := vmm.ReadRecord(dir); err == nil && rec.Alive() {
		_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
		rec.WaitGone(5 * time.Second)
	}
	vmm.KillMarked(string(uid), 5*time.Second)
	a.stopMonitor(uid)
	for _, f := range []string{"meta.json", vmm.RecordFile, vmm.IntentFile, configDisk, qemu.StateFile} {
		if err := os.Remove(filepath.Join(dir, f)); err != nil && !os.IsNotExist(err) {
			return fmt.Errorf("removing %s of %s: %w", f, dir, err)
		}
	}
	a.endRun(uid)
	a.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "StateRecovered", "Recover",
		"The node's record of the VM was unreadable (%v); its VMM was stopped and it starts again with its writable disk", cause)
	log.Info("recovered a VM whose state was unreadable", "vm", vm.Namespace+"/"+vm.Name)
	// Its current run ended here: the operator's runStrategy decides about the next.
	st := vm.Status
	if rt := st.Runtime; rt != nil && rt.Instance == st.Instance && rt.Run == st.RestartCount {
		switch rt.State {
		case impv1.RuntimeExited, impv1.RuntimeStopped, impv1.RuntimeGone:
			return nil
		}
		ended := *rt
		now := metav1.Now()
		ended.State, ended.FinishedAt, ended.GuestReady, ended.ExitCode = impv1.RuntimeExited, &now, false, nil
		ended.Reason, ended.Message = "StateRecovered", "the node's record of the VM was unreadable; its VMM was stopped"
		return a.report(ctx, vm, ended)
	}
	return nil
}

// reportSoon asks the reporter for a report now rather than at its next tick.
func (a *Agent) reportSoon() {
	select {
	case a.reportNow <- struct{}{}:
	default:
	}
}

// removeLocal kills a local VM's VMM and removes its monitor, cgroups and state.
func (a *Agent) removeLocal(ctx context.Context, dir string, m *meta) error {
	t := &vmrun.Teardown{UID: m.UID, Dir: dir, Name: m.Namespace + "/" + m.Name}
	if err := a.teardownPlan().Run(ctx, t); err != nil {
		return err
	}
	ctrl.LoggerFrom(ctx).Info("removed a VM that is no longer on this node", "vm", t.Name, "uid", m.UID)
	return nil
}
