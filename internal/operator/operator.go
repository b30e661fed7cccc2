// Package operator assembles imp-operator's reconcilers on a controller-runtime manager: the
// shared placement ledger and address allocator, the ImpVM and ImpNetwork reconcilers, and the
// pressure lifecycle when enabled.
package operator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	certv1 "k8s.io/api/certificates/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/accesscredentials"
	"github.com/syscode-labs/imp/internal/controller/endpoints"
	"github.com/syscode-labs/imp/internal/controller/evacuation"
	"github.com/syscode-labs/imp/internal/controller/idle"
	"github.com/syscode-labs/imp/internal/controller/impipaddress"
	"github.com/syscode-labs/imp/internal/controller/impnetwork"
	"github.com/syscode-labs/imp/internal/controller/impnode"
	"github.com/syscode-labs/imp/internal/controller/impquota"
	"github.com/syscode-labs/imp/internal/controller/impvm"
	"github.com/syscode-labs/imp/internal/controller/impvmmigration"
	"github.com/syscode-labs/imp/internal/controller/impvmpool"
	"github.com/syscode-labs/imp/internal/controller/impvmsnapshot"
	"github.com/syscode-labs/imp/internal/controller/impvmtemplate"
	"github.com/syscode-labs/imp/internal/controller/impwarmpool"
	"github.com/syscode-labs/imp/internal/controller/pressure"
	"github.com/syscode-labs/imp/internal/controller/volumeholder"
	"github.com/syscode-labs/imp/internal/ipam"
	"github.com/syscode-labs/imp/internal/pki"
	"github.com/syscode-labs/imp/internal/placement"
	"github.com/syscode-labs/imp/internal/runsecret"
	"github.com/syscode-labs/imp/internal/warmpool"
)

// Options configure the operator.
type Options struct {
	VM impvm.Options
	// Concurrency is how many ImpVMs are reconciled at once.
	Concurrency int
	// MigrationsPerNamespace bounds the migrations of one namespace under way at once (0:
	// impvmmigration.DefaultPerNamespace; less than 0: unbounded).
	MigrationsPerNamespace int
	// Clock defaults to the real clock.
	Clock clock.PassiveClock
	// PressureLifecycle turns the pressure lifecycle on (chart value pressureLifecycle.enabled).
	PressureLifecycle bool
	// PressureSettle and PressureTimeout tune it (see pressure.Reconciler).
	PressureSettle, PressureTimeout time.Duration
	// EndpointRange is the cluster's range of VM endpoint addresses, carved into blocks of
	// EndpointBlockBits, one per node; invalid (unset): no node gets a block, and no VM is
	// reachable through a Service.
	EndpointRange     netip.Prefix
	EndpointBlockBits int
	// VolumeHolderImage is the image of the pods holding VMs' PersistentVolumeClaims (the
	// operator's own: its entrypoint holds with the argument volumeholder.HoldArg).
	VolumeHolderImage string
	// PoolCreatesPerSecond and PoolCreateBurst bound the members the pools of one namespace
	// make (impvmpool's defaults when 0).
	PoolCreatesPerSecond float64
	PoolCreateBurst      int
}

// CacheOptions narrow what the operator's cache holds of kinds it needs only a part of: the
// agents' heartbeat Leases in IMP's namespace (runSecretNamespace), which the chart lets it
// read there only, and the certificate requests of the agents' signer.
func CacheOptions(o Options) cache.Options {
	return cache.Options{ByObject: map[client.Object]cache.ByObject{
		&coordinationv1.Lease{}: {
			Namespaces: map[string]cache.Config{cmp.Or(o.VM.RunSecretNamespace, runsecret.DefaultNamespace): {}},
			Label:      labels.SelectorFromSet(labels.Set{impv1.AgentLeaseLabel: "true"}),
		},
		&certv1.CertificateSigningRequest{}: {Field: fields.OneTermEqualSelector("spec.signerName", pki.SignerName)},
		// Only IMP's own slices: the cluster's others are none of its business.
		&discoveryv1.EndpointSlice{}: {Label: labels.SelectorFromSet(labels.Set{discoveryv1.LabelManagedBy: endpoints.ManagedBy})},
		// Only the pods holding VMs' claims.
		&corev1.Pod{}: {Label: labels.SelectorFromSet(labels.Set{volumeholder.HolderLabel: "true"})},
		// Only the budgets guarding them.
		&policyv1.PodDisruptionBudget{}: {Label: labels.SelectorFromSet(labels.Set{volumeholder.ManagedByLabel: volumeholder.ManagedBy})},
	}}
}

