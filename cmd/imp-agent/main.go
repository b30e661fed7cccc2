// Command imp-agent is IMP's privileged node agent (DaemonSet imp-runtime): it makes its node
// match the ImpVMs placed on it — disks from OCI images, VMM processes, the guest channel — and
// reports what it observes (see internal/agent).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/access"
	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/kvm"
	"github.com/syscode-labs/imp/internal/agent/preflight"
	"github.com/syscode-labs/imp/internal/logging"
	"github.com/syscode-labs/imp/internal/metricsauth"
	"github.com/syscode-labs/imp/internal/pki"
	"github.com/syscode-labs/imp/internal/runsecret"
	impscheme "github.com/syscode-labs/imp/internal/scheme"
	"github.com/syscode-labs/imp/internal/tracing"
)

func main() {
	guestmem.Init() // the child that fills a restored VM's memory is this binary again
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "imp-agent:", err)
		os.Exit(1)
	}
}

// runPreflightMode prints the checks and fails with their reason, which it also writes where
// Kubernetes reads a container's termination message.
func runPreflightMode(cfg preflight.Config) error {
	checks, err := preflight.Run(context.Background(), cfg)
	preflight.Report(os.Stdout, checks)
	if err != nil {
		if f, ferr := os.OpenFile("/dev/termination-log", os.O_WRONLY|os.O_TRUNC, 0); ferr == nil { // only in a container
			_, _ = f.WriteString(err.Error())
			f.Close()
		}
		return err
	}
	fmt.Println("preflight passed")
	return nil
}

// bytesFlag defines a flag of a byte count written as a quantity ("16Gi"), set to def.
func bytesFlag(fs *flag.FlagSet, p *int64, name, def, usage string) {
	set := func(v string) error {
		q, err := resource.ParseQuantity(v)
		if err != nil {
			return err
		}
		if q.Sign() < 0 {
			return fmt.Errorf("%s is negative", v)
		}
		*p = q.Value()
		return nil
	}
	if err := set(def); err != nil {
		panic(err)
	}
	fs.Func(name, usage+" (default "+def+")", set)
}

