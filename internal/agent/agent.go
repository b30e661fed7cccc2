// Package agent is imp-agent's control loop: it makes its node run the ImpVMs placed on it and
// reports what it observes. It watches only VMs whose status.nodeName is its node, and for each
// it reads what the API says of the VM (placed, halted, suspended, deleted, a new run, a
// restore) and runs one plan of idempotent steps (plans.go: start, resume, suspend, stop,
// teardown, finishing a restore). It never writes spec, never chooses a node or an address, and
// removes a VM's VMM and state only when the API server says the VM is gone from its node.
//
// What has state of its own lives in a package named for what it provides, each with its own
// lock, handed to the steps as small interfaces (docs/agent.md draws them): the VMM drivers and
// jails (vmmdriver), the monitors of running guests (monitor), the reports of runs (runreport),
// the snapshots (snapshotter), the image fetches (imagefetch), the node's networks (nodenet)
// and the node report and heartbeat (nodereport).
package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"go.opentelemetry.io/otel/trace"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/source"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/accesscredentials"
	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/egressproxy"
	"github.com/syscode-labs/imp/internal/agent/handover"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/idle"
	"github.com/syscode-labs/imp/internal/agent/imagefetch"
	"github.com/syscode-labs/imp/internal/agent/migration"
	"github.com/syscode-labs/imp/internal/agent/monitor"
	"github.com/syscode-labs/imp/internal/agent/netpolicy"
	"github.com/syscode-labs/imp/internal/agent/nodenet"
	"github.com/syscode-labs/imp/internal/agent/nodereport"
	"github.com/syscode-labs/imp/internal/agent/pullnet"
	"github.com/syscode-labs/imp/internal/agent/runreport"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/snapshotter"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/vmmdriver"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/agent/vmstats"
	"github.com/syscode-labs/imp/internal/agent/volume"
	"github.com/syscode-labs/imp/internal/agent/wake"
	"github.com/syscode-labs/imp/internal/tracing"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms/status,verbs=get;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmmigrations,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmmigrations/status,verbs=get;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impnodes,verbs=get;list;watch;create;patch
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get
// +kubebuilder:rbac:groups=imp.dev,resources=impnodes/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=authentication.k8s.io,resources=tokenreviews,verbs=create
// +kubebuilder:rbac:groups=authorization.k8s.io,resources=subjectaccessreviews,verbs=create
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Agent runs the VMs of one node.
type Agent struct {
	Client    client.Client
	APIReader client.Reader // uncached: what the API server says now
	Recorder  EventRecorder
	Opts      Options

	// Runs are the monitors of the node's running runs: their guest channels, consoles and
	// session channels (what the access server serves).
	Runs *monitor.Registry
	// Sessions counts the access server's sessions to each VM (Sessions.Wrap its handler):
	// an open one keeps a VM with an idle policy from being idle.
	Sessions *idle.Sessions
	// Figures are each running VM's figures, as the access server serves them (GET .../stats).
	Figures vmstats.Serving

	reports   *runreport.Reporter
	drivers   *vmmdriver.Drivers
	snapshots *snapshotter.Snapshotter
	fetches   *imagefetch.Fetches
	fetched   chan event.GenericEvent // VMs whose image or snapshot fetch is done: their start goes on
	node      *nodereport.Reporter
	networks  *nodenet.Networks
	exposer   *nodenet.Exposer
	net       *hostnet.Host
	writables *disk.Writables
	volumes   volume.Maker
	handovers *handover.Handovers
	idle      *idle.StandIns
	// migrations is the node's side of VMs moving from and to it (nil: it takes part in none).
	migrations *migration.Source
	// hosts serialise the reconciles of the VMs whose runs one state directory keeps (a warm
	// pool member's and its claim's).
	hosts handover.Locks
	// tracer starts the spans of the VMs' starts (Options.Traces).
	tracer trace.Tracer

	// stops are the stops in progress, by VM, under mu (for the map's operations alone). A
	// VM's own reconcile is never concurrent with itself (controller-runtime), so a stop's
	// deadline is the reconcile's to change without the lock once it has it.
	mu    sync.Mutex
	stops map[types.UID]*vmrun.Stop
}

// CacheOptions restricts a manager's cache of ImpVMs to those placed on node.
func CacheOptions(node string) cache.Options {
	migrations, byTarget := migration.CacheByObject(node)
	return cache.Options{ByObject: map[client.Object]cache.ByObject{
		&impv1.ImpVM{}:         {Field: fields.OneTermEqualSelector("status.nodeName", node)},
		&impv1.ImpVMSnapshot{}: {Field: fields.OneTermEqualSelector("status.nodeName", node)},
		migrations:             byTarget,
	}}
}

