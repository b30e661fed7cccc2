package agent

import (
	"net/netip"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"k8s.io/client-go/tools/events"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/preflight"
	"github.com/syscode-labs/imp/internal/agent/transfer"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder = events.EventRecorder

// Options configure an agent.
type Options struct {
	NodeName string
	// MigrationAddr is where the agent takes migrations (host:port to listen on), and
	// MigrationEndpoint where other nodes' agents reach it (reported on its ImpNode); with
	// MigrationIdentity (its certificate and its peers' CA) they make the node a migration's
	// source or target (package migration). Unset: the node takes part in none.
	MigrationAddr, MigrationEndpoint string
	MigrationIdentity                transfer.Identity
	// MigrationBandwidth bounds, in bytes a second, what the node's migration streams send
	// together (0: unbounded).
	MigrationBandwidth int64
	// IdleWakeTimeout is how long what arrives for an idle-suspended VM is held for it to be
	// woken before it is refused (default 30s); IdleInterval how often the activity of VMs
	// with an idle policy is read (default 2s). See package idle.
	IdleWakeTimeout, IdleInterval time.Duration
	// IdleHeldBytes bounds what the node holds for all its idle-suspended VMs together
	// (default 64 MiB; each VM at most 4 MiB).
	IdleHeldBytes int64
	// MemAvailable is the node's memory available to wake an idle VM into (default: /proc/
	// meminfo's MemAvailable); a VM that would not fit is not woken.
	MemAvailable func() (int64, error)
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
	// EgressNameserver ("host:port") is the DNS server the domain egress proxy asks; empty,
	// the node's resolv.conf's.
	EgressNameserver string
	// Traces is where the spans of the VMs' starts go (package tracing); nil: nowhere.
	Traces trace.TracerProvider
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

// DefaultBootTimeout is Options.BootTimeout's default: a guest boots in well under a second
// under KVM, and in seconds to a minute under emulation on a busy node.
const DefaultBootTimeout = 3 * time.Minute

// defaults sets what the options leave unset to its default.
func (o *Options) defaults() {
	if o.Traces == nil {
		o.Traces = noop.NewTracerProvider()
	}
	if o.IdleWakeTimeout == 0 {
		o.IdleWakeTimeout = 30 * time.Second
	}
	if o.IdleInterval == 0 {
		o.IdleInterval = 2 * time.Second
	}
	if o.IdleHeldBytes == 0 {
		o.IdleHeldBytes = 64 << 20
	}
	if o.Accel == "" {
		o.Accel = qemu.Accel()
	}
	if o.MaxImageBytes == 0 {
		o.MaxImageBytes = 16 << 30
	}
	if o.ConsoleLogBytes == 0 {
		o.ConsoleLogBytes = 1 << 20
	}
	if o.ReportInterval == 0 {
		o.ReportInterval = 30 * time.Second
	}
	if o.RunSecretNamespace == "" {
		o.RunSecretNamespace = runsecret.DefaultNamespace
	}
	if o.HeartbeatInterval == 0 {
		o.HeartbeatInterval = 10 * time.Second
	}
	if o.StartingReportDelay == 0 {
		o.StartingReportDelay = time.Second
	}
	if o.BootTimeout == 0 {
		o.BootTimeout = DefaultBootTimeout
	}
	if o.PullTimeout == 0 {
		o.PullTimeout = 5 * time.Minute
	}
}