// Setup adds the operator's reconcilers to mgr.
func Setup(ctx context.Context, mgr ctrl.Manager, o Options) error {
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	if o.Concurrency < 1 {
		o.Concurrency = 1
	}
	recorder := mgr.GetEventRecorder("imp-operator")
	alloc := ipam.New(mgr.GetAPIReader(), mgr.GetClient(), mgr.GetScheme())
	status, err := impvm.NewStatusPatcher(mgr.GetConfig(), mgr.GetHTTPClient(), mgr.GetScheme())
	if err != nil {
		return err
	}
	// Warm pools' members and their claims, from the cache's VMs: the VM controller binds
	// claims through it, the pool controller asks it before deleting a member.
	warm := warmpool.NewLedger()
	if err := warm.Watch(ctx, mgr.GetCache()); err != nil {
		return err
	}
	vms := &impvm.Reconciler{
		Client:    mgr.GetClient(),
		APIReader: mgr.GetAPIReader(),
		Status:    status,
		Scheme:    mgr.GetScheme(),
		Recorder:  recorder,
		Clock:     o.Clock,
		Ledger:    placement.NewLedger(),
		IPAM:      alloc,
		Warm:      warm,
		Options:   o.VM,
	}
	// Addresses made before they named their node get it, once, by the leader.
	if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
		if n, err := alloc.Backfill(ctx); err != nil {
			ctrl.Log.WithName("ipam").Error(err, "naming the nodes of existing addresses", "named", n)
		} else if n > 0 {
			ctrl.Log.WithName("ipam").Info("named the nodes of existing addresses", "named", n)
		}
		return nil
	})); err != nil {
		return err
	}
	if err := vms.SetupWithManager(ctx, mgr, o.Concurrency); err != nil {
		return fmt.Errorf("setting up the ImpVM reconciler: %w", err)
	}
	nets := &impnetwork.Reconciler{
		Client:    mgr.GetClient(),
		APIReader: mgr.GetAPIReader(),
		Recorder:  recorder,
		IPAM:      alloc,
		Reserved:  o.VM.ReservedCIDRs,
	}
	if err := nets.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the ImpNetwork reconciler: %w", err)
	}
	if err := (&impipaddress.Reconciler{Client: mgr.GetClient()}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the ImpIPAddress reconciler: %w", err)
	}
	if err := (&impquota.Reconciler{Client: mgr.GetClient()}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the ImpQuota reconciler: %w", err)
	}
	if o.EndpointRange.IsValid() {
		blocks := &impnode.Reconciler{Client: mgr.GetClient(), Range: o.EndpointRange, BlockBits: o.EndpointBlockBits}
		if err := blocks.SetupWithManager(mgr); err != nil {
			return fmt.Errorf("setting up the ImpNode reconciler: %w", err)
		}
	}
	if err := (&impvmsnapshot.Reconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Clock: o.Clock,
		SecretNamespace: cmp.Or(o.VM.RunSecretNamespace, runsecret.DefaultNamespace)}).SetupWithManager(ctx, mgr); err != nil {
		return fmt.Errorf("setting up the ImpVMSnapshot reconciler: %w", err)
	}
	if err := (&impvmtemplate.Reconciler{Client: mgr.GetClient(), Clock: o.Clock}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the ImpVMTemplate reconciler: %w", err)
	}
	pools := &impvmpool.Reconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Recorder: recorder, Clock: o.Clock,
		CreatesPerSecond: o.PoolCreatesPerSecond, CreateBurst: o.PoolCreateBurst}
	if err := pools.SetupWithManager(mgr, o.Concurrency); err != nil {
		return fmt.Errorf("setting up the ImpVMPool reconciler: %w", err)
	}
	warmPools := &impwarmpool.Reconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Recorder: recorder, Members: warm, Clock: o.Clock}
	if err := warmPools.SetupWithManager(mgr, o.Concurrency); err != nil {
		return fmt.Errorf("setting up the ImpWarmPool reconciler: %w", err)
	}
	if err := (&volumeholder.Reconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Image: o.VolumeHolderImage}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the volume holders: %w", err)
	}
	if err := (&endpoints.Reconciler{Client: mgr.GetClient()}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the endpoints reconciler: %w", err)
	}
	if err := (&accesscredentials.Reconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Status: status, Recorder: recorder,
		SecretNamespace: o.VM.RunSecretNamespace}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the access credentials' refresh: %w", err)
	}
	if err := (&idle.Reconciler{Client: mgr.GetClient(), Recorder: recorder, Clock: o.Clock}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the idle reconciler: %w", err)
	}
	if err := (&impvmmigration.Reconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Recorder: recorder, Clock: o.Clock,
		Placer: impvm.Migrations{R: vms}, PerNamespace: o.MigrationsPerNamespace}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the ImpVMMigration reconciler: %w", err)
	}
	if err := (&evacuation.Reconciler{Client: mgr.GetClient(), Recorder: recorder, Clock: o.Clock}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the evacuation of nodes: %w", err)
	}
	if o.PressureLifecycle {
		if o.PressureSettle == 0 {
			o.PressureSettle = 15 * time.Second
		}
		if o.PressureTimeout == 0 {
			o.PressureTimeout = 2 * time.Minute
		}
		p := &pressure.Reconciler{Client: mgr.GetClient(), Recorder: recorder, Clock: o.Clock, Settle: o.PressureSettle, Timeout: o.PressureTimeout}
		if err := p.SetupWithManager(mgr); err != nil {
			return fmt.Errorf("setting up the pressure lifecycle: %w", err)
		}
	}
	for _, c := range []prometheus.Collector{impvm.Collector(mgr.GetCache()), impnetwork.Collector(mgr.GetCache()), impquota.Collector(mgr.GetCache()), impwarmpool.Collector(mgr.GetCache())} {
		register(c)
	}
	return nil
}

// register adds c to controller-runtime's metrics registry, replacing a collector of the same
// metrics that an earlier manager in this process registered (tests restart the operator).
func register(c prometheus.Collector) {
	err := metrics.Registry.Register(c)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		metrics.Registry.Unregister(are.ExistingCollector)
		metrics.Registry.MustRegister(c)
	}
}
