package egressproxy

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
)

var connections = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "imp_egress_proxy_connections_total",
	Help: "Connections of VMs through a network's domain egress proxy, by result: allowed, or why refused (domain, no-name, internal, destination, unresolved, unreachable).",
}, []string{"namespace", "network", "result"})

func init() { metrics.Registry.MustRegister(connections) }

// Host is the node side the proxies need (hostnet.Host).
type Host interface {
	ListenProxy(n hostnet.Network) (net.Listener, error)
	DialFromNode(ctx context.Context, to netip.AddrPort) (net.Conn, error)
	Resolver(nameserver string) *net.Resolver
	Internal(n hostnet.Network) func(netip.Addr, uint16) string
}

// Proxies runs the domain egress proxy of each network of the node whose egress names
// domains.
type Proxies struct {
	Host Host
	// Nameserver, when set, is asked instead of the node's resolv.conf's ("host:port").
	Nameserver string
	// Decided is told of every connection of network n (Events for refusals).
	Decided func(n hostnet.Network, d Decision)

	mu      sync.Mutex
	running map[string]*running
}

type running struct {
	proxy *Proxy
	// net is the network as last ensured: its handlers read it without the Proxies' lock,
	// which a stop holds while it waits for them.
	net    atomic.Pointer[hostnet.Network]
	stop   context.CancelFunc
	done   chan struct{}
	listen net.Listener
}

// Ensure runs n's proxy, allowing domains, while n is present on the node with domains and
// NAT; otherwise it stops it.
func (ps *Proxies) Ensure(n hostnet.Network, domains []string, present bool) error {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.running == nil {
		ps.running = map[string]*running{}
	}
	key := n.Key()
	r := ps.running[key]
	if !present || !n.NAT || len(domains) == 0 {
		if r != nil {
			r.stop()
			<-r.done
			delete(ps.running, key)
		}
		return nil
	}
	if r != nil && r.net.Load().UID != n.UID { // the network was made anew under its name
		r.stop()
		<-r.done
		r = nil
	}
	if r == nil {
		l, err := ps.Host.ListenProxy(n)
		if err != nil {
			return err
		}
		r = &running{listen: l, done: make(chan struct{})}
		r.net.Store(&n)
		resolver := ps.Host.Resolver(ps.Nameserver)
		r.proxy = &Proxy{Listener: l, OriginalDst: OriginalDst, Dial: ps.Host.DialFromNode,
			Resolve: func(ctx context.Context, name string) ([]netip.Addr, error) {
				return lookup(ctx, resolver, ps.Nameserver, name)
			},
			Internal: func(a netip.Addr, port uint16) string { return ps.Host.Internal(*r.net.Load())(a, port) },
			Decided: func(d Decision) {
				connections.WithLabelValues(n.Namespace, n.Name, d.Result).Inc()
				if ps.Decided != nil {
					ps.Decided(*r.net.Load(), d)
				}
			}}
		ctx, cancel := context.WithCancel(context.Background())
		r.stop = cancel
		go func() { defer close(r.done); _ = r.proxy.Serve(ctx) }()
		ps.running[key] = r
	}
	r.net.Store(&n)
	r.proxy.SetDomains(slices.Clone(domains))
	return nil
}

// Stop stops every proxy.
func (ps *Proxies) Stop() {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for key, r := range ps.running {
		r.stop()
		<-r.done
		delete(ps.running, key)
	}
}

// Reporter tells of refused connections: a Warning Event on the VM that made one, naming what
// it asked for and why it was refused.
type Reporter struct {
	// Client reads the node's VMs (the agent's cache).
	Client   client.Reader
	Recorder events.EventRecorder
}

// Decided records d, a connection of network n, when it was refused.
func (r Reporter) Decided(n hostnet.Network, d Decision) {
	if d.Result == Allowed || r.Recorder == nil {
		return
	}
	var vms impv1.ImpVMList
	if err := r.Client.List(context.Background(), &vms, client.InNamespace(n.Namespace)); err != nil {
		return
	}
	for i := range vms.Items {
		vm := &vms.Items[i]
		if vm.Spec.NetworkRef == nil || vm.Spec.NetworkRef.Name != n.Name || vm.Status.IP != d.Client.Addr().String() {
			continue
		}
		why := d.Result
		if d.Err != nil {
			why += ": " + bounded(d.Err.Error())
		}
		r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "EgressRefused", "Egress",
			"a connection to %q (dialled %s) was refused by the network's domain egress: %s", d.Name, d.Dialed, why)
		return
	}
}

// lookup resolves name as the absolute name it is: the node's search domains (a pod's resolv.conf
// lists the cluster's, with ndots:5) are never tried, so a guest's name is neither looked up in
// the cluster's zones nor costs a query per search domain before its own. An error names the
// server asked (Go's names the first of resolv.conf's, even when dialling another).
func lookup(ctx context.Context, r *net.Resolver, nameserver, name string) ([]netip.Addr, error) {
	addrs, err := r.LookupNetIP(ctx, "ip4", strings.TrimSuffix(name, ".")+".")
	if de := (*net.DNSError)(nil); nameserver != "" && errors.As(err, &de) {
		de.Server = nameserver
	}
	return addrs, err
}