func run() error {
	var (
		opts                   agent.Options
		metricsAddr, probeAddr string
		pprofAddr              string
		accessAddr, accessDir  string
		migrationAddr          string
		accessCSR              bool
		accessClient           string
		reserveDisk            string
		metricsInsecure        bool
		reserveMemory          string
		reserveVCPUs           int
		logOpts                logging.Options
		pre                    preflight.Config
		runPreflight           bool
		pins                   = map[string]*string{"kernel": new(string), "initramfs": new(string), "firecracker": new(string), "jailer": new(string)}
	)
	fs := flag.CommandLine
	fs.StringVar(&opts.NodeName, "node-name", os.Getenv("NODE_NAME"), "name of the node this agent runs on (default $NODE_NAME)")
	fs.StringVar(&opts.StateDir, "state-dir", "/var/lib/imp", "host directory holding per-VM state, disks and images")
	fs.StringVar(&opts.Kernel, "kernel", "/var/lib/imp/boot/vmlinuz", "guest kernel")
	fs.StringVar(&opts.Initramfs, "initramfs", "/var/lib/imp/boot/initramfs.cpio.gz", "IMP's guest initramfs (imp-init and modules)")
	fs.StringVar(&opts.CgroupRoot, "cgroup-root", cgroup.Root, "the host's cgroup mount, where each VMM gets cgroups of its own outside the agent's (empty: none)")
	fs.StringVar(&opts.Accel, "qemu-accel", "", "QEMU accelerator: kvm or tcg (default: kvm when it works)")
	fs.IntVar(&reserveVCPUs, "reserve-vcpus", 1, "vCPUs kept for the host, not offered to VMs")
	fs.StringVar(&reserveMemory, "reserve-memory", "1Gi", "memory kept for the host, not offered to VMs")
	fs.StringVar(&reserveDisk, "reserve-disk", "20Gi", "space of the state directory's file system kept for base images, logs and the host, not offered to VMs' writable disks")
	bytesFlag(fs, &opts.SnapshotMemoryCache, "snapshot-memory-cache", "1Gi", "memory kept, out of what the node offers VMs, for the memory of snapshots restored here, which their restores map instead of copying (0: none)")
	fs.Int64Var(&opts.ConsoleLogBytes, "console-log-bytes", 1<<20, "cap of each file a VM writes on the node: its console, its VMM's log (and Firecracker's metrics and jailer output); past it a file keeps its newest half")
	fs.Int64Var(&opts.MaxImageEntries, "max-image-entries", 500_000, "most entries (files, directories, links) one image may hold on the node")
	bytesFlag(fs, &opts.MaxImageBytes, "max-image-bytes", "16Gi", "most bytes of files one image may hold on the node")
	fs.IntVar(&opts.ImageBuilds.Concurrent, "image-builds", 2, "images the node builds into base disks at once (0: unbounded)")
	fs.IntVar(&opts.ImageBuilds.PerTenantConcurrent, "image-builds-per-namespace", 1, "images of one namespace's VMs the node builds at once (0: unbounded)")
	bytesFlag(fs, &opts.ImageBuilds.InFlight, "image-build-bytes", "48Gi", "bytes the node's image builds hold at once on the state file system, extracted files and the disks made of them (0: unbounded)")
	bytesFlag(fs, &opts.ImageBuilds.PerTenantInFlight, "image-build-bytes-per-namespace", "40Gi", "bytes the builds of one namespace's images hold at once (0: unbounded)")
	bytesFlag(fs, &opts.ImageBuilds.MinFree, "image-build-min-free", "5Gi", "free space of the state file system that image builds never write into: VMs' sparse disks grow there (0: none)")
	fs.DurationVar(&opts.FinishedDiskRetention, "finished-disk-retention", 24*time.Hour, "how long a VM that finished (Succeeded or Failed) keeps its disks on the node (0: until it is deleted)")
	fs.DurationVar(&opts.PullTimeout, "image-pull-timeout", 5*time.Minute, "longest time resolving and pulling a VM's image may take")
	fs.DurationVar(&opts.ImageResolveTTL, "image-resolve-ttl", 0, "how long what a tag resolved to is kept, per pull credentials: a start within it asks the registry nothing (0: ask at every start)")
	fs.BoolVar(&opts.EndpointBlocks, "endpoint-blocks", false,
		"the operator assigns endpoint blocks (its --endpoint-cidr is set): a VM with ports waits for this node's block before it starts")
	fs.DurationVar(&opts.EndpointDrain, "endpoint-drain", 2*time.Second,
		"how long a VM that serves Services waits, its endpoint terminating, before its guest is asked to stop (counts against its grace period)")
	fs.DurationVar(&opts.BootTimeout, "boot-timeout", agent.DefaultBootTimeout,
		"how long a guest may take from its VMM's start to be ready; one that is not is stuck, and its VMM is ended for the VM's runStrategy to start it again (negative: no bound)")
	fs.DurationVar(&opts.StartingReportDelay, "starting-report-delay", time.Second,
		"how long the reports that a VM is starting and that its guest boots wait; one a later report overtakes is never written (negative: at once)")
	fs.Float64Var(&opts.VCPUOvercommit, "vcpu-overcommit", 1, "vCPUs offered to VMs per host CPU left after the reserve (memory is never overcommitted)")
	fs.StringVar(&opts.NetNS, "netns", "", "network namespace (path) holding the node's VM networking (default: the agent's own)")
	fs.Func("overlay-address", "this node's underlay IPv4 address for the VXLAN overlay between nodes (the chart passes the host IP); empty keeps the node out of the overlay", func(s string) error {
		a, err := netip.ParseAddr(s)
		if err != nil || !a.Is4() {
			return fmt.Errorf("not an IPv4 address: %q", s)
		}
		opts.OverlayAddress = a
		return nil
	})
	fs.StringVar(&opts.RunSecretNamespace, "run-secret-namespace", runsecret.DefaultNamespace, "IMP's namespace, where the operator writes each VM's run Secret: the only Secrets the agent reads")
	fs.StringVar(&opts.NetNSDir, "netns-dir", hostnet.DefaultNSDir, "directory where each ImpNetwork's network namespace is pinned (a tmpfs that outlives the agent: in a pod, a hostPath with Bidirectional mount propagation)")
	fs.Func("transit-cidr", "IPv4 range of NAT networks' transit addresses on each node, one per NAT network (default "+hostnet.DefaultTransitCIDR.String()+"); it must not be an address the node itself needs to reach", func(s string) error {
		p, err := netip.ParsePrefix(s)
		if err != nil || !p.Addr().Is4() {
			return fmt.Errorf("not an IPv4 CIDR: %q", s)
		}
		opts.TransitCIDR = p
		return nil
	})
	fs.Func("egress-deny-cidrs", "IPv4 CIDRs, comma-separated, that NAT egress from VMs never reaches, beyond the node itself and link-local addresses (set the cluster's pod and service ranges)", func(s string) error {
		ps, err := impv1.ParseIPv4CIDRs(s)
		opts.DeniedEgress = append(opts.DeniedEgress, ps...)
		return err
	})
	fs.StringVar(&opts.EgressNameserver, "egress-nameserver", "", "HOST:PORT of the DNS server the domain egress proxy asks (default: the node's resolv.conf's)")
	fs.IntVar(&opts.VXLANPort, "vxlan-port", hostnet.DefaultVXLANPort, "UDP port of the VXLAN overlay (not 4789 or 8472, which CNIs use)")
	fs.IntVar(&opts.MTU, "vm-mtu", hostnet.DefaultMTU, "MTU of VM interfaces, taps and overlay devices (underlay MTU minus 50)")
	fs.Func("insecure-registry", "registry host:port reachable over plain HTTP (repeatable; loopback always is)", func(s string) error {
		opts.InsecureRegistries = append(opts.InsecureRegistries, s)
		return nil
	})
	fs.Func("local-registry", "registry on a loopback or link-local address that images may name: host:port, or host for any port (repeatable; an --insecure-registry counts too); any other there is refused", func(s string) error {
		opts.LocalRegistries = append(opts.LocalRegistries, s)
		return nil
	})
	fs.StringVar(&metricsAddr, "metrics-bind-address", ":8090", "address of the Prometheus metrics endpoint, HTTPS with the API server's authentication and authorization (0 disables it)")
	fs.StringVar(&accessAddr, "access-bind-address", ":10260", "address of the access endpoint (exec, port-forward, console log) that IMP's subresource server reaches over mutual TLS")
	fs.StringVar(&migrationAddr, "migration-bind-address", "", "address where the agent takes migrations of VMs to this node, over mutual TLS with the agents' certificates (the access endpoint's, so it needs one); empty: the node takes part in no migration")
	bytesFlag(fs, &opts.MigrationBandwidth, "migration-bandwidth", "0", "bytes a second that the node's migration streams send, together, at most (1Gi: a gibibyte a second); 0: unbounded")
	fs.StringVar(&opts.MigrationEndpoint, "migration-endpoint", "", "host:port where other nodes' agents reach --migration-bind-address (reported on this node's ImpNode); default: the bind address")
	fs.StringVar(&accessDir, "access-cert-dir", "", "directory of the access endpoint's tls.crt, tls.key and the client CA ca.crt, read again when they change; empty: no access endpoint")
	fs.DurationVar(&opts.HeartbeatInterval, "heartbeat-interval", 10*time.Second, "how often the agent renews its heartbeat Lease (imp-agent-NODE in --run-secret-namespace)")
	fs.BoolVar(&accessCSR, "access-cert-request", false, "obtain the access endpoint's certificate for this node through the certificates API (signer "+pki.SignerName+", the operator), and renew it; wins over --access-cert-dir")
	fs.StringVar(&accessClient, "access-client-name", "imp-subresources", "the only client the access endpoint serves: the common name of its certificate, which ca.crt signed")
	fs.BoolVar(&metricsInsecure, "metrics-insecure", false, "serve metrics over plain HTTP to anyone who reaches the address (development only: bind it to loopback)")
	fs.StringVar(&pprofAddr, "pprof-bind-address", "0", "address of Go's /debug/pprof endpoints, for profiling (0 disables them; they are unauthenticated and the agent is in the host's network: bind to 127.0.0.1)")
	fs.StringVar(&probeAddr, "health-probe-bind-address", "127.0.0.1:8091", "address of the /healthz and /readyz endpoints (the node's loopback: the kubelet probes a hostNetwork pod there)")
	fs.Func("vmms", "VMMs this node offers, best first, comma-separated (firecracker, qemu); default: what probing finds", func(v string) error {
		for _, k := range strings.Split(v, ",") {
			switch kind := impv1.VMMKind(strings.TrimSpace(k)); kind {
			case impv1.VMMFirecracker, impv1.VMMQEMU:
				opts.VMMs = append(opts.VMMs, kind)
			default:
				return fmt.Errorf("unknown VMM %q", k)
			}
		}
		return nil
	})
	fs.IntVar(&opts.JailUIDBase, "jail-uid-base", 300000, "first of the 65536 uids (and gids) Firecracker VMs run as under the jailer, one per VM")
	fs.BoolVar(&runPreflight, "preflight", false, "check this node (KVM, VMM binaries, pinned hashes), print the result and exit: non-zero with the reason when it cannot run IMP's VMs")
	fs.BoolVar(&pre.RequireKVM, "require-kvm", true, "with --preflight: fail when /dev/kvm cannot run guests")
	fs.StringVar(&pre.KVMDevice, "kvm-device", kvm.Device, "the KVM device")
	fs.StringVar(&pre.Firecracker, "firecracker", "/usr/local/bin/firecracker", "the firecracker binary")
	fs.StringVar(&pre.Jailer, "jailer", "/usr/local/bin/jailer", "the jailer binary")
	for _, name := range []string{"kernel", "initramfs", "firecracker", "jailer"} {
		fs.StringVar(pins[name], "pin-"+name, "", "sha256 the "+name+" must have (empty: not pinned); a VM does not start on a mismatch")
	}
	logOpts.BindFlags(fs)
	var traces tracing.Config
	traces.AddFlags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: imp-agent [flags]\n\nRuns the ImpVMs placed on this node.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	flag.Parse()
	paths := map[string]string{"kernel": opts.Kernel, "initramfs": opts.Initramfs, "firecracker": pre.Firecracker, "jailer": pre.Jailer}
	for _, name := range []string{"kernel", "initramfs", "firecracker", "jailer"} {
		if sum := *pins[name]; sum != "" {
			pre.Pins = append(pre.Pins, preflight.Pin{Name: name, Path: paths[name], SHA256: sum})
		}
	}
	if runPreflight {
		pre.QEMU = "qemu-system-x86_64"
		return runPreflightMode(pre)
	}
	opts.Pins, opts.KVMDevice, opts.Firecracker, opts.Jailer = pre.Pins, pre.KVMDevice, pre.Firecracker, pre.Jailer
	log, err := logOpts.Logger()
	if err != nil {
		return err
	}
	ctrl.SetLogger(log)
	if opts.NodeName == "" {
		return errors.New("--node-name (or $NODE_NAME) is required")
	}
	if err := loopbackOnly(pprofAddr); err != nil {
		return fmt.Errorf("--pprof-bind-address: %w", err)
	}
	mem, err := resource.ParseQuantity(reserveMemory)
	if err != nil {
		return fmt.Errorf("--reserve-memory: %w", err)
	}
	opts.ReserveVCPUs, opts.ReserveMemory = int32(reserveVCPUs), mem.Value()
	disk, err := resource.ParseQuantity(reserveDisk)
	if err != nil {
		return fmt.Errorf("--reserve-disk: %w", err)
	}
	opts.ReserveDisk = disk.Value()

	scheme, err := impscheme.New()
	if err != nil {
		return err
	}
	cfg, err := ctrl.GetConfig()
	if err != nil {
		return fmt.Errorf("loading the kubeconfig: %w", err)
	}
	// The agent runs in the host's network: its metrics answer only callers the API server
	// authenticates and authorizes (get on the non-resource URL /metrics), over TLS.
	metrics := metricsserver.Options{BindAddress: metricsAddr}
	if !metricsInsecure {
		metrics.SecureServing, metrics.FilterProvider = true, metricsauth.Filter
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                 scheme,
		Cache:                  agent.CacheOptions(opts.NodeName),
		Metrics:                metrics,
		HealthProbeBindAddress: probeAddr,
		PprofBindAddress:       pprofAddr,
	})
	if err != nil {
		return fmt.Errorf("creating the manager: %w", err)
	}
	if err := errors.Join(mgr.AddHealthzCheck("ping", healthz.Ping), mgr.AddReadyzCheck("ping", healthz.Ping)); err != nil {
		return err
	}
	// The access endpoint's certificate is the node's: its agent's identity towards other
	// nodes' agents too, for migrations.
	srv := &access.Server{Addr: accessAddr, CertDir: accessDir, ClientName: accessClient, Log: log.WithName("access")}
	if migrationAddr != "" {
		if accessDir == "" && !accessCSR {
			return errors.New("--migration-bind-address needs the node's certificate: --access-cert-request or --access-cert-dir")
		}
		opts.MigrationAddr, opts.MigrationIdentity = migrationAddr, srv.Identity
	}
	ctx := ctrl.SetupSignalHandler()
	tp, stopTraces, err := tracing.Provider(ctx, traces, "imp-agent")
	if err != nil {
		return err
	}
	defer tracing.Flush(stopTraces)
	opts.Traces = tp
	a := &agent.Agent{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Recorder: mgr.GetEventRecorder("imp-agent"), Opts: opts}
	if err := a.SetupWithManager(mgr); err != nil {
		return err
	}
	if accessDir != "" || accessCSR {
		srv.Handler = a.Sessions.Wrap(access.Handler(a.Figures, log.WithName("access")))
		if accessCSR {
			// The manager's client: it caches no CertificateSigningRequests (the agent may
			// not list them), so it reads them from the API.
			c, err := client.New(cfg, client.Options{Scheme: scheme})
			if err != nil {
				return err
			}
			srv.CSR = &access.CSR{Client: c, Node: opts.NodeName, Dir: filepath.Join(opts.StateDir, "pki")}
		}
		if err := mgr.Add(srv); err != nil {
			return err
		}
	}
	log.Info("starting imp-agent", "node", opts.NodeName, "accel", a.Opts.Accel)
	return mgr.Start(ctx)
}

// loopbackOnly refuses an address off the node's loopback ("0" and "" disable the endpoint):
// the agent is in the host's network, where anything that reaches the node would reach it.
func loopbackOnly(addr string) error {
	if addr == "" || addr == "0" {
		return nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if ip, err := netip.ParseAddr(host); host != "localhost" && (err != nil || !ip.IsLoopback()) {
		return fmt.Errorf("%s is not on the loopback interface", addr)
	}
	return nil
}
