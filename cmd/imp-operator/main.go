// Command imp-operator makes IMP's cluster-wide decisions: placement, addresses and lifecycle
// policy of ImpVMs. It never touches a host. It runs as a leader-elected Deployment.
package main

import (
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/impvm"
	"github.com/syscode-labs/imp/internal/controller/impvmmigration"
	"github.com/syscode-labs/imp/internal/controller/impvmpool"
	"github.com/syscode-labs/imp/internal/controller/volumeholder"
	"github.com/syscode-labs/imp/internal/logging"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/runsecret"
	impscheme "github.com/syscode-labs/imp/internal/scheme"
	"github.com/syscode-labs/imp/internal/subresources"
	"github.com/syscode-labs/imp/internal/tracing"
)

func main() {
	if len(os.Args) == 2 && os.Args[1] == volumeholder.HoldArg {
		hold()
		return
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "imp-operator:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		metricsAddr, probeAddr string
		pprofAddr              string
		leaderElect            bool
		leaderElectionNS       string
		logOpts                logging.Options
		concurrency            int
		migrationsPerNamespace int
		vmOpts                 = impvm.DefaultOptions()
		pressureLifecycle      bool
		pressureSettle         time.Duration
		pressureTimeout        time.Duration
		sub                    subresourceFlags
		admissionTimeout       time.Duration
		endpointRange          = netip.MustParsePrefix("100.72.0.0/16")
		endpointBlockBits      int
		holderImage            string
		poolCreates            float64
		poolBurst              int
	)
	fs := flag.CommandLine
	fs.StringVar(&metricsAddr, "metrics-bind-address", ":8080", "address of the Prometheus metrics endpoint (0 disables it)")
	fs.StringVar(&probeAddr, "health-probe-bind-address", ":8081", "address of the /healthz and /readyz endpoints")
	fs.StringVar(&pprofAddr, "pprof-bind-address", "0", "address of Go's /debug/pprof endpoints, for profiling (0 disables them; they are unauthenticated: bind to loopback)")
	fs.BoolVar(&leaderElect, "leader-elect", true, "elect a leader so that only one replica acts at a time")
	fs.StringVar(&leaderElectionNS, "leader-election-namespace", "", "namespace of the leader election Lease (default: the pod's namespace)")
	fs.IntVar(&concurrency, "vm-concurrency", 4, "how many ImpVMs are reconciled at once")
	fs.IntVar(&migrationsPerNamespace, "migrations-per-namespace", impvmmigration.DefaultPerNamespace, "ImpVMMigrations of one namespace under way at once; more wait Pending (Queued), in the order they came; -1: unbounded")
	fs.DurationVar(&vmOpts.NodeLostGracePeriod, "node-lost-grace-period", vmOpts.NodeLostGracePeriod, "how long a VM's node may be NotReady with its agent silent before the VM is reported NodeUnreachable (it moves only once the node is fenced)")
	fs.DurationVar(&vmOpts.AgentHeartbeatTimeout, "agent-heartbeat-timeout", vmOpts.AgentHeartbeatTimeout, "how long a node's agent may go without a heartbeat before the node takes no more VMs")
	fs.DurationVar(&vmOpts.RestartBackoffBase, "restart-backoff-base", vmOpts.RestartBackoffBase, "first delay before restarting a VM that exited; doubles per restart")
	fs.DurationVar(&vmOpts.RestartBackoffMax, "restart-backoff-max", vmOpts.RestartBackoffMax, "longest delay before restarting a VM that exited")
	fs.Func("reserved-cidrs", "IPv4 CIDRs, comma-separated, that no ImpNetwork may overlap: such a network is Ready=False (ReservedCIDR) and none of its VMs is placed", func(s string) error {
		ps, err := impv1.ParseIPv4CIDRs(s)
		vmOpts.ReservedCIDRs = append(vmOpts.ReservedCIDRs, ps...)
		return err
	})
	fs.StringVar(&vmOpts.RunSecretNamespace, "run-secret-namespace", runsecret.DefaultNamespace, "IMP's namespace, where each VM's run Secret goes (what the VM needs of its namespace's Secrets and ConfigMaps, resolved for its node's agent)")
	fs.DurationVar(&vmOpts.DeletionTimeout, "deletion-timeout", vmOpts.DeletionTimeout, "how long deleting a VM waits for its node to confirm it is gone")
	fs.DurationVar(&vmOpts.StartingReportDelay, "starting-report-delay", vmOpts.StartingReportDelay,
		"how long an agent's report that a VM is starting or booting waits before the VM's phase shows it; a report the guest's readiness overtakes is never written (0: at once)")
	fs.DurationVar(&pressureSettle, "pressure-settle", 15*time.Second, "with --pressure-lifecycle: how long after a VM's memory is freed before the node's MemoryPressure is trusted again")
	fs.DurationVar(&pressureTimeout, "pressure-timeout", 2*time.Minute, "with --pressure-lifecycle: how long a suspension may take before the next VM is considered")
	fs.BoolVar(&pressureLifecycle, "pressure-lifecycle", false, "suspend resident ImpVMs, largest memory first, on nodes reporting MemoryPressure (chart value pressureLifecycle.enabled)")
	fs.Func("endpoint-cidr", "IPv4 range of the VMs' endpoint addresses (what Services reach VMs at), one block per node; it must collide with no pod, service, node or tenant range (empty: VMs are reachable through no Service)", func(s string) error {
		if s == "" {
			endpointRange = netip.Prefix{}
			return nil
		}
		p, err := netip.ParsePrefix(s)
		if err != nil || !p.Addr().Is4() || p != p.Masked() {
			return fmt.Errorf("want an IPv4 CIDR without host bits, such as 100.72.0.0/16")
		}
		endpointRange = p
		return nil
	})
	fs.IntVar(&endpointBlockBits, "endpoint-block-bits", 24, "prefix length of each node's block of --endpoint-cidr (24: 254 VMs with ports per node)")
	fs.StringVar(&sub.addr, "subresources-bind-address", "", "address of the aggregated API server of the ImpVM subresources (console, exec, portforward, log); empty: not served")
	fs.StringVar(&sub.namespace, "subresources-namespace", os.Getenv("POD_NAMESPACE"), "namespace of the access certificates' Secrets and of the subresource server's Service")
	fs.StringVar(&sub.caNamespace, "access-ca-namespace", "", "namespace of the access CA's Secret, which agents must not be able to read (default: --subresources-namespace with -access appended)")
	fs.StringVar(&sub.service, "subresources-service", "imp-subresources", "the subresource server's Service, named in its serving certificate")
	fs.StringVar(&sub.apiService, "subresources-apiservice", "v1alpha1.subresources.imp.dev", "the APIService whose caBundle gets the access CA (empty: left alone)")
	fs.IntVar(&sub.agentPort, "agent-access-port", 10260, "port of the agents' access endpoint")
	fs.IntVar(&sub.maxStreamsPerUser, "max-streams-per-user", subresources.DefaultMaxStreamsPerUser, "subresource requests (exec, port-forward, console, followed logs) one user may have open at once through one operator replica; past it, 429")
	fs.IntVar(&sub.maxStreamsPerVM, "max-streams-per-vm", subresources.DefaultMaxStreamsPerVM, "subresource requests open at once to one ImpVM through one operator replica; past it, 429")
	fs.DurationVar(&admissionTimeout, "wait-for-admission", 0, "instead of running: wait until the API server admits ImpVMs in --run-secret-namespace (a dry-run create, retried each second) for at most this long, then exit (the chart's post-install hook)")
	fs.StringVar(&holderImage, "volume-holder-image", "", "image of the pods that hold VMs' PersistentVolumeClaims on their nodes, whose entrypoint holds with the argument \""+volumeholder.HoldArg+"\" (the chart: the operator's own image)")
	logOpts.BindFlags(fs)
	var traces tracing.Config
	traces.AddFlags(fs)
	fs.Float64Var(&poolCreates, "pool-creates-per-second", impvmpool.DefaultCreatesPerSecond, "members the ImpVMPools of one namespace may make per second, together (past --pool-create-burst): one tenant's pools cannot crowd the API server's priority level the operator's writes share")
	fs.IntVar(&poolBurst, "pool-create-burst", impvmpool.DefaultCreateBurst, "members the ImpVMPools of one namespace may make at once before --pool-creates-per-second paces them")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: imp-operator [flags]\n\nPlaces ImpVMs on nodes, allocates their addresses and drives their lifecycle.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	flag.Parse()

	log, err := logOpts.Logger()
	if err != nil {
		return err
	}
	ctrl.SetLogger(log)

	scheme, err := impscheme.New()
	if err != nil {
		return err
	}
	cfg, err := ctrl.GetConfig()
	if err != nil {
		return fmt.Errorf("loading the kubeconfig: %w", err)
	}
	if admissionTimeout > 0 {
		c, err := client.New(cfg, client.Options{Scheme: scheme})
		if err != nil {
			return err
		}
		return operator.WaitForAdmission(ctrl.SetupSignalHandler(), c, vmOpts.RunSecretNamespace, admissionTimeout, log.WithName("admission"))
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                        scheme,
		Cache:                         operator.CacheOptions(operator.Options{VM: vmOpts}),
		Metrics:                       metricsserver.Options{BindAddress: metricsAddr},
		HealthProbeBindAddress:        probeAddr,
		PprofBindAddress:              pprofAddr,
		LeaderElection:                leaderElect,
		LeaderElectionID:              "imp-operator.imp.dev",
		LeaderElectionNamespace:       leaderElectionNS,
		LeaderElectionReleaseOnCancel: true,
	})
	if err != nil {
		return fmt.Errorf("creating the manager: %w", err)
	}
	if err := errors.Join(
		mgr.AddHealthzCheck("ping", healthz.Ping),
		mgr.AddReadyzCheck("ping", healthz.Ping),
	); err != nil {
		return fmt.Errorf("adding health checks: %w", err)
	}
	ctx := ctrl.SetupSignalHandler()
	tp, stopTraces, err := tracing.Provider(ctx, traces, "imp-operator")
	if err != nil {
		return err
	}
	defer tracing.Flush(stopTraces)
	if traces.Enabled() {
		vmOpts.Traces = tp
	}
	if err := operator.Setup(ctx, mgr, operator.Options{VM: vmOpts, Concurrency: concurrency, MigrationsPerNamespace: migrationsPerNamespace, EndpointRange: endpointRange, EndpointBlockBits: endpointBlockBits,
		PressureLifecycle: pressureLifecycle, PressureSettle: pressureSettle, PressureTimeout: pressureTimeout, VolumeHolderImage: holderImage,
		PoolCreatesPerSecond: poolCreates, PoolCreateBurst: poolBurst}); err != nil {
		return err
	}
	if sub.addr != "" {
		if err := sub.setup(ctx, mgr, log.WithName("subresources")); err != nil {
			return err
		}
	}
	log.Info("starting imp-operator")
	return mgr.Start(ctx)
}

// hold is a volume holder pod's process (volumeholder.HoldArg): it does nothing until
// SIGTERM or SIGINT, while the kubelet keeps the pod's volumes attached for its VM's agent.
func hold() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	<-sigs
}