// SetupWithManager makes the agent's parts and registers them and the agent with mgr, whose
// cache must come from CacheOptions.
func (a *Agent) SetupWithManager(mgr ctrl.Manager) error {
	o := &a.Opts
	o.defaults()
	a.tracer = o.Traces.Tracer(tracing.AgentScope)
	for _, d := range []string{"vms", "net", "snapshots"} {
		if err := os.MkdirAll(filepath.Join(o.StateDir, d), 0o700); err != nil {
			return fmt.Errorf("creating the state directory: %w", err)
		}
	}
	memories, err := snapshotter.NewMemoryCache(o.CgroupRoot, o.NodeName, o.SnapshotMemoryCache)
	if err != nil {
		mgr.GetLogger().Error(err, "restores copy the snapshots' memory: the cache is off")
	}
	a.drivers = vmmdriver.New(context.Background(), vmmdriver.Config{NodeName: o.NodeName, StateDir: o.StateDir, Kernel: o.Kernel,
		Initramfs: o.Initramfs, Accel: o.Accel, CgroupRoot: o.CgroupRoot, NetNS: o.NetNS, KVMDevice: o.KVMDevice, Firecracker: o.Firecracker,
		Jailer: o.Jailer, VMMs: o.VMMs, JailUIDBase: o.JailUIDBase, Memories: memories})
	images := &disk.BaseStore{Dir: filepath.Join(o.StateDir, "images"), MaxBytes: o.MaxImageBytes, MaxEntries: o.MaxImageEntries,
		Limits: o.ImageBuilds, ResolveTTL: o.ImageResolveTTL,
		RemoteOptions: []remote.Option{remote.WithTransport(pullnet.Transport(append(slices.Clone(o.LocalRegistries), o.InsecureRegistries...)))}}
	a.writables = &disk.Writables{Dir: filepath.Join(o.StateDir, "templates")}
	a.volumes = volume.Maker{ChooseVMM: a.drivers.ChooseVMM}
	a.fetched = make(chan event.GenericEvent, 1024)
	a.fetches = imagefetch.New(images, a.APIReader, o.RunSecretNamespace, o.PullTimeout, a.fetched)
	a.reports = runreport.New(a.Client, o.StartingReportDelay)
	a.stops = map[types.UID]*vmrun.Stop{}
	a.Runs = &monitor.Registry{Drivers: a.drivers, Recorder: a.Recorder, Report: a.reports.ReportRun, EndRun: a.endRun,
		ConsoleLogBytes: o.ConsoleLogBytes, BootTimeout: o.BootTimeout, Tracer: o.Traces.Tracer(tracing.AgentScope)}
	a.snapshots = &snapshotter.Snapshotter{Client: a.Client, APIReader: a.APIReader, Recorder: a.Recorder, NodeName: o.NodeName,
		SecretNamespace: o.RunSecretNamespace, PullTimeout: o.PullTimeout, MaxImageBytes: o.MaxImageBytes, Kernel: o.Kernel, Initramfs: o.Initramfs,
		InsecureRegistries: o.InsecureRegistries, Store: &snapshot.Store{Dir: filepath.Join(o.StateDir, "snapshots")}, Images: images,
		Drivers: a.drivers, Runs: a.Runs, Memories: memories, Wake: func(vm *impv1.ImpVM) { a.fetched <- event.GenericEvent{Object: vm} }}
	if a.net, err = hostnet.Open(hostnet.Options{NetNS: o.NetNS, NSDir: o.NetNSDir, VTEP: o.OverlayAddress, VXLANPort: o.VXLANPort, MTU: o.MTU,
		TransitCIDR: o.TransitCIDR, DeniedEgress: o.DeniedEgress, StateDir: filepath.Join(o.StateDir, "net")}); err != nil {
		return err
	}
	a.node = &nodereport.Reporter{Client: a.Client, APIReader: a.APIReader, NodeName: o.NodeName, StateDir: o.StateDir,
		ReserveVCPUs: o.ReserveVCPUs, ReserveMemory: o.ReserveMemory, ReserveDisk: o.ReserveDisk, VCPUOvercommit: o.VCPUOvercommit,
		Accel: o.Accel, Kernel: o.Kernel, Initramfs: o.Initramfs, OverlayAddress: o.OverlayAddress, VMMs: a.drivers.Capabilities(),
		Interval: o.ReportInterval, Images: images, Features: []string{impv1.FeatureWarmHandover}}
	if memories != nil {
		a.node.Held = o.SnapshotMemoryCache // the cache's memory is not offered to VMs
	}
	if o.Firecracker != "" {
		a.node.JailRoot = a.drivers.JailRoot
	}
	a.networks = &nodenet.Networks{Client: a.Client, APIReader: a.APIReader, Recorder: a.Recorder, NodeName: o.NodeName, Net: a.net, Changed: a.node.Soon}
	a.node.Networks = a.networks
	a.exposer = &nodenet.Exposer{Client: a.Client, Recorder: a.Recorder, NodeName: o.NodeName, StateDir: o.StateDir, Net: a.net, EndpointBlocks: o.EndpointBlocks}
	a.exposer.Init()
	if err := (nodenet.Blocks{Client: a.Client, NodeName: o.NodeName, Net: a.net}).SetupWithManager(mgr); err != nil {
		return err
	}
	if err := a.networks.SetupWithManager(mgr); err != nil {
		return err
	}
	policies := &netpolicy.Enforcer{Client: a.Client, Net: a.net, Networks: a.networks, Recorder: a.Recorder, Fleet: a.networks.Fleet()}
	if err := policies.SetupWithManager(mgr); err != nil {
		return err
	}
	a.networks.Policies = policies
	a.networks.Domains = &egressproxy.Proxies{Host: a.net, Nameserver: o.EgressNameserver, Decided: egressproxy.Reporter{Client: a.Client, Recorder: a.Recorder}.Decided}
	if err := a.snapshots.SetupWithManager(mgr); err != nil {
		return err
	}
	insecure := o.InsecureRegistries
	var weigh func(types.UID) error
	if root := o.CgroupRoot; root != "" {
		weigh = func(uid types.UID) error { return cgroup.SetWeight(root, string(uid), cgroup.DefaultWeight) }
	}
	a.handovers = &handover.Handovers{Reports: a.reports, Runs: a.Runs, Recorder: a.Recorder, Quit: stoppers{a.Runs, a.drivers}.Quit, Tracer: a.tracer,
		Steps: handover.Steps{
			Member: handover.Member{Cache: a.Client, API: a.APIReader, Node: o.NodeName, Runs: a.Runs}, Foreground: handover.Foreground{Weigh: weigh},
			Image: steps.Image{Fetches: a.fetches, Reports: a.reports, FetchWait: imagefetch.FetchWait,
				NameOptions: func(image string) []name.Option { return pullnet.NameOptions(image, insecure) }},
			Volumes: steps.Volumes{Maker: a.volumes}, Identity: handover.Identity{IDs: a.drivers},
			Readdress: steps.Network{Attacher: nodenet.Readdressing{Networks: a.networks}}, Expose: steps.Expose{Exposer: a.exposer},
			Continue: steps.Continue{Continuers: a.drivers}, Reidentify: steps.Reidentify{Guests: a.snapshots},
		}}
	// Each VM's figures (imp_vm_*), while the manager runs, and for the access server; the
	// node's taps read at most once a second, however often they are asked for.
	taps := vmstats.Cached(a.net, time.Second)
	if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
		defer vmstats.Add(a.Runs, taps)()
		<-ctx.Done()
		return nil
	})); err != nil {
		return err
	}
	a.Sessions = &idle.Sessions{}
	a.Figures = vmstats.Serving{Registry: a.Runs, Taps: taps}
	a.idle = &idle.StandIns{Taps: nodenet.Tapping{Networks: a.networks}, API: a.APIReader, Reports: a.reports, Recorder: a.Recorder,
		Limits: wake.Limits{Node: wake.NewBudget(o.IdleHeldBytes)}, Bound: o.IdleWakeTimeout, MemAvailable: o.MemAvailable,
		Log: mgr.GetLogger().WithName("idle")}
	meter := &idle.Meter{Client: a.Client, Traffic: a.networks, Sessions: a.Sessions, Reports: a.reports, Interval: o.IdleInterval,
		Log: mgr.GetLogger().WithName("idle")}
	if o.MigrationAddr != "" && o.MigrationIdentity != nil {
		if err := setupMigrations(a, mgr); err != nil {
			return err
		}
	}
	keys := &accesscredentials.Giver{Client: a.Client, APIReader: a.APIReader, Namespace: o.RunSecretNamespace, NodeName: o.NodeName,
		Sessions: a.Runs, Recorder: a.Recorder}
	if err := keys.SetupWithManager(mgr); err != nil {
		return err
	}
	heartbeat := &nodereport.Heartbeat{Client: a.Client, APIReader: a.APIReader, Namespace: o.RunSecretNamespace, NodeName: o.NodeName, Interval: o.HeartbeatInterval}
	for _, r := range []manager.Runnable{a.node, heartbeat, sweeper{a}, meter,
		// The spare writable disks being made are finished before the agent stops.
		manager.RunnableFunc(func(ctx context.Context) error {
			<-ctx.Done()
			a.writables.Stop()
			return nil
		})} {
		if err := mgr.Add(r); err != nil {
			return err
		}
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&impv1.ImpVM{}).
		WatchesRawSource(source.Channel(a.fetched, &handler.EnqueueRequestForObject{})).
		Named("imp-agent").
		WithOptions(controller.Options{MaxConcurrentReconciles: 4}).
		Complete(a)
}

// vmDir is the state directory of the VM with uid.
func (a *Agent) vmDir(uid types.UID) string { return a.drivers.VMDir(uid) }
